"""A checkpoint's quantized weights and their scales (inputs/quantized.py `pairs`), found once per kind of layer.

A weight's scales are named after it (`X.weight` -> `X.weight_scale_inv`), so
they live in its layer, and what pairs the tensors of a layer depends on its
local names, dtypes and shapes alone. Layers alike in all three (one template,
alike.py, and one `Shapes` number) pair the same positions: the first such
layer is paired by quantized.py's `matched`, and the others read its positions
(DeepSeek-V3: 45k pairs from five kinds of layer, rather than a scales name
made and looked up per quantized tensor).

Anything else is left to `pairs` over the whole checkpoint, which says what is
amiss tensor by tensor in checkpoint order: a layer with a problem, scales
outside their weight's layer, or a tensor named as both a weight's scales and
a weight (whose pairing would depend on the order the names are read in).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from ..inputs.checkpoint import TensorInfo
from ..inputs.quantized import matched, pairs
from .alike import Shapes, taker
from .graph import Layer


class LayerPairs(dict):
    """`pairs`' partners (weight -> scales, scales -> weight), paired layer by layer: `positions[layer name]` is
    (its weights' places, their scales' places) among the layer's tensors, one object for the layers of a kind.
    Every pair sits in one layer, so a layer's tensors and their scales are found from their places alone
    (footprint.py moves a streamed layer's so)."""

    positions: dict[str, tuple[list[int], list[int]]]


def layer_pairs(layers: Sequence[Layer], tensors: Mapping[str, TensorInfo], block: tuple[int, int] | None,
                shapes: Shapes) -> tuple[dict[str, str], list[str]]:
    """`pairs(tensors, block)`, the tensors being those of `layers` (a layer graph's, over the same `tensors`
    as `shapes`): the same partners, weights first, and the same problems (module doc); a `LayerPairs` unless
    it fell back to `pairs`."""
    # (template, Shapes number) -> weights', scales' places, and functions taking those of a layer's tensors (in C)
    kinds: dict[tuple, tuple[tuple[list[int], list[int]], Callable, Callable]] = {}
    weights: list[str] = []
    scales: list[str] = []
    positions: dict[str, tuple[list[int], list[int]]] = {}
    for layer in layers:
        params = layer.params
        kind = None if layer.template is None else (layer.template, shapes(layer))
        known = kinds.get(kind) if kind is not None else None
        if known is None:
            problems: list[str] = []
            found = matched(dict(zip(params, map(tensors.__getitem__, params))), block, problems)
            if problems or len({n for pair in found for n in pair}) < 2 * len(found):
                return pairs(tensors, block)
            at = {n: i for i, n in enumerate(params)}
            got = ([at[w] for w, _ in found], [at[s] for _, s in found])
            known = (got, taker(tuple(got[0])), taker(tuple(got[1])))
            if kind is not None:
                kinds[kind] = known
        got, take_weights, take_scales = known
        weights += take_weights(params)
        scales += take_scales(params)
        positions[layer.name] = got
    out = LayerPairs(zip(weights, scales))
    out.update(zip(scales, weights))
    out.positions = positions
    return out, []
