"""A prefetched layer's slot image: where each of its tensors sits in a GPU buffer slot.

A slot is one flat GPU buffer. Each prefetched layer is laid out in it on its
own: its tensors grouped as the runtime holds them (groups.units: a fused
expert parameter is one unit, its pieces packed in memory order), each unit
starting on an `ALIGN`-byte boundary, units in the layer's natural order. The
host copy of the layer is laid out the same way, so a prefetch is one copy of
`Layout.bytes`.

A slot must hold the largest layer: pool = slots x the largest layout (vLLM
sizes one buffer per distinct tensor name over all layers instead, which
inflates every slot when layer types differ: DeepSeek-V3's dense first layers,
Llama 4's alternating MoE layers).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from operator import itemgetter

from ..inputs.checkpoint import TensorInfo
from ..plan import Buffer, Layout
from .alike import Shapes, applies
from .graph import Layer
from .expert_names import units

ALIGN = 256  # bytes: every unit starts on this boundary (kernels need 16; UVA reads run fastest from 256)
_DTYPE_SHAPE = itemgetter(1, 2)  # of a TensorInfo


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def layout_of(layer: Layer, names: Iterable[str], tensors: Mapping[str, TensorInfo],
              chosen: tuple[bool, ...] | None = None) -> Layout:
    """The slot image of `names`, `layer`'s prefetched tensors (in the layer's natural order); `chosen`: the marks
    over its tensors that pick `names`, where the caller has them (`_units`)."""
    cursor = 0
    buffers = []
    for unit in _units(layer, names, chosen):
        cursor = align(cursor)
        for n in unit:
            t = tensors[n]
            buffers.append(Buffer(layer.local(n), t.dtype, t.shape, cursor, t.nbytes))
            cursor += t.nbytes
    return Layout(align(cursor), tuple(buffers))


def layout_bytes(names: Iterable[str], tensors: Mapping[str, TensorInfo], layer: Layer | None = None,
                 chosen: tuple[bool, ...] | None = None) -> int:
    """`layout_of(...).bytes` without building the buffers: the footprint asks this often."""
    cursor = 0
    for unit in _units(layer, names, chosen):
        cursor = align(cursor) + sum(tensors[n].nbytes for n in unit)
    return align(cursor)


def _units(layer: Layer | None, names: Iterable[str], chosen: tuple[bool, ...] | None) -> list[tuple[str, ...]]:
    """expert_names.py `units(names)`; where `chosen` marks `names` among the tensors of a layer whose template
    applies (alike.py), from the template's units for those marks: a MoE layer's 1.5k names are not classified
    again for each image."""
    if layer is None or chosen is None or layer.template is None or not applies(layer.name):
        return units(names)
    params = layer.params
    return [tuple(map(params.__getitem__, u)) for u in layer.template.units(chosen)]


def image_key(layer: Layer, names: list[str], tensors: Mapping[str, TensorInfo], shapes: Shapes,
              chosen: tuple[bool, ...] | None = None) -> tuple:
    """What the slot image of `names` (some of `layer`'s tensors, in its order) depends on: their local names,
    dtypes and shapes. Layers alike (a stack's MoE layers) have equal keys, so their image is laid out once. A
    layer of a template (alike.py) is told by the template, its dtypes and shapes' number (`shapes`, over
    `tensors`) and which of its tensors are `names` (`chosen`, when the caller picked them by it): no tensor
    read again; another by its names' local parts, dtypes and shapes."""
    if layer.template is not None:
        return layer.template, shapes(layer), chosen or tuple(map(set(names).__contains__, layer.params))
    cut = len(layer.name) + 1
    return tuple([n[cut:] for n in names]), tuple(map(_DTYPE_SHAPE, map(tensors.__getitem__, names)))
