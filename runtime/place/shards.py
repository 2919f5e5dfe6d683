"""One GPU's share of a tensor-parallel plan: the model's tensors cut to it, and the checkpoint bytes that fill it.

A tensor-parallel plan (planner/layers/shards.py, the plan's `parallel:`)
names, by template, the checkpoint tensors of which each of its `gpus` GPUs
holds 1/gpus along one dimension. Each process applies the plan to its own
share, `rank`:

- the model, built on the meta device at full size, gets each split parameter
  re-registered at its share's shape (`shrink`), still on the meta device:
  the model a process runs is transformers' own, with fewer heads, a narrower
  MLP and narrower experts per GPU (its forwards read shapes from their
  weights; the KV cache takes its heads from the first keys it stores);
- a fused parameter (transformers' `gate_up_proj` [E, 2I, H], from per-expert
  gate [I, H] and up [I, H]) takes each piece's share: the fusion of the
  split pieces is exactly transformers' `packed_colwise` share of the fused
  parameter ([gate_r; up_r] per expert);
- `check_styles` holds every split against transformers' own tensor-parallel
  plan for the model (`model.tp_plan`): a piece split along its output
  features (dim 0) must be colwise there, one split along its input features
  (dim 1) rowwise, and the module whose outputs the GPUs sum must be rowwise
  or transformers' MoE experts style. A plan that splits what transformers
  does not is refused, naming the tensor;
- `SlicingReader` reads the share's bytes from the shard files: rows of a
  dim-0 split are contiguous in the file (a zero-copy view), columns of a
  dim-1 split are gathered into a contiguous copy on the host.

Why offplan does not call transformers' `apply_tensor_parallelism`: it wraps
every split parameter in a DTensor for transformers' own loader, installs
each module's collective by replacing its `forward`, and sums an experts
module's output only when its parameters are DTensors. offplan's parameters
are plain tensors wherever the plan puts them (HBM, a zero-copy view of
pinned memory, a prefetch slot), so it applies transformers' plan itself:
these shares, and the collectives of runtime/distributed/collectives.py.
"""
from __future__ import annotations

from collections.abc import Mapping
from math import prod

import torch

from planner.errors import ModelMismatchError, OffplanError
from planner.inputs.checkpoint import Checkpoint
from planner.layers.shards import local_tensors, template
from planner.plan import Parallel, Plan

from ..distributed.collectives import TensorParallel
from . import quant
from .loader import TORCH_DTYPES, ShardReader
from .names import Target, map_tensors

COLWISE = {"colwise", "packed_colwise", "colwise_gather_output", "colwise_rep"}
ROWWISE = {"rowwise"}
REDUCED = {"rowwise", "moe_tp_experts"}  # transformers' styles of a module whose outputs the GPUs sum
GATHERED = {"colwise_gather_output"}
_UNITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # an element's bytes as one integer


def split_dim(target: Target, dims: Mapping[str, int]) -> tuple[int, int] | None:
    """(the dimension of the model tensor `target` that the plan splits, its checkpoint pieces' dimension),
    or None for a tensor every GPU holds whole. A fused tensor's dimension is its pieces' shifted by the
    indices that place a piece in it (an expert's number)."""
    got = {(d + sum(isinstance(i, int) for i in p.index), d) if (d := dims.get(template(p.source))) is not None
           else None for p in target.pieces}
    if len(got) > 1:
        raise ModelMismatchError(f"{target.name}: the plan splits some of its checkpoint pieces and not others, or "
                                 "along different dimensions; rebuild the plan")
    return got.pop()


def shrink(model: torch.nn.Module, targets: list[Target], par: Parallel) -> dict[str, tuple[int, int]]:
    """Re-register each split parameter of the meta model at one GPU's share of its shape; returns
    target name -> `split_dim`. Buffers are never split."""
    dims = par.dims
    split = {}
    params = {id(p) for p in model.parameters()}
    state = model.state_dict(keep_vars=True)
    for t in targets:
        got = split_dim(t, dims)
        if got is None:
            continue
        dim = got[0]
        if id(state[t.name]) not in params:
            raise ModelMismatchError(f"{t.name}: the plan splits it, but it is a buffer of the model, not a parameter")
        shape = list(t.shape)
        if shape[dim] % par.gpus:
            raise ModelMismatchError(f"{t.name}: its dim {dim} ({shape[dim]}) does not divide by {par.gpus} GPUs")
        shape[dim] //= par.gpus
        for alias in t.aliases:
            path, _, name = alias.rpartition(".")
            module = model.get_submodule(path)
            module.register_parameter(name, torch.nn.Parameter(
                torch.empty(shape, dtype=t.dtype, device="meta"), requires_grad=False))
        split[t.name] = got
    return split


def combined(targets: list[Target], split: Mapping[str, tuple[int, int]], gather: tuple[str, ...]
             ) -> tuple[list[str], list[str]]:
    """The model's modules whose outputs the GPUs sum (those holding a tensor split along its checkpoint
    pieces' input features: the plan's `reduce`, as the model names them) and concatenate (those holding a
    split tensor under a module of the plan's `gather`)."""
    under = tuple(template(g) + "." for g in gather)
    reduce = {t.name.rpartition(".")[0] for t in targets if split.get(t.name, (0, 0))[1] == 1}
    gathered = {t.name.rpartition(".")[0] for t in targets
                if t.name in split and any(template(p.source).startswith(under) for p in t.pieces)}
    return sorted(reduce), sorted(gathered)


def check_styles(model: torch.nn.Module, targets: list[Target], split: Mapping[str, tuple[int, int]],
                 reduce: list[str], gather: list[str]) -> None:
    """Hold the plan's split against transformers' tensor-parallel plan for this model (module doc); one error
    listing every disagreement. `reduce` and `gather`: the model's module paths the plan combines."""
    plan = getattr(model, "tp_plan", None) or {}
    if not plan:
        raise ModelMismatchError(f"{type(model).__name__} has no tensor-parallel plan in transformers "
                                 "(`model.tp_plan` is empty): plan it on one GPU")
    problems = []

    def style(name: str) -> str | None:
        module = name.rpartition(".")[0]
        return plan.get(template(name)) or plan.get(template(module))

    for t in targets:
        if t.name not in split:
            continue
        dim, pieces = split[t.name]
        want = ROWWISE if pieces == 1 else COLWISE  # input features, or output features
        got = style(t.name)
        if got not in want:
            problems.append(f"{t.name}: the plan splits it along dim {dim}, which is {' or '.join(sorted(want))} "
                            f"in transformers' plan; transformers' plan says {got or 'nothing'} for it")
    for path in reduce:
        if (got := plan.get(template(path))) not in REDUCED:
            problems.append(f"{path}: the plan sums its outputs over the GPUs; transformers' plan says "
                            f"{got or 'nothing'} for it")
    for path in gather:
        if (got := plan.get(template(path))) not in GATHERED:
            problems.append(f"{path}: the plan gathers its outputs; transformers' plan says {got or 'nothing'}")
    if problems:
        raise ModelMismatchError(f"the plan's tensor-parallel split is not transformers' for "
                                 f"{type(model).__name__}: {len(problems)} problems", problems)


class SlicingReader(ShardReader):
    """A ShardReader that hands out one GPU's share of each split checkpoint tensor (module doc). `tensors`
    are the whole checkpoint's headers; `dims` the plan's split templates."""

    def __init__(self, checkpoint, dims: Mapping[str, int], rank: int, gpus: int):
        super().__init__(checkpoint)
        self.dims, self.rank, self.gpus = dims, rank, gpus

    def raw(self, name: str) -> torch.Tensor:
        whole = super().raw(name)
        dim = self.dims.get(template(name))
        if dim is None or whole.numel() == 0:
            return whole
        info = self.checkpoint.tensors[name]
        shape = info.shape
        item = info.nbytes // prod(shape)
        # columns are copied element by element: as whole elements where the bytes are aligned (a copy of
        # single bytes is several times slower), else as bytes
        unit = _UNITS.get(item) if info.offset % item == 0 else None
        words = whole if unit is None else whole.view(unit)
        width = 1 if unit is not None else item
        grid = words.view(prod(shape[:dim]), shape[dim], prod(shape[dim + 1:]) * width)
        share = shape[dim] // self.gpus
        part = grid.narrow(1, self.rank * share, share)
        part = part.reshape(-1) if dim == 0 else part.contiguous().view(-1)
        return part if unit is None else part.view(torch.uint8)

    def typed(self, name: str) -> torch.Tensor:
        info = self.checkpoint.tensors[name]
        raw = self.raw(name)
        dim = self.dims.get(template(name))
        shape = list(info.shape)
        if dim is not None:
            shape[dim] //= self.gpus
        return raw.clone().view(TORCH_DTYPES[info.dtype]).view(shape)


def share(model, plan: Plan, ckpt: Checkpoint, stored: tuple[dict, dict], from_checkpoint: bool):
    """Step 2 under tensor parallelism: this process's place among the GPUs (a world of another size is
    refused as stale), the meta model cut to its share, the share's headers, and the targets mapped at
    the share's shapes, the split held against transformers' own plan (place/shards.py). `stored`:
    `quant.scan`'s (formats, scales); an FP8 model then holds its share as stored (quant.py), the scales
    cut with their weights. Returns (tp, the share's headers, targets, the quantized tensors by module)."""
    if not from_checkpoint:
        raise OffplanError("runtime.apply() cannot take a tensor-parallel plan: each process reads its share "
                           "of the checkpoint; build the model on the meta device and use runtime.load()")
    formats, scales = stored
    if any(f != "fp8" for f in formats.values()):
        raise OffplanError(f"{ckpt.root}: an MXFP4 checkpoint under a tensor-parallel plan is not supported: "
                           "build its plan for one GPU (no `gpus:` in the policy)")
    par = plan.parallel
    tp = TensorParallel(par)
    plain = {n: p for n, p in plan.params.items() if n not in scales}  # FP8 scales are no tensors of the model
    whole = map_tensors(model, {n: (ckpt.tensors[n].shape, p) for n, p in plain.items()})
    split = shrink(model, whole, par)
    local = local_tensors(ckpt.tensors, par.dims, par.gpus)
    if formats:
        targets, quantized = quant.map_stored(model, ckpt, plan.params, formats, scales, local)
    else:
        targets, quantized = map_tensors(model, {n: (local[n].shape, p) for n, p in plan.params.items()}), {}
    reduce, gather = combined(targets, split, par.gather)
    try:
        check_styles(model, targets, split, reduce, gather)
    except BaseException:
        quant.unprepare(quantized)
        raise
    tp.modules(reduce, gather)
    return tp, local, targets, quantized
