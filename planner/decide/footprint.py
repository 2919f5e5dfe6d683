"""The GPU memory a placement needs: resident tensors, the prefetch pool and the prefill staging pool.
Computed here only.

    total = resident bytes + slots x slot_bytes + stage slots x stage slot bytes
    slots = min(prefetch step, layers with prefetched tensors)
    slot_bytes = the largest such layer's slot image (slots.py)
    stage slots = min(2, staged layers); stage slot bytes = the largest staged layer (staging.py)

Routed experts staged at prefill stream through the expert ring, which each
staged forward allocates and frees (staging.py): working memory, which
working.py sizes and placement.py adds to the plan's footprint, not here.

The placement pipeline builds one `Footprint` over the live placement and
moves tensors through it (`move`), so every step of a backend sees the
current total at the cost of the tensors it moved; strategies that branch
(mixed.py) `copy` it. `if_streamed` answers "what if these layers streamed
too?" without moving anything, for the search over layer counts
(schedule.fewest_layers).

Both pools grow with the placement, so the total is not monotonic in what
moves off the GPU: a tensor moved to uva frees its bytes but may enlarge
every staging slot (a Llama layer's MLP on uva frees 336 MiB, and the first
two such layers each add 336 MiB of slots). `fit`, the walk that budget-driven
placement moves tensors with, therefore stops at the first total within the
budget, and where none is, leaves the smallest total it passed: the smallest
budget at which the walk would have stopped, which the budget error quotes.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import cached_property
from itertools import chain, compress, repeat
from operator import is_, is_not, itemgetter

from ..inputs.checkpoint import TensorInfo
from ..inputs.quantized import partners, with_partners
from ..layers.alike import Shapes
from ..layers.graph import Layer, LayerGraph
from ..layers.slots import align, image_key, layout_bytes
from ..plan import Placement
from .staging import STAGE_SLOTS, stageable, staged

GPU, UVA, PREFETCH, CPU = Placement.GPU, Placement.UVA, Placement.PREFETCH, Placement.CPU
_NBYTES = itemgetter(3)  # of a TensorInfo
_BULK = 64  # names from which `move` works on all of them at once


def _bytes(tensors: Mapping[str, TensorInfo], names: Iterable[str]) -> int:
    return sum(map(_NBYTES, map(tensors.__getitem__, names)))


def bytes_by_placement(names: tuple[str, ...], place: Mapping[str, Placement], tensors: Mapping[str, TensorInfo],
                       where: Sequence[Placement] | None = None) -> dict[Placement, int]:
    """The bytes of `names` on each placement (summed in C: a layer of DeepSeek-V3 holds 1,548 tensors; a
    placement the layer has nothing on is not summed); `where`: their placements, when the caller has them."""
    sizes = list(map(_NBYTES, map(tensors.__getitem__, names)))
    where = list(map(place.__getitem__, names)) if where is None else where
    there = set(where)
    if len(there) == 1:
        return {p: sum(sizes) if p in there else 0 for p in (GPU, UVA, PREFETCH, CPU)}
    return {p: sum(compress(sizes, map(is_, where, repeat(p)))) if p in there else 0 for p in (GPU, UVA, PREFETCH, CPU)}


class Footprint:
    """Resident bytes (once asked for: a prefetch walk with no budget never does) and each streamed layer's
    slot image, kept current as tensors move.

    `place` is the caller's placement dict: `move` updates it together with the bytes.
    `stage`: the policy's `uva.stage_prefill` (False: no staging pool). `partner` (quantized.py
    `partners`), `stageable_names` (`stageable(graph.layers, partner)`, asked for where a tensor is on uva or cpu)
    and `shapes` (alike.py, over
    `tensors`) spare computing them again.
    """

    def __init__(self, graph: LayerGraph, tensors: Mapping[str, TensorInfo], place: dict[str, Placement],
                 step: int, stage: bool = True, *, partner: Mapping[str, str] | None = None,
                 stageable_names: Callable[[], frozenset[str]] | None = None, shapes: Shapes | None = None):
        self.tensors = tensors
        self.shapes = Shapes(tensors) if shapes is None else shapes
        self.place = place
        self.step = max(1, step)
        self.layers = {l.name: l for l in graph.layers}
        self._resident: int | None = None  # worked out when first asked for (`resident`), then kept as tensors move
        self.streamed: dict[str, int] = {}  # layer name -> its slot image's bytes
        self._images: dict[tuple, int] = {}  # slots.image_key -> the image's bytes (shared by copies)
        self._closed: dict[tuple, tuple[bool, ...]] = {}  # `move_picked`: (pairs' places, marks) -> with scales
        self.partner = partners(tensors) if partner is None else partner
        # `stageable_names`: what the caller computes alike (the cost model); routed experts go through the ring
        self._stageable = (lambda: frozenset()) if not stage else stageable_names or (
            lambda: stageable(graph.layers, self.partner))
        self.staged: dict[str, int] = {}  # layer name -> its staged bytes
        # layer -> [staged bytes, staged tensors] on uva, kept as tensors move
        self.on_uva: dict[str, list[int]] = {l.name: [0, 0] for l in graph.layers}
        # a placement of the rules alone has often no tensor to prefetch or stage: no layer is looked at then. The
        # placements held are found in one pass (not one look for each, over 90k tensors held on the GPU)
        held = set(place.values())
        if PREFETCH in held:
            for layer in graph.layers:
                self._restream(layer)
        if (UVA in held or CPU in held) and self.stageable:
            for layer in graph.layers:
                names, size = staged(layer, self.stageable, self.place, self.tensors)
                self.on_uva[layer.name] = [size, len(names)]
                self._stage_bytes(layer.name)
        self.stage_pool = self._stage_pool()

    @cached_property
    def stageable(self) -> frozenset[str]:
        """The tensors prefill stages on uva (staging.py), asked for once a tensor is on uva or cpu."""
        return self._stageable()

    @property
    def resident(self) -> int:
        """The bytes of the tensors placed on the GPU."""
        if self._resident is None:
            self._resident = _bytes(self.tensors, compress(self.place, map(is_, self.place.values(), repeat(GPU))))
        return self._resident

    @cached_property
    def layer_name(self) -> dict[str, str]:
        """Tensor -> its layer's name (moves that change a layer's stream or staging ask)."""
        return dict(chain.from_iterable(zip(l.params, repeat(l.name)) for l in self.layers.values()))

    def image_bytes(self, layer: Layer, names: list[str], chosen: tuple[bool, ...] | None = None) -> int:
        """The bytes of the slot image of `names`, `layer`'s (slots.py; `chosen`: its `image_key`'s); layers
        alike stream alike images, so each is laid out once."""
        key = image_key(layer, names, self.tensors, self.shapes, chosen)
        size = self._images.get(key)
        if size is None:  # a layer of a template: its key holds the marks (`chosen`)
            size = self._images[key] = layout_bytes(names, self.tensors, layer, key[2] if layer.template else None)
        return size

    def _restream(self, layer: Layer, chosen: tuple[bool, ...] | None = None) -> None:
        """`chosen`: the layer's prefetched tensors, where the caller knows them."""
        chosen = chosen or tuple(map(is_, layer.values(self.place), repeat(PREFETCH)))
        names = list(compress(layer.params, chosen))
        if names:
            self.streamed[layer.name] = self.image_bytes(layer, names, chosen)
        else:
            self.streamed.pop(layer.name, None)

    def _stage_bytes(self, layer: str) -> None:
        size, count = self.on_uva[layer]
        if count:
            self.staged[layer] = size
        else:
            self.staged.pop(layer, None)

    def _count(self, n: str, sign: int, layer: str) -> None:
        """`n` (stageable, of the layer named `layer`) came to uva (sign 1) or left it (-1)."""
        counts = self.on_uva[layer]
        counts[0] += sign * align(self.tensors[n].nbytes)
        counts[1] += sign

    def _stage_pool(self) -> int:
        return min(STAGE_SLOTS, len(self.staged)) * max(self.staged.values(), default=0)

    def move(self, names: Iterable[str], to: Placement, layer: Layer | None = None) -> None:
        """Place `names` at `to`, each with its quantization scales (quantized.py), updating the placement
        and the bytes. Many names (a layer's tensors, to prefetch) are moved in bulk. `layer`: the layer that
        holds all of them (and so their scales), when the caller knows it: no tensor's layer is looked up."""
        names = with_partners(names, self.partner)
        if len(names) > _BULK:
            return self._move_many(names, to, layer)
        touched: dict[str, bool] = {}  # layer names, in order
        staged: dict[str, bool] = {}
        layer_name = self.layer_name if layer is None else dict.fromkeys(names, layer.name)
        for n in names:
            was = self.place[n]
            if was is to:
                continue
            if self._resident is not None:
                size = self.tensors[n].nbytes
                self._resident += (size if to is GPU else 0) - (size if was is GPU else 0)
            if PREFETCH in (was, to):
                touched[layer_name[n]] = True
            if UVA in (was, to) and n in self.stageable:
                staged[layer_name[n]] = True
                self._count(n, 1 if to is UVA else -1, layer_name[n])
            self.place[n] = to
        self._refresh(touched, staged)

    def move_picked(self, layer: Layer, picked: tuple[bool, ...], to: Placement) -> None:
        """`move` of the tensors of `layer` that `picked` marks (over its tensors, in order). Where its quantized
        pairs are known by place (scales.py `LayerPairs`), their scales are added by place, once for each kind of
        layer and marks, and a layer that streamed nothing before streams by the marks, its tensors not looked
        up again (a prefetch walk moves a layer's 1,536 experts so)."""
        pos = getattr(self.partner, "positions", {}).get(layer.name)
        if pos is None:
            return self.move(compress(layer.params, picked), to, layer)
        key = (id(pos), picked)
        marks = self._closed.get(key)
        if marks is None:
            got = list(picked)
            for w, s in zip(*pos):
                got[w] = got[s] = picked[w] or picked[s]
            marks = self._closed[key] = tuple(got)
        names = list(compress(layer.params, marks))
        if len(names) <= _BULK:
            return self.move(names, to, layer)
        self._move_many(names, to, layer, marks if to is PREFETCH and layer.name not in self.streamed else None)

    def _move_many(self, names: list[str], to: Placement, layer: Layer | None = None,
                   chosen: tuple[bool, ...] | None = None) -> None:
        """`move`, each step over all of `names` at once (in C where it can be); `layer`: `move`'s; `chosen`: the
        layer's prefetched tensors after the move, where the caller knows them."""
        place = self.place
        was = itemgetter(*names)(place)  # one C call: more than _BULK names, so a tuple
        if to in was:  # those already there stay out
            keep = list(map(is_not, was, repeat(to)))
            names, was = list(compress(names, keep)), list(compress(was, keep))
        if self._resident is not None:
            sizes = list(map(_NBYTES, map(self.tensors.__getitem__, names)))
            self._resident += sum(sizes) if to is GPU else -sum(compress(sizes, map(is_, was, repeat(GPU))))
        streams = names if to is PREFETCH else compress(names, map(is_, was, repeat(PREFETCH)))
        if layer is None:
            touched = dict.fromkeys(map(self.layer_name.__getitem__, streams))  # layers by name: hashing one is slow
        else:
            touched = dict.fromkeys([layer.name] if any(True for _ in streams) else [])
        stages = names if to is UVA else list(compress(names, map(is_, was, repeat(UVA))))
        staged = {}
        for n in filter(self.stageable.__contains__, stages) if stages else ():
            mine = self.layer_name[n] if layer is None else layer.name
            staged[mine] = True
            self._count(n, 1 if to is UVA else -1, mine)
        place.update(zip(names, repeat(to)))
        self._refresh(touched, staged, chosen)

    def _refresh(self, touched, staged, chosen: tuple[bool, ...] | None = None) -> None:
        """After moves: the slot images of the layers whose prefetched tensors changed (`touched`, by name), the
        staged bytes of those whose stageable uva tensors changed (`staged`), and the staging pool; `chosen`:
        the prefetched tensors of the one layer touched, where the caller knows them."""
        for name in touched:
            self._restream(self.layers[name], chosen)
        for name in staged:
            self._stage_bytes(name)
        if staged:
            self.stage_pool = self._stage_pool()

    def fit(self, units: Iterable[Sequence[str]], to: Placement, budget: int) -> bool:
        """Move `units` to `to` in order, each whole, until the total is within `budget`; True if it is.

        If it never is, the moves made after the smallest total seen are undone
        (module doc), so the total left is the smallest that any prefix of the
        walk reached (the first such prefix).
        """
        best, keep = self.total, 0
        done: list[list[tuple[str, Placement]]] = []
        for unit in units:
            if self.total <= budget:
                return True
            done.append([(n, self.place[n]) for n in with_partners(unit, self.partner)])
            self.move(unit, to)
            if self.total < best:
                best, keep = self.total, len(done)
        if self.total <= budget:
            return True
        for before in reversed(done[keep:]):
            for n, was in before:
                self.move((n,), was)
        return False

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
        return self.resident + self.pool + self.stage_pool

    def if_streamed(self, layers: Iterable[tuple[str, int, int]]) -> int:
        """The total if each (layer, bytes it moves off the GPU, its slot image then) streamed too."""
        streamed = dict(self.streamed)
        resident = self.resident
        for name, moved, image in layers:
            streamed[name] = image
            resident -= moved
        return resident + min(self.step, len(streamed)) * max(streamed.values(), default=0) + self.stage_pool

    def copy(self) -> "Footprint":
        """An independent footprint over a copy of the placement (for a strategy to try)."""
        other = object.__new__(Footprint)
        self.layer_name  # worked out once, for every copy to share
        other.__dict__.update(self.__dict__, place=dict(self.place), streamed=dict(self.streamed),
                              staged=dict(self.staged), on_uva={k: list(v) for k, v in self.on_uva.items()})
        return other
