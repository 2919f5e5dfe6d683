"""The prefetch schedule: which layers to stream when a budget decides, slots, layouts and copy triggers.

Shared by the vLLM-style prefetch backend (placement.py) and the mixed backend
(mixed.py): both describe a placement; this module turns the prefetched part
of it into the plan's schedule. The k-th streamed layer (in execution order)
uses slot k mod S, S = min(step, streamed layers), is laid out in it as
slots.py says, and its copy starts once the previous user of that slot has
run (cyclically: the first layers of a forward wait for the last ones of the
one before). The runtime hooks the module at the layer's path.
"""
from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from itertools import compress, repeat
from operator import is_

from ..inputs.checkpoint import TensorInfo
from ..layers.graph import Layer, LayerGraph, schedule_problems
from ..layers.alike import Shapes
from ..layers.slots import image_key, layout_of
from ..plan import Layout, Placement, PrefetchSchedule, Transfer
from .footprint import Footprint

GPU, PREFETCH = Placement.GPU, Placement.PREFETCH


def previous_user(k: int, slots: int, count: int) -> int:
    """Index of the layer that used slot k mod `slots` before layer k, cyclically over `count`.

    For k >= slots it is k - slots; the first layers of a forward wait for the
    last users of their slots in the previous forward.
    """
    return k - slots if k >= slots else k + slots * ((count - 1 - k) // slots)


def pipelined(layers: Iterable[tuple[float, float, tuple[float, ...]]], waits: tuple[tuple[int, bool] | None, ...]
              ) -> list[float]:
    """When each layer of a forward ends, its copies streamed ahead into GPU buffers: the prefill's timeline (cost.py).

    `layers`: in forward order, (compute, in place, copies): the layer's own time, the part of it that reads over
    the host link in place (UVA), and the time of its copy into each pool of buffers (0: none). `waits`, per pool:
    (n, at_start), a copy into it waits for the layer n copies back in that pool to have run (False: prefetch, whose
    slot is free again then, n its `step` slots; this module's `previous_user`) or to have started (True: prefill
    staging, runtime/execute/prefill.py, which issues the next staged layer's copy as a staged layer begins: n = 1);
    None: a pool that never waits (the expert ring). The link carries one thing at a time, in layer order: the copies,
    and a layer's reads in place once it runs (after the copies before them); a layer runs once the layer before it
    has and its copies are in. So a copy overlaps the layers before it, not only its own: with half of Llama-3.1-8B's
    layers prefetched through 2 slots and a 2048-token prompt, the copies (7.9 ms a layer) run back to back while the
    resident layers compute (2.1 ms each), where a layer-by-layer max(compute, copy) adds a resident layer's compute
    per copy (160 ms, measured 133). Every copy of the forward counts, its first layers' included: the runtime makes
    them at the end of the forward before (prefetch's cyclic slots), so the last of them are still in flight when it
    ends, and the next forward waits for them: the time until the copies are done, as the benchmarks measure it.
    The runtime's prefetch and staging copies have a stream each; sharing one link, the model queues them in turn.

        pipelined([(2, 0, (8,)), (2, 0, (0,)), (2, 0, (8,))], ((1, False),)) -> [10, 12, 20]   # slot free at 10
        pipelined([(2, 0, (8,)), (2, 0, (0,)), (2, 0, (8,))], ((2, False),)) -> [10, 12, 18]
    """
    assert all(w is None or w[0] >= 1 for w in waits), waits
    link = end = 0.0  # when the link is free; when the last layer ended
    users: list[list[tuple[float, float]]] = [[] for _ in waits]  # per pool: (start, end) of the layers using it
    ends = []
    for compute, in_place, copies in layers:
        ready = 0.0
        if any(copies):
            start = link
            for used, wait, pool in zip(copies, waits, users):
                if used and wait and len(pool) >= wait[0]:
                    start = max(start, pool[-wait[0]][0 if wait[1] else 1])
            link = ready = start + sum(copies)
        begin = max(end, ready)
        if in_place:  # its reads wait for the link, and hold it
            begin = max(begin, link)
            link = begin + in_place
        end = begin + compute
        for used, pool in zip(copies, users):
            if used:
                pool.append((begin, end))
        ends.append(end)
    return ends


def fewest_layers(eligible: list[tuple[Layer, list[str]]], fp: Footprint, budget: int
                  ) -> list[tuple[Layer, list[str]]]:
    """The fewest of `eligible` (layer, tensors to stream) layers, spread evenly, whose
    streaming brings the footprint within `budget`.

    Tries 0, 1, 2, ... layers. The footprint is not monotonic in the count (a
    new slot, or a larger layer, can add more pool than it moves), so when
    nothing fits the choice with the smallest footprint is returned: the
    caller's budget error then quotes the smallest budget that would fit.
    """
    if not eligible:
        return []
    # Per-layer facts, so trying every count costs O(layers), not O(tensors).
    facts = []
    for layer, names in eligible:
        moved = sum(fp.tensors[n].nbytes for n in names if fp.place[n] is GPU)
        streaming = set(names) | {n for n in layer.params if fp.place[n] is PREFETCH}
        facts.append((layer.name, moved, fp.image_bytes(layer, [n for n in layer.params if n in streaming])))
    count = len(eligible)
    smallest = None
    for want in range(count + 1):
        idx = spread(count, want)
        total = fp.if_streamed(facts[i] for i in idx)
        if smallest is None or total < smallest[0]:
            smallest = (total, idx)
        if total <= budget:
            break
    return [eligible[i] for i in smallest[1]]


def spread(count: int, want: int) -> list[int]:
    """`want` of `count` positions, evenly spaced, each the last of its share.

    spread(32, 4) -> [7, 15, 23, 31], what group_size 8, num_in_group 1 gives.
    """
    return [(k + 1) * count // want - 1 for k in range(want)]


def make_schedule(graph: LayerGraph, place: Mapping[str, Placement],
                  tensors: Mapping[str, TensorInfo], step: int, shapes: Shapes | None = None,
                  streamed: Collection[str] | None = None, wheres: Mapping[str, tuple] | None = None
                  ) -> PrefetchSchedule | None:
    """Slots, layouts and copy triggers for the layers holding prefetched tensors (module doc); `shapes`
    (alike.py, over `tensors`): the layers' dtypes and shapes, when the caller keeps them; `streamed`: the names
    of those layers, when the caller knows them (the placement's footprint.py `streamed`); `wheres`: layer name ->
    its tensors' placements, when the caller has read them."""
    shapes = Shapes(tensors) if shapes is None else shapes
    if streamed is None:
        get = place.__getitem__
        streamed = [l for l in graph.layers if PREFETCH in map(get, l.params)]  # the scan runs in C
    else:
        streamed = [l for l in graph.layers if l.name in streamed]
    if not streamed:
        return None
    count = len(streamed)
    slots = max(1, min(step, count))
    layouts: dict[Layout, int] = {}
    known: dict[tuple, int] = {}  # slots.image_key -> its layout's index: layers alike are laid out once
    schedule = []
    for k, l in enumerate(streamed):
        where = map(place.__getitem__, l.params) if wheres is None else wheres[l.name]
        chosen = tuple(map(is_, where, repeat(PREFETCH)))
        names = list(compress(l.params, chosen))
        key = image_key(l, names, tensors, shapes, chosen)
        index = known.get(key)
        if index is None:
            index = known[key] = layouts.setdefault(layout_of(l, names, tensors, chosen), len(layouts))
        schedule.append(Transfer(l.name, l.module, index, k % slots, streamed[previous_user(k, slots, count)].name))
    problems = schedule_problems(graph, schedule)
    if problems:  # the rule above never makes such a schedule: a bug, not an input error
        raise AssertionError("; ".join(problems))
    return PrefetchSchedule(max(step, 1), slots, max(l.bytes for l in layouts), tuple(layouts), tuple(schedule))
