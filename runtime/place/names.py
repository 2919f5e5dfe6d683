"""The checkpoint-to-transformers mapping: which checkpoint tensors make up which model tensor.

Most models name their parameters exactly as the checkpoint does. transformers
5.x does not always: it fuses per-expert checkpoint tensors into one runtime
parameter (Qwen3-MoE's `mlp.experts.gate_up_proj` [E, 2I, H] is built from
`mlp.experts.{e}.gate_proj.weight` and `...up_proj.weight`), renames modules
(Mixtral's `block_sparse_moe` -> `mlp`) and adds or strips the base-model prefix.
We ask transformers for the model's own conversion list and interpret the two
operations that fusing uses, `MergeModulelist(dim=0)` (stack experts) and
`Concatenate(dim=d)` (join gate and up), as *where each source lands*: a
`Piece(source, index)` means `target[index]` is exactly that checkpoint tensor.
Anything else transformers might do (transposes, permutes, quantized
formats) is refused by name rather than guessed.

Tied weights (an embedding shared with the head) are one tensor with several
names; it is loaded once, from the first of its names found in the checkpoint.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from planner.errors import ModelMismatchError
from planner.plan import Placement


@dataclass(frozen=True)
class Piece:
    source: str  # checkpoint tensor name
    index: tuple = ()  # where it lands in the target; () = the whole tensor


@dataclass
class Target:
    """One tensor of the model (a parameter or persistent buffer) and its sources."""

    name: str  # canonical name (first in model.state_dict order)
    aliases: tuple[str, ...]  # every name of this tensor, canonical first (tied weights)
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[Piece] = field(default_factory=list)
    placement: Placement | None = None
    # A fused expert parameter split between the GPU, uva and cpu (planner/layers/groups.py): placement is UVA (the
    # whole parameter in pinned memory), these experts are also resident in HBM (runtime/execute/experts.py),
    resident: tuple[int, ...] = ()
    # and these the host CPU computes (runtime/execute/host/).
    on_cpu: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def _conversions(model) -> tuple[list, list]:
    """transformers' renamings and converters for this model ([] for plain modules)."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter
    except ImportError:
        return [], []
    if not isinstance(model, PreTrainedModel):
        return [], []
    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    return renamings, converters


def _fused_index(converter, pattern: str, name: str, shapes: Mapping[str, tuple], grouped) -> tuple | str:
    """The index of `name` inside the converter's target, or a reason it is unsupported."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(converter.operations)
    kinds = [type(op) for op in ops]
    if not ops or kinds[0] is not MergeModulelist or ops[0].dim != 0 or \
            any(k is not Concatenate for k in kinds[1:]) or len(ops) > 2:
        return f"conversion {[k.__name__ for k in kinds]} is not supported (only expert stacking and concatenation)"
    rx = re.escape(pattern).replace(r"\*", r"(\d+)")
    m = re.search(rx, name)
    if m is None:
        return f"cannot find the expert number of {name} in pattern {pattern!r}"
    expert = int(m.group(1))
    patterns = list(converter.source_patterns)
    j = patterns.index(pattern)
    if len(ops) == 1:
        return (expert,) if len(patterns) == 1 else "several sources stacked without concatenation"
    dim = ops[1].dim
    if dim != 1:  # pieces along dim 1 of [E, ...] are contiguous blocks: what the loader writes into
        return f"concatenation along dim {dim} is not supported (only dim 1, as gate/up fusion uses)"
    offset = 0
    for p in patterns[:j]:
        sample = grouped.get(p)
        if sample is None:
            return f"no checkpoint tensor matches {p!r}"
        offset += shapes[sample][dim - 1]
    width = shapes[name][dim - 1]
    return (expert,) + (slice(None),) * (dim - 1) + (slice(offset, offset + width),)


def map_tensors(model: torch.nn.Module, checkpoint: Mapping[str, tuple[tuple[int, ...], Placement]]
                ) -> list[Target]:
    """Map checkpoint tensors (name -> (shape, placement)) to the model's tensors.

    Returns the model's targets in checkpoint (= plan = execution) order of their
    first piece, each with its placement. Raises ModelMismatchError listing every
    model tensor no checkpoint tensor fills, every checkpoint tensor the model
    does not use, shape mismatches, and fused tensors whose sources disagree on
    their placement.
    """
    state = model.state_dict(keep_vars=True)
    by_id: dict[int, Target] = {}
    targets: dict[str, Target] = {}
    for name, t in state.items():
        tgt = by_id.get(id(t))
        if tgt is None:
            tgt = Target(name, (name,), tuple(t.shape), t.dtype)
            by_id[id(t)] = tgt
        else:
            tgt.aliases += (name,)
        targets[name] = tgt

    renamings, converters = _conversions(model)
    shapes = {n: s for n, (s, _) in checkpoint.items()}
    problems: list[str] = []
    unused: list[str] = []
    routed: list[tuple[str, str, object, str | None]] = []  # (source, target, converter, pattern)
    first_match: dict[tuple[int, str], str] = {}
    if renamings or converters:
        from transformers.core_model_loading import rename_source_key
        for src in checkpoint:
            new, pattern = rename_source_key(src, renamings, converters, getattr(model, "base_model_prefix", None),
                                             state)
            conv = None
            if pattern is not None:
                conv = next(c for c in converters if pattern in c.source_patterns)
                first_match.setdefault((id(conv), pattern), src)
            routed.append((src, new, conv, pattern))
    else:
        routed = [(src, src, None, None) for src in checkpoint]

    for src, new, conv, pattern in routed:
        tgt = targets.get(new)
        if tgt is None:
            unused.append(src)
            continue
        if conv is None:
            if tgt.pieces and not any(p.index for p in tgt.pieces):
                continue  # a tied alias also stored in the checkpoint: loaded once, from the first
            if shapes[src] != tgt.shape:
                problems.append(f"{src}: the checkpoint has shape {list(shapes[src])}, the model's "
                                f"{new} has {list(tgt.shape)}")
                continue
            tgt.pieces.append(Piece(src))
            continue
        grouped = {p: first_match.get((id(conv), p)) for p in conv.source_patterns}
        index = _fused_index(conv, pattern, src, shapes, grouped)
        if isinstance(index, str):
            problems.append(f"{src} -> {new}: {index}")
            continue
        try:
            want = tuple(torch.empty(tgt.shape, device="meta")[index].shape)
        except IndexError:
            want = None
        if want != shapes[src]:
            problems.append(f"{src}: shape {list(shapes[src])} does not fit {new}{_fmt(index)} "
                            f"of shape {list(tgt.shape)}")
            continue
        tgt.pieces.append(Piece(src, index))

    unique = list({id(t): t for t in targets.values()}.values())
    missing = []
    for tgt in unique:
        if not tgt.pieces:
            missing.append(tgt.name)
            continue
        covered = sum(_numel(shapes[p.source]) for p in tgt.pieces)
        total = _numel(tgt.shape)
        if covered != total:
            problems.append(f"{tgt.name}: the checkpoint fills {covered} of its {total} elements")
        places = {checkpoint[p.source][1] for p in tgt.pieces}
        if len(places) == 1 and Placement.CPU not in places:
            tgt.placement = places.pop()
            continue
        if places == {Placement.CPU} and len(tgt.pieces) == 1 and not tgt.pieces[0].index:  # fused as stored
            tgt.placement, tgt.on_cpu = Placement.UVA, tuple(range(tgt.shape[0]))
            continue
        split = _split_experts(tgt, {p.source: checkpoint[p.source][1] for p in tgt.pieces})
        if isinstance(split, str):
            problems.append(split)
            continue
        tgt.placement, (tgt.resident, tgt.on_cpu) = Placement.UVA, split
    problems = [f"model tensor {n} is missing from the plan (no checkpoint tensor fills it)" for n in fold(missing)] \
        + [f"plan entry {n} is missing from the model" for n in fold(unused)] + problems
    if problems:
        raise ModelMismatchError(f"the plan does not match this model ({type(model).__name__}): "
                                 f"{len(problems)} problems", problems)
    order = {n: i for i, n in enumerate(checkpoint)}
    unique.sort(key=lambda t: min(order[p.source] for p in t.pieces))
    return unique


def _split_experts(tgt: Target, place: Mapping[str, Placement]) -> tuple[tuple[int, ...], tuple[int, ...]] | str:
    """(the experts on the GPU, those on cpu) of a fused parameter whose experts are placed apart (gpu, uva,
    cpu), or why the split cannot be applied: an expert's pieces disagree, or part of it is prefetched."""
    by_expert: dict[int, set[Placement]] = {}
    for p in tgt.pieces:
        if not p.index:
            return f"{tgt.name}: its sources are placed differently, but it is no stack of experts"
        by_expert.setdefault(p.index[0], set()).add(place[p.source])
    odd = [e for e, ps in by_expert.items() if len(ps) > 1]
    if odd:
        return (f"{tgt.name}: expert {odd[0]}'s pieces are placed apart, but they are one row of the parameter; "
                "rebuild the plan (the planner keeps an expert's gate and up together)")
    if any(Placement.PREFETCH in ps for ps in by_expert.values()):
        return (f"{tgt.name}: part of it is prefetched; a prefetched parameter is a view of one slot, so all of "
                "it must be (rebuild the plan)")
    return tuple(sorted(e for e, ps in by_expert.items() if Placement.GPU in ps)), \
        tuple(sorted(e for e, ps in by_expert.items() if Placement.CPU in ps))


_NUMBER = re.compile(r"(?<=\.)\d+(?=\.|$)")


def fold(names: list[str]) -> list[str]:
    """Names with the same shape up to layer/expert numbers, folded into one line each.

    ["m.layers.0.w", "m.layers.1.w", "lm_head.weight"] -> ["m.layers.*.w (2 tensors, e.g. m.layers.0.w)",
    "lm_head.weight"]: every name is accounted for, in a list short enough to read.
    """
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(_NUMBER.sub("*", n), []).append(n)
    return [members[0] if len(members) == 1 else f"{tpl} ({len(members)} tensors, e.g. {members[0]})"
            for tpl, members in groups.items()]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _fmt(index: tuple) -> str:
    parts = [str(i) if isinstance(i, int) else
             (":" if i.start is None else f"{i.start}:{i.stop}") for i in index]
    return "[" + ", ".join(parts) + "]"
