"""Where each offloaded tensor lives: offsets in the pinned arena and in the prefetch slots.

The arena holds uva tensors first, each `ALIGN`-aligned, then every prefetched
layer's tensors laid out in the order of its slot, so that copying a layer into
its slot is one contiguous run per stretch of tensors the layer shares with the
slot (one run per layer when all layers hold the same tensors). A slot has one
buffer per distinct (name within the layer module, dtype, shape) over all
prefetched layers, as the plan's pool does.
"""
from __future__ import annotations

import torch

from planner.errors import OffplanError
from planner.plan import Placement, Plan

from .arena import align
from .names import Target
from .prefetch import PrefetchLayer

UVA, PREFETCH = Placement.UVA, Placement.PREFETCH
# (arena bytes, arena offset by id(target), prefetch layers by plan name, bytes per slot)
Layout = tuple[int, dict[int, int], dict[str, PrefetchLayer], int]


def plan_layer_of(plan: Plan):
    """A function from a checkpoint tensor name to the plan layer holding it."""
    names = {l.name for l in plan.layers}

    def layer_of(tensor: str) -> str:
        if tensor in names:
            return tensor
        parts = tensor.split(".")
        for i in range(len(parts) - 1, 0, -1):
            prefix = ".".join(parts[:i])
            if prefix in names:
                return prefix
        raise OffplanError(f"{tensor}: no layer of the plan holds it (plan edited by hand?)")
    return layer_of


def common_module(names: list[str]) -> str:
    """The deepest module path shared by `names` (the module a plan layer maps to)."""
    parts = [n.split(".") for n in names]
    common = []
    for segs in zip(*parts):
        if len(set(segs)) > 1:
            break
        common.append(segs[0])
    if len(common) == min(len(p) for p in parts):
        common = common[:-1]
    return ".".join(common)


def layout(targets: list[Target], plan: Plan, model: torch.nn.Module) -> Layout:
    """Arena offsets for offloaded targets, and the prefetch layers with their slot runs."""
    offsets: dict[int, int] = {}
    cursor = 0
    for t in targets:
        if t.placement is UVA:
            offsets[id(t)] = cursor
            cursor += align(t.nbytes)
    layers: dict[str, PrefetchLayer] = {}
    slot_of: dict[int, int] = {}
    slot_bytes = 0
    sched = plan.prefetch
    if sched is not None:
        layer_of = plan_layer_of(plan)
        members: dict[str, list[Target]] = {}
        everything: dict[str, list[str]] = {}
        for t in targets:
            layer = layer_of(t.pieces[0].source)
            everything.setdefault(layer, []).append(t.name)
            if t.placement is PREFETCH:
                members.setdefault(layer, []).append(t)
        keys: dict[tuple, int] = {}
        for tr in sched.schedule:
            module_name = common_module(everything[tr.layer])
            module = model.get_submodule(module_name)
            for t in members.get(tr.layer, []):
                key = (t.name[len(module_name):], t.dtype, t.shape)
                if key not in keys:
                    keys[key] = slot_bytes
                    slot_bytes += align(t.nbytes)
                slot_of[id(t)] = keys[key]
            layers[tr.layer] = PrefetchLayer(tr.layer, module, tr.slot)
        for tr in sched.schedule:
            base = cursor
            runs: list[list[int]] = []
            mine = sorted(members.get(tr.layer, []), key=lambda t: slot_of[id(t)])
            for t in mine:
                s = slot_of[id(t)]
                offsets[id(t)] = base + s
                size = align(t.nbytes)
                if runs and runs[-1][1] + runs[-1][2] == s and runs[-1][0] + runs[-1][2] == base + s:
                    runs[-1][2] += size
                else:
                    runs.append([base + s, s, size])
            layers[tr.layer].runs = [tuple(r) for r in runs]
            cursor = base + max((slot_of[id(t)] + align(t.nbytes) for t in mine), default=0)
    return cursor, offsets, layers, slot_bytes
