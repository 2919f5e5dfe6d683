"""The prefetch pool: which layers to stream when a budget decides, slots, buffers and copy triggers.

Shared by the vLLM-style prefetch backend (placement.py) and the mixed backend
(mixed.py): both describe a placement; this module turns the prefetched part
of it into the plan's schedule.
"""
from __future__ import annotations

from collections.abc import Mapping

from .checkpoint import TensorInfo
from .graph import Layer, LayerGraph
from .plan import Buffer, Placement, PrefetchSchedule, Transfer

GPU, PREFETCH = Placement.GPU, Placement.PREFETCH


def previous_user(k: int, slots: int, count: int) -> int:
    """Index of the layer that used slot k mod `slots` before layer k, cyclically over `count`.

    For k >= slots it is k - slots; the first layers of a forward wait for the
    last users of their slots in the previous forward.
    """
    return k - slots if k >= slots else k + slots * ((count - 1 - k) // slots)


def fewest_layers(eligible: list[tuple[Layer, list[str]]], place: Mapping[str, Placement],
                  tensors: Mapping[str, TensorInfo], graph: LayerGraph, step: int,
                  budget: int) -> list[tuple[Layer, list[str]]]:
    """The fewest of `eligible` (layer, tensors to stream) layers, spread evenly, whose
    streaming brings GPU bytes plus the buffer pool within `budget`.

    Tries 0, 1, 2, ... layers. The footprint is not monotonic in the count (each
    new slot, or a layer with new shapes, can add more pool than it moves), so
    when nothing fits the choice with the smallest footprint is returned: the
    caller's budget error then quotes the smallest budget that would fit.
    """
    if not eligible:
        return []
    size = {n: tensors[n].nbytes for _, names in eligible for n in names}
    # Per-layer facts, so trying every count costs O(layers), not O(tensors).
    keyed = [{(l.local(n), tensors[n].dtype, tensors[n].shape): size[n] for n in c} for l, c in eligible]
    moved = [sum(size[n] for n in c) for _, c in eligible]
    get = place.__getitem__
    already = [l for l in graph.layers if PREFETCH in map(get, l.params)]
    already_keys = {(l.local(n), tensors[n].dtype, tensors[n].shape): tensors[n].nbytes
                    for l in already for n in l.params if place[n] is PREFETCH}
    base = sum(tensors[n].nbytes for n, p in place.items() if p is GPU)
    count = len(eligible)
    smallest = None
    for want in range(count + 1):
        idx = spread(count, want)
        keys = dict(already_keys)
        for i in idx:
            keys.update(keyed[i])
        units = len({eligible[i][0].name for i in idx} | {l.name for l in already})
        pool = min(step, units) * sum(keys.values())
        footprint = base - sum(moved[i] for i in idx) + pool
        if smallest is None or footprint < smallest[0]:
            smallest = (footprint, idx)
        if footprint <= budget:
            break
    return [eligible[i] for i in smallest[1]]


def footprint(graph: LayerGraph, place: Mapping[str, Placement], tensors: Mapping[str, TensorInfo],
              step: int) -> int:
    """GPU bytes of a placement: resident tensors plus the prefetch pool it needs."""
    sched = make_schedule(graph, place, tensors, step)
    return sum(tensors[n].nbytes for n, p in place.items() if p is GPU) + (sched.pool_bytes if sched else 0)


def spread(count: int, want: int) -> list[int]:
    """`want` of `count` positions, evenly spaced, each the last of its share.

    spread(32, 4) -> [7, 15, 23, 31], what group_size 8, num_in_group 1 gives.
    """
    return [(k + 1) * count // want - 1 for k in range(want)]


def make_schedule(graph: LayerGraph, place: Mapping[str, Placement],
                  tensors: Mapping[str, TensorInfo], step: int) -> PrefetchSchedule | None:
    """Slots, buffers and copy triggers for the layers holding prefetched tensors."""
    get = place.__getitem__
    units = [l for l in graph.layers if PREFETCH in map(get, l.params)]  # the scan runs in C
    if not units:
        return None
    buffers: dict[tuple, Buffer] = {}
    for l in units:
        for n in l.params:
            if place[n] is PREFETCH:
                t = tensors[n]
                key = (l.local(n), t.dtype, t.shape)
                if key not in buffers:
                    buffers[key] = Buffer(key[0], t.dtype, t.shape, t.nbytes)
    count = len(units)
    slots = max(1, min(step, count))
    schedule = []
    for k, l in enumerate(units):
        schedule.append(Transfer(l.name, k % slots, units[previous_user(k, slots, count)].name))
    slot_bytes = sum(b.bytes for b in buffers.values())
    return PrefetchSchedule(max(step, 1), slots, slot_bytes, tuple(buffers.values()), tuple(schedule))
