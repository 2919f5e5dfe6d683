"""The GPU memory a placement needs: resident tensors plus the prefetch pool. Computed here only.

    total = resident bytes + slots x slot_bytes
    slots = min(prefetch step, layers with prefetched tensors)
    slot_bytes = the largest such layer's slot image (slots.py)

The placement pipeline builds one `Footprint` over the live placement and
moves tensors through it (`move`), so every step of a backend sees the
current total at the cost of the tensors it moved; strategies that branch
(mixed.py) `copy` it. `if_streamed` answers "what if these layers streamed
too?" without moving anything, for the search over layer counts
(schedule.fewest_layers).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from .checkpoint import TensorInfo
from .graph import Layer, LayerGraph
from .plan import Placement
from .slots import layout_bytes

GPU, PREFETCH = Placement.GPU, Placement.PREFETCH


class Footprint:
    """Resident bytes and each streamed layer's slot image, kept current as tensors move.

    `place` is the caller's placement dict: `move` updates it together with the bytes.
    """

    def __init__(self, graph: LayerGraph, tensors: Mapping[str, TensorInfo], place: dict[str, Placement],
                 step: int):
        self.tensors = tensors
        self.place = place
        self.step = max(1, step)
        self.layer_of: dict[str, Layer] = {n: l for l in graph.layers for n in l.params}
        self.resident = sum(tensors[n].nbytes for n, p in place.items() if p is GPU)
        self.streamed: dict[str, int] = {}  # layer name -> its slot image's bytes
        for layer in graph.layers:
            self._restream(layer)

    def _restream(self, layer: Layer) -> None:
        names = [n for n in layer.params if self.place[n] is PREFETCH]
        if names:
            self.streamed[layer.name] = layout_bytes(names, self.tensors)
        else:
            self.streamed.pop(layer.name, None)

    def move(self, names: Iterable[str], to: Placement) -> None:
        """Place `names` at `to`, updating the placement and the bytes."""
        touched: dict[str, Layer] = {}
        for n in names:
            was = self.place[n]
            if was is to:
                continue
            size = self.tensors[n].nbytes
            self.resident += (size if to is GPU else 0) - (size if was is GPU else 0)
            if PREFETCH in (was, to):
                layer = self.layer_of[n]
                touched[layer.name] = layer
            self.place[n] = to
        for layer in touched.values():
            self._restream(layer)

    @property
    def slots(self) -> int:
        return min(self.step, len(self.streamed))

    @property
    def slot_bytes(self) -> int:
        return max(self.streamed.values(), default=0)

    @property
    def pool(self) -> int:
        return self.slots * self.slot_bytes

    @property
    def total(self) -> int:
        return self.resident + self.pool

    def if_streamed(self, layers: Iterable[tuple[str, int, int]]) -> int:
        """The total if each (layer, bytes it moves off the GPU, its slot image then) streamed too."""
        streamed = dict(self.streamed)
        resident = self.resident
        for name, moved, image in layers:
            streamed[name] = image
            resident -= moved
        return resident + min(self.step, len(streamed)) * max(streamed.values(), default=0)

    def copy(self) -> "Footprint":
        """An independent footprint over a copy of the placement (for a strategy to try)."""
        other = object.__new__(Footprint)
        other.__dict__.update(self.__dict__, place=dict(self.place), streamed=dict(self.streamed))
        return other
