"""Quantized checkpoints kept quantized: FP8 block-scaled and MXFP4 weights, dequantized when read.

Offloading is where quantized bytes pay: FP8 moves half the bytes of bf16
over the host link, MXFP4 about a quarter. So a quantized weight stays
quantized wherever the plan puts it (HBM, pinned memory read in place, a
prefetch slot), and becomes the model's dtype only when a module reads it:

- FP8, block-scaled (DeepSeek-V3, Kimi-K2, Qwen3-FP8): `X.weight` F8_E4M3
  [R, C] with `X.weight_scale_inv` F32 [ceil(R/b0), ceil(C/b1)], b = config.json's
  `quantization_config.weight_block_size` (default 128 x 128);
  w = fp8 x scale of its block, in f32, rounded once to the model's dtype.
- MXFP4 (gpt-oss, OCP Microscaling): `P_blocks` U8 [..., R, G, 16] (two E2M1
  values a byte, the low nibble first) with `P_scales` U8 [..., R, G] (E8M0:
  2^(s - 127) per 32 values); w = value x 2^(s - 127), exact in bf16. gpt-oss
  holds the result transposed ([E, H, 2I] from [E, 2I, H]).

How the model holds them. The model is built from config.json without
transformers' quantizer, so its tensors are plain (`X.weight` bf16). Before
the load, `prepare` makes the meta model hold what the checkpoint stores: an
FP8 weight's parameter becomes an F8 parameter of the same name and shape
with a buffer `<name>_scale_inv` beside it (for fused experts, whose scales
transformers does not fuse, the scales' pieces are derived from the weight's:
same expert, block rows scaled by the block); an MXFP4 parameter `P` is
replaced by parameters `P_blocks` and `P_scales`, the checkpoint's own names,
as transformers' own Mxfp4 experts module holds them. Each is a target like
any other, placed, filled and laid out as the plan says. Then `bind` swaps each
such module's class for a subclass whose class property `P` returns the
dequantized tensor, computed on access (as prefill.py reads staged parameters).
A Linear's forward reads its weight once; the temporary lives in the caching
allocator (a CUDA graph keeps it in its private pool).

Routed experts are never dequantized whole: offplan's experts implementation
(experts.py) gathers the touched experts' quantized rows and their scales,
then dequantizes those rows only.

On CUDA, FP8 dequantizes in one Triton kernel (reading through the zero-copy
view for a uva weight: each quantized byte crosses the link once, so at
prefill a uva FP8 weight is read once, not once per GEMM tile, and it is never
staged), and MXFP4 in bf16 in another (dequant.py: each value's bits built from
integers, exact). Elsewhere it is plain torch arithmetic. Both round the same
f32 product once (MXFP4's is exact), so outputs equal a checkpoint dequantized
on the host with the same formula and loaded in the model's dtype, bitwise. At decode on
CUDA (a few rows of activations), FP8 Linears and one token's FP8 experts
(and MXFP4 ones, in bf16) skip the dequantized copy: one kernel reads the
stored bytes and multiplies (gemv.py), the same products summed in another
order, so within one rounding of the dequantized model's outputs, not bitwise.

Limits: FP8 with per-tensor or per-channel scales (`weight_scale`, compressed-tensors),
int4/AWQ/GPTQ and NVFP4 are refused by name. `apply()` on an already
materialized model cannot re-quantize it: quantized plans load with `load()`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from planner.errors import ModelMismatchError
from planner.inputs.checkpoint import Checkpoint
from planner.inputs.quantized import FP8 as FP8_DTYPES, FP8_SCALE, MX_BLOCKS, MX_SCALES, unreadable

from .names import Piece, Target, map_tensors

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
DEFAULT_BLOCK = (128, 128)


@dataclass(frozen=True)
class Quant:
    """How a module's tensor `attr` is stored: `data` (quantized) and `scale`, both attributes of the module."""

    format: str  # "fp8" or "mxfp4"
    attr: str  # what the model reads (`weight`, `gate_up_proj`): a class property after `bind`
    data: str  # the stored tensor (`weight`: the same name for FP8; `gate_up_proj_blocks` for MXFP4)
    scale: str  # `weight_scale_inv`, `gate_up_proj_scales`
    block: tuple[int, int]  # elements per scale: FP8 (rows, cols); MXFP4 (1, 32)
    dtype: torch.dtype  # the dequantized dtype: the model's
    shape: tuple[int, ...]  # the dequantized shape: the model's
    transposed: bool = False  # MXFP4: the model holds the last two dims swapped


# ---------------------------------------------------------------- finding them

def scan(ckpt: Checkpoint) -> tuple[dict[str, str], dict[str, str]]:
    """(quantized data tensor -> its format, scale tensor -> its data tensor) of the checkpoint.

    Raises ModelMismatchError for quantized tensors offplan cannot read (FP8 without block scales)."""
    problems = unreadable(ckpt.tensors)  # planner/inputs/quantized.py: `plan build` refuses them too
    if problems:
        raise ModelMismatchError(f"{ckpt.root}: quantized tensors offplan cannot load", problems)
    fmt, scales = {}, {}
    tensors = ckpt.tensors
    for name, info in tensors.items():
        if info.dtype in FP8_DTYPES:
            fmt[name], scales[name + FP8_SCALE] = "fp8", name
        elif name.endswith(MX_BLOCKS) and info.dtype == "U8":
            fmt[name], scales[name[:-len(MX_BLOCKS)] + MX_SCALES] = "mxfp4", name
    return fmt, scales


def block_size(root: str | Path) -> tuple[int, int]:
    """FP8's elements per scale, from config.json's `quantization_config.weight_block_size`."""
    try:
        config = json.loads((Path(root) / "config.json").read_text())
    except (OSError, ValueError):
        return DEFAULT_BLOCK
    block = (config.get("quantization_config") or {}).get("weight_block_size") or DEFAULT_BLOCK
    return int(block[0]), int(block[1])


# ---------------------------------------------------------------- the meta model holds what is stored

def map_stored(model: torch.nn.Module, ckpt: Checkpoint, params: dict, formats: dict[str, str],
               scales: dict[str, str], tensors: dict | None = None
               ) -> tuple[list[Target], dict[torch.nn.Module, dict[str, Quant]]]:
    """`map_tensors` for a checkpoint with quantized tensors (`scan`'s): the meta model made to hold what the
    checkpoint stores (module doc), then mapped. `tensors`: the headers at the shapes to hold (one GPU's
    share under tensor parallelism; default the checkpoint's). Returns (targets, each FP8 scale after its
    weight; the quantized tensors by module). On error the model is left as it was."""
    tensors = ckpt.tensors if tensors is None else tensors
    planned = {n: (tensors[n].shape, p) for n, p in params.items()
               if formats.get(scales.get(n, "")) != "fp8"}  # FP8 scales follow their weights (_scale_target)
    mxfp4 = _prepare_mxfp4(model, ckpt, formats)
    try:
        targets = map_tensors(model, planned)
        targets, fp8 = _prepare_fp8(model, ckpt, targets, formats, block_size(ckpt.root), params)
    except BaseException:
        unprepare(mxfp4)
        raise
    for module, quants in fp8.items():
        mxfp4.setdefault(module, {}).update(quants)
    return targets, mxfp4


def unprepare(found: dict[torch.nn.Module, dict[str, Quant]]) -> None:
    """Undo `map_stored` on a model not yet loaded: each quantized tensor a plain meta parameter again."""
    for module, quants in found.items():
        for q in quants.values():
            _replace(module, (q.data, q.scale), {q.attr: _meta(q.shape, q.dtype)})


def _replace(module: torch.nn.Module, drop: tuple[str, ...], add: dict[str, torch.Tensor],
             buffers: dict[str, torch.Tensor] | None = None) -> None:
    for name in drop:
        module._parameters.pop(name, None)
        module._buffers.pop(name, None)
    for name, t in add.items():
        module.register_parameter(name, t)
    for name, t in (buffers or {}).items():
        module.register_buffer(name, t)


def _meta(shape, dtype) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(tuple(shape), dtype=dtype, device="meta"), requires_grad=False)


def _prepare_mxfp4(model: torch.nn.Module, ckpt: Checkpoint, formats: dict[str, str]) -> dict:
    """Before mapping: each MXFP4 parameter `P` replaced by meta `P_blocks` and `P_scales` (module doc)."""
    state = model.state_dict(keep_vars=True)
    found: dict[torch.nn.Module, dict[str, Quant]] = {}
    stored = {}
    problems = []
    for blocks in (n for n, f in formats.items() if f == "mxfp4"):
        name = blocks[:-len(MX_BLOCKS)]
        target = name if name in state else next((n for n in state if n.endswith("." + name)), None)
        if target is None:
            problems.append(f"{blocks}: the model has no tensor {name} to dequantize it into")
            continue
        path, _, attr = target.rpartition(".")
        module = model.get_submodule(path)
        want = tuple(state[target].shape)
        b, s = ckpt.tensors[blocks], ckpt.tensors[name + MX_SCALES]
        plain = (*b.shape[:-2], b.shape[-2] * b.shape[-1] * 2)
        swapped = (*plain[:-2], plain[-1], plain[-2])
        if want not in (plain, swapped) or tuple(s.shape) != tuple(b.shape[:-1]):
            problems.append(f"{blocks} {list(b.shape)} with scales {list(s.shape)} does not dequantize to "
                            f"{target}'s shape {list(want)}")
            continue
        # which way round: by shape, or for a square matrix by the experts module's own flag
        transposed = want != plain if plain != swapped else bool(getattr(module, "is_transposed", False))
        q = Quant("mxfp4", attr, attr + MX_BLOCKS, attr + MX_SCALES, (1, 32), state[target].dtype, want, transposed)
        found.setdefault(module, {})[attr] = q
        stored[(module, attr)] = (b.shape, s.shape)
    if problems:
        raise ModelMismatchError(f"the MXFP4 tensors do not fit this model ({type(model).__name__})", problems)
    for (module, attr), (blocks_shape, scales_shape) in stored.items():
        q = found[module][attr]
        _replace(module, (attr,), {q.data: _meta(blocks_shape, torch.uint8), q.scale: _meta(scales_shape, torch.uint8)})
    return found


def _prepare_fp8(model: torch.nn.Module, ckpt: Checkpoint, targets: list[Target], formats: dict[str, str],
                 block: tuple[int, int], place) -> tuple[list[Target], dict]:
    """After mapping: each target filled from FP8 tensors stored as F8, with its scale target after it.
    `place`: checkpoint name -> placement."""
    out: list[Target] = []
    found: dict[torch.nn.Module, dict[str, Quant]] = {}
    changes = []  # (target, its F8 dtype, scale target)
    problems = []
    for t in targets:
        out.append(t)
        sources = [p.source for p in t.pieces]
        fp8 = [s for s in sources if formats.get(s) == "fp8"]
        if not fp8:
            continue
        if len(fp8) != len(sources):
            problems.append(f"{t.name}: some of its checkpoint tensors are FP8 and some are not")
            continue
        scale = _scale_target(t, block, place, problems)
        if scale is None:
            continue
        for alias in t.aliases:
            path, _, attr = alias.rpartition(".")
            module = model.get_submodule(path)
            if module._parameters.get(attr) is None:
                problems.append(f"{alias}: an FP8 weight must be a parameter to be read dequantized")
                continue
            found.setdefault(module, {})[attr] = Quant("fp8", attr, attr, attr + FP8_SCALE, block,
                                                       module._parameters[attr].dtype, t.shape)
        changes.append((t, _TORCH_FP8[ckpt.tensors[fp8[0]].dtype], scale))
        out.append(scale)
    if problems:
        raise ModelMismatchError(f"the FP8 tensors do not fit this model ({type(model).__name__})", problems)
    for t, dtype, scale in changes:
        t.dtype = dtype
        for alias in t.aliases:
            path, _, attr = alias.rpartition(".")
            _replace(model.get_submodule(path), (attr,), {attr: _meta(t.shape, dtype)},
                     {attr + FP8_SCALE: torch.empty(scale.shape, dtype=torch.float32, device="meta")})
    return out, found


_TORCH_FP8 = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _scale_target(t: Target, block: tuple[int, int], place, problems: list[str]) -> Target | None:
    """The scales of `t`'s FP8 pieces as one target: each piece's scale lands where its weight does,
    block rows and columns scaled by the block (a fused gate/up must split on a block boundary)."""
    rank = len(t.shape)
    shape = (*t.shape[:-2], -(-t.shape[-2] // block[0]), -(-t.shape[-1] // block[1]))
    pieces = []
    for p in t.pieces:
        index = []
        for dim, i in enumerate(p.index):
            if isinstance(i, int) or dim < rank - 2:
                index.append(i)
                continue
            b = block[dim - (rank - 2)]
            start, stop = i.start or 0, t.shape[dim] if i.stop is None else i.stop
            if start % b or (stop % b and stop != t.shape[dim]):
                problems.append(f"{p.source}: it fills {t.name}[{start}:{stop}] along dim {dim}, which does "
                                f"not start on a {b}-element scale block")
                return None
            index.append(slice(start // b, -(-stop // b)))
        scale = p.source + FP8_SCALE
        if place[scale] is not place[p.source]:
            problems.append(f"{scale}: placed {place[scale].value} but its weight {p.source} is "
                            f"{place[p.source].value}; a weight and its scales are one unit: rebuild the plan")
            return None
        pieces.append(Piece(scale, tuple(index)))
    return Target(t.name + FP8_SCALE, tuple(a + FP8_SCALE for a in t.aliases), shape, torch.float32, pieces,
                  t.placement, t.resident, t.on_cpu)
