"""Where each offloaded tensor lives in pinned host memory and in the prefetch slots, as the plan says.

The plan carries the prefetch layout (planner/layers/slots.py): each streamed layer's
module path, its slot, and each of its checkpoint tensors' offset in a slot
image. The runtime does not lay anything out itself; it reads that and checks
it against the model:

- the module at the layer's path exists (the plan's path in checkpoint naming,
  mapped to the model's as its tensors are: modules.py), and holds the layer's
  prefetched tensors;
- every model tensor of the layer (a fused expert parameter included) is one
  contiguous span of the slot image: each of its checkpoint pieces sits at the
  offset where transformers' own conversion puts it (checkpoint_names.py), so
  the tensor is a view of the slot;
- the pool the plan sizes (`slots x slot_bytes`) is the one its summary states.

Host memory: one pinned arena holds the uva tensors first (ALIGN apart, in plan
order: an allocation, not a decision), then each streamed layer's slot image
as the plan lays it out, so a prefetch is one copy of `Layout.bytes`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from planner.errors import ModelMismatchError, OffplanError, PlanFileError
from planner.plan import Placement, Plan

from .arena import align
from .modules import module_paths
from .names import Target

UVA, PREFETCH = Placement.UVA, Placement.PREFETCH


@dataclass
class StreamedLayer:
    """One prefetched layer as the engine needs it: its module, slot, and slot image in the arena."""

    name: str  # the plan's layer name
    module: torch.nn.Module
    slot: int
    host_offset: int  # where its slot image starts in the arena
    nbytes: int  # the image's length: one copy moves it all


@dataclass
class HostLayout:
    arena_bytes: int
    host_offset: dict[str, int] = field(default_factory=dict)  # target name -> its offset in the arena
    slot_offset: dict[str, int] = field(default_factory=dict)  # prefetched target name -> its offset in a slot
    streamed_in: dict[str, str] = field(default_factory=dict)  # prefetched target name -> its layer
    layers: list[StreamedLayer] = field(default_factory=list)  # in schedule order


def lay_out(targets: list[Target], plan: Plan, model: torch.nn.Module) -> HostLayout:
    """The arena and slot offsets of every offloaded target, from the plan (module doc)."""
    out = HostLayout(0)
    cursor = 0
    for t in targets:
        if t.placement is UVA:
            out.host_offset[t.name] = cursor
            cursor = align(cursor + t.nbytes)
    sched = plan.prefetch
    if sched is None:
        out.arena_bytes = cursor
        return out
    if sched.pool_bytes != plan.summary.prefetch_buffer_bytes:
        raise PlanFileError(f"the plan's prefetch pool ({sched.slots} slots x {sched.slot_bytes} bytes) is not "
                            f"its summary's prefetch_buffer_bytes ({plan.summary.prefetch_buffer_bytes}); rebuild it")
    by_layer: dict[str, list[Target]] = {t.layer: [] for t in sched.schedule}
    for t in targets:
        if t.placement is PREFETCH:
            layer = _layer_of(t, by_layer)
            by_layer[layer].append(t)
    paths, problems = module_paths(model, targets, {tr.module for tr in sched.schedule})
    for tr in sched.schedule:
        image = sched.layouts[tr.layout]
        module = _module(model, paths.get(tr.module), tr.layer, by_layer[tr.layer], problems)
        offsets = {b.name: b for b in image.buffers}
        for t in by_layer[tr.layer]:
            at = _slot_offset(t, tr.layer, offsets, image.bytes, problems)
            if at is not None:
                out.slot_offset[t.name] = at
                out.host_offset[t.name] = cursor + at
                out.streamed_in[t.name] = tr.layer
        out.layers.append(StreamedLayer(tr.layer, module, tr.slot, cursor, image.bytes))
        cursor = align(cursor + image.bytes)
    if problems:
        raise ModelMismatchError(f"the plan's prefetch layout does not fit this model ({type(model).__name__}); "
                                 "rebuild the plan with this offplan, or report the model", problems)
    out.arena_bytes = cursor
    return out


def _layer_of(t: Target, layers: dict[str, list]) -> str:
    """The streamed layer whose name prefixes the target's first checkpoint source."""
    source = t.pieces[0].source
    for name in layers:
        if source.startswith(name + "."):
            return name
    raise PlanFileError(f"{source}: prefetched, but no layer of the plan's schedule holds it; rebuild the plan")


def _module(model, path: str | None, layer: str, targets: list[Target], problems: list[str]
            ) -> torch.nn.Module | None:
    """The model's module at `path` (the plan's module, mapped by modules.py; None: not found, reported)."""
    if path is None:
        return None
    module = model.get_submodule(path)
    outside = [t.name for t in targets if not t.name.startswith(path + ".")]
    if outside:
        problems.append(f"{layer}: {outside[0]} is prefetched with the layer but lives outside its module {path}")
    return module


def _slot_offset(t: Target, layer: str, buffers: dict, image_bytes: int, problems: list[str]) -> int | None:
    """Where `t` starts in the slot image: each checkpoint piece must sit where the target's own
    layout puts it (a meta tensor's view of `piece.index` gives that offset)."""
    start = None
    probe = torch.empty(t.shape, dtype=t.dtype, device="meta")
    for piece in t.pieces:
        local = piece.source[len(layer) + 1:]
        b = buffers.get(local)
        if b is None:
            problems.append(f"{piece.source}: prefetched, but the layout of {layer} has no buffer {local}")
            return None
        inside = (probe[piece.index] if piece.index else probe).storage_offset() * t.dtype.itemsize
        if start is None:
            start = b.offset - inside
        if b.offset - inside != start:
            problems.append(f"{t.name}: its piece {piece.source} sits at slot offset {b.offset}, but the "
                            f"model's tensor needs it {inside} bytes after {start}: transformers fuses these "
                            "experts in another order than the plan lays them out")
            return None
    if start < 0 or start + t.nbytes > image_bytes:
        problems.append(f"{t.name}: [{start}, {start + t.nbytes}) lies outside the {image_bytes}-byte slot image")
        return None
    return start


def check_gpu_memory(device: torch.device, resident: int, pool: int) -> None:
    """Refuse a plan whose resident tensors and buffers do not fit the free memory of `device`, before any
    allocation."""
    free, total = torch.cuda.mem_get_info(device)
    need = resident + pool
    if need > free:
        gib = 2**30
        raise OffplanError(
            f"the plan needs {need / gib:.2f} GiB of GPU memory ({resident / gib:.2f} GiB resident + "
            f"{pool / gib:.2f} GiB buffers and the experts' working memory) but only {free / gib:.2f} GiB of {total / gib:.2f} GiB "
            f"is free on {device}; rebuild the plan with budget_gib <= {free / gib * 0.95:.1f}")
