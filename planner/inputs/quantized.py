"""Quantized tensors and their scales: one unit of placement.

A quantized checkpoint stores a weight as low-precision data plus scales
(runtime/place/quant.py reads them):
- FP8, block-scaled: `X.weight` F8_E4M3 (or F8_E5M2) with `X.weight_scale_inv`;
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

from ..errors import PolicyError
from .checkpoint import TensorInfo

FP8 = ("F8_E4M3", "F8_E5M2")
FP8_SCALE = "_scale_inv"
MX_BLOCKS, MX_SCALES = "_blocks", "_scales"


def _scale_of(name: str, t: TensorInfo) -> str | None:
    """The scales tensor a quantized tensor needs, by the module doc's names; None: not quantized."""
    if t.dtype in FP8:
        return name + FP8_SCALE
    if t.dtype == "U8" and name.endswith(MX_BLOCKS):
        return name[:-len(MX_BLOCKS)] + MX_SCALES
    return None


def partners(tensors: Mapping[str, TensorInfo]) -> dict[str, str]:
    """Each quantized weight -> its scales, and each scales tensor -> its weight (module doc). A plan
    computes this once (placement.py) and hands it to what needs it."""
    out = {}
    for name, t in tensors.items():
        scale = _scale_of(name, t)
        if scale in tensors:
            out[name], out[scale] = scale, name
    return out


def unreadable(tensors: Mapping[str, TensorInfo]) -> list[str]:
    """One line per quantized tensor without the scales the runtime needs, each with what to use instead:
    `plan build` refuses such a checkpoint, and so does the runtime."""
    out = []
    for name, t in tensors.items():
        scale = _scale_of(name, t)
        if scale is None or scale in tensors:
            continue
        if t.dtype in FP8:
            out.append(f"{name}: {t.dtype} without {scale}: only block-scaled FP8 is supported (per-tensor "
                       "`weight_scale` and compressed-tensors checkpoints are not): use the model's block-scaled "
                       "FP8 release, or its bf16 one")
        else:
            out.append(f"{name}: MXFP4 blocks without {scale}")
    return out


def with_partners(names, partner: Mapping[str, str]) -> list[str]:
    """`names` and the partner of each (once each, in order)."""
    out = dict.fromkeys(names)
    for n in list(out):
        p = partner.get(n)
        if p is not None:
            out.setdefault(p)
    return list(out)


def apart(place: Mapping[str, object], tensors: Mapping[str, TensorInfo]) -> list[str]:
    """One line per weight placed apart from its scales."""
    return [f"{w} is {place[w].value} but its scales {s} are {place[s].value}" for w, s in partners(tensors).items()
            if w < s and w in place and s in place and place[w] is not place[s]]


def check_rules(path, place: Mapping[str, object], fixed: set[str], pairs: Mapping[str, str]) -> None:
    """Refuse rules that place a quantized weight apart from its scales, or one without the other;
    `pairs`: `partners(tensors)`."""
    odd = [f"{w} and {s}" for w, s in pairs.items()
           if w < s and ((w in fixed) != (s in fixed) or place[w] is not place[s])]
    if odd:
        raise PolicyError(f"{path}: rules place {len(odd)} quantized weights apart from their scales; a weight "
                          "and its scales are one unit (the runtime dequantizes one with the other): make the "
                          "rules match both, for example by the module's name", odd)
