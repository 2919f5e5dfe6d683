"""Quantized tensors and their scales: one unit of placement.

A quantized checkpoint stores a weight as low-precision data plus scales
(runtime/place/quant.py reads them):
- FP8, block-scaled: `X.weight` F8_E4M3 (or F8_E5M2) [..., R, C] with `X.weight_scale_inv`
  F32 [..., ceil(R / b0), ceil(C / b1)], one scale per b0 x b1 block (config.json's
  `quantization_config.weight_block_size`, default 128 x 128; `block_scales`);
- MXFP4: `P_blocks` U8 with `P_scales` U8.

The runtime keeps both quantized wherever the plan puts them and dequantizes
when a module reads the weight, so a weight and its scales are always placed
together: every walk moves them as one (footprint.py `Footprint.move`), and a
rule that separates them is an error. Their bytes are the stored bytes, so
the footprint and the cost model count quantized bytes.

Quantized tensors are never staged at prefill (staging.py): the dequantization
reads each byte once whatever the number of tokens, and writes the model's
dtype to a temporary that the GEMM reads from GPU memory.
"""
from __future__ import annotations

from collections.abc import Mapping
from itertools import chain, compress
from operator import itemgetter

from ..errors import PolicyError
from .checkpoint import TensorInfo

FP8 = ("F8_E4M3", "F8_E5M2")
FP8_SCALE = "_scale_inv"
MX_BLOCKS, MX_SCALES = "_blocks", "_scales"
_STORED = frozenset({*FP8, "U8"})  # the dtypes a quantized tensor is stored in
_DTYPE = itemgetter(1)  # of a TensorInfo


def partners(tensors: Mapping[str, TensorInfo]) -> dict[str, str]:
    """Each quantized weight -> its scales, and each scales tensor -> its weight (module doc)."""
    return pairs(tensors)[0]


def unreadable(tensors: Mapping[str, TensorInfo], block: tuple[int, int] | None = None) -> list[str]:
    """One line per quantized tensor without the scales the runtime needs, each with what to use instead:
    `plan build` refuses such a checkpoint, and so does the runtime. With `block` (config.json's FP8
    `weight_block_size`; config.py), FP8 scales of another shape are refused too: per-tensor or per-row
    scales stored under the block scales' name (the runtime fails on them at load)."""
    return pairs(tensors, block)[1]


def block_scales(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...] | None:
    """The shape of an FP8 weight's block scales: one per `block` (rows, columns) of each matrix, the last
    block cut short (runtime/place/quant.py); None for a weight that is no matrix, which has none."""
    if len(shape) < 2:
        return None
    return (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))


def pairs(tensors: Mapping[str, TensorInfo], block: tuple[int, int] | None = None
          ) -> tuple[dict[str, str], list[str]]:
    """`partners` and `unreadable` in one pass over the checkpoint (layers/scales.py finds the partners once per
    kind of layer where it can: `plan build` needs both)."""
    out: dict[str, str] = {}
    problems: list[str] = []
    for weight, scale in matched(tensors, block, problems):
        out[weight], out[scale] = scale, weight
    return out, problems


def matched(tensors: Mapping[str, TensorInfo], block: tuple[int, int] | None, problems: list[str]
            ) -> list[tuple[str, str]]:
    """Each quantized weight with its scales, (weight, scales), in the order of `tensors`; a line in `problems`
    for each quantized tensor `unreadable` names."""
    out: list[tuple[str, str]] = []
    fix = "use the model's block-scaled FP8 release, or its bf16 one"
    shaped: dict[tuple, bool] = {}  # (weight shape, scales shape) -> whether those are its block scales
    stored = compress(tensors.items(), map(_STORED.__contains__, map(_DTYPE, tensors.values())))  # sifted in C
    for name, t in stored:
        fp8 = t[1] in FP8  # the scales' name, by the module doc's names (inline: 45k tensors on DeepSeek-V3)
        if fp8:
            scale = name + FP8_SCALE
        elif name.endswith(MX_BLOCKS):
            scale = name[:-len(MX_BLOCKS)] + MX_SCALES
        else:
            continue
        if scale in tensors:
            out.append((name, scale))
            if block is None or not fp8:
                continue
            got = tensors[scale].shape
            ok = shaped.get(key := (t.shape, got))
            if ok is None:
                ok = shaped[key] = block_scales(t.shape, block) == got
            if not ok:
                want, (rows, cols) = block_scales(t.shape, block), block
                problems.append(f"{name}: {t.dtype} {list(t.shape)} with scales {scale} {list(got)}, which are not "
                                f"its {rows} x {cols} block scales ("
                                + (f"those would be {list(want)}" if want else "a block-scaled FP8 weight is a matrix")
                                + "; the block is config.json's quantization_config.weight_block_size, default 128 x "
                                f"128): only block-scaled FP8 is supported: {fix}")
        elif t.dtype in FP8:
            problems.append(f"{name}: {t.dtype} without {scale}: only block-scaled FP8 is supported (per-tensor "
                            f"`weight_scale` and compressed-tensors checkpoints are not): {fix}")
        else:
            problems.append(f"{name}: MXFP4 blocks without {scale}")
    return out


def host_computes(name: str, tensors: Mapping[str, TensorInfo], partner: Mapping[str, str]) -> bool:
    """Whether the runtime's host computes the expert tensor `name` on cpu (runtime/execute/host/): a plain
    weight (bf16, fp16, fp32), or a block-scaled FP8 (E4M3) one and its scales, which native.cpp converts as it
    reads them; never MXFP4 or E5M2."""
    return name not in partner or "F8_E4M3" in (tensors[name].dtype, tensors[partner[name]].dtype)


def with_partners(names, partner: Mapping[str, str]) -> list[str]:
    """`names`, then the partner of each (once each, in order)."""
    names = list(names)
    return list(dict.fromkeys(chain(names, filter(None, map(partner.get, names)))))


def apart(place: Mapping[str, object], tensors: Mapping[str, TensorInfo]) -> list[str]:
    """One line per weight placed apart from its scales."""
    return [f"{w} is {place[w].value} but its scales {s} are {place[s].value}" for w, s in partners(tensors).items()
            if w < s and w in place and s in place and place[w] is not place[s]]


def check_rules(path, place: Mapping[str, object], fixed: set[str], partner: Mapping[str, str]) -> None:
    """Refuse rules that place a quantized weight apart from its scales, or one without the other;
    `partner`: `partners(tensors)`. `place` has what the rules placed and nothing else off its default, so
    only pairs with a member in `fixed` can be apart: only those are looked at, and named in order of name."""
    near = {m for n in fixed for m in (n, partner.get(n)) if m in partner}
    odd = sorted(f"{w} and {s}" for w in near for s in [partner[w]]
                 if w < s and ((w in fixed) != (s in fixed) or place[w] is not place[s]))
    if odd:
        raise PolicyError(f"{path}: rules place {len(odd)} quantized weights apart from their scales; a weight "
                          "and its scales are one unit (the runtime dequantizes one with the other): make the "
                          "rules match both, for example by the module's name", odd)
