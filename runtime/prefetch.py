"""The prefetch engine: static buffer slots, a copy stream, per-layer events, forward hooks.

The plan fixes everything that matters: which layers are prefetched, which
slot each uses, and whose forward starts each copy (`Transfer.after`, the
previous user of the slot). The engine only carries it out:

- before layer L runs (forward pre-hook), the compute stream waits for L's copy;
- after layer L runs (forward hook), for every transfer with `after == L`, the
  copy stream first waits for an event recorded on the compute stream just
  now (so no queued kernel still reads the slot), then copies the target
  layer's pinned bytes into the slot and records the target's "ready" event;
- at start, the first layer of each slot is copied, so the first forward finds
  it ready.

Each prefetched layer's pinned bytes are laid out in the order of its slot,
so a copy is one `cudaMemcpyAsync` per contiguous run (one per layer when all
layers have the same tensors).

Without CUDA the same schedule runs with synchronous copies into CPU slots:
CI exercises the rotation, and a wrong rotation gives wrong outputs.

Lifecycle: `PrefetchEngine(...)` (allocates slots, registers hooks, issues the
first copies) -> forward passes -> `remove()` (hooks removed, streams drained,
slots freed). It is the only owner of its streams and events.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from planner.plan import PrefetchSchedule

from .arena import PinnedArena


@dataclass
class PrefetchLayer:
    name: str  # plan layer name
    module: torch.nn.Module
    slot: int
    runs: list[tuple[int, int, int]] = field(default_factory=list)  # (arena offset, slot offset, bytes)


class PrefetchEngine:
    def __init__(self, schedule: PrefetchSchedule, layers: dict[str, PrefetchLayer], slot_bytes: int,
                 arena: PinnedArena, device: torch.device):
        self.schedule = schedule
        self.layers = layers
        self.arena = arena
        self.device = device
        self.cuda = device.type == "cuda"
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(schedule.slots)]
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.ready = {name: torch.cuda.Event() for name in layers} if self.cuda else {}
        self.starts: dict[str, list[str]] = {}
        for t in schedule.schedule:
            self.starts.setdefault(t.after, []).append(t.layer)
        self.hooks = []
        self.copies = 0  # layer copies issued, for stats and tests
        for name, layer in layers.items():
            self.hooks.append(layer.module.register_forward_pre_hook(self._pre_hook(name)))
            self.hooks.append(layer.module.register_forward_hook(self._post_hook(name)))
        for t in schedule.schedule[: schedule.slots]:
            self._copy(t.layer)

    @property
    def pool_bytes(self) -> int:
        return sum(s.numel() for s in self.slots)

    def slot_view(self, layer: str, offset: int, nbytes: int) -> torch.Tensor:
        return self.slots[self.layers[layer].slot][offset:offset + nbytes]

    def _pre_hook(self, name: str):
        def hook(module, args):
            if self.cuda:
                torch.cuda.current_stream(self.device).wait_event(self.ready[name])
        return hook

    def _post_hook(self, name: str):
        def hook(module, args, output):
            for target in self.starts.get(name, ()):
                self._copy(target)
        return hook

    def _copy(self, name: str) -> None:
        layer = self.layers[name]
        slot = self.slots[layer.slot]
        self.copies += 1
        if not self.cuda:
            for a, s, n in layer.runs:
                slot[s:s + n].copy_(self.arena.host(a, n))
            return
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        self.copy_stream.wait_event(done)
        with torch.cuda.stream(self.copy_stream):
            for a, s, n in layer.runs:
                slot[s:s + n].copy_(self.arena.host(a, n), non_blocking=True)
            self.ready[name].record(self.copy_stream)

    def synchronize(self) -> None:
        """Wait for every copy in flight (for example before timing or capture)."""
        if self.cuda:
            self.copy_stream.synchronize()

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []
        self.synchronize()
        self.slots = []
        self.ready = {}
        self.copy_stream = None


class OnDemandCopies:
    """UVA disabled: copy a module's offloaded tensors to the GPU just before it runs.

    For each module owning such tensors, the pre-hook swaps each parameter's
    data for a fresh GPU copy of its pinned host bytes; the post-hook swaps
    the pinned host tensor back, so the GPU copy is freed after the module ran.
    """

    def __init__(self, entries: list[tuple[torch.nn.Module, str, torch.Tensor]], device: torch.device):
        self.device = device
        by_module: dict[int, tuple[torch.nn.Module, list]] = {}
        for module, attr, host in entries:
            by_module.setdefault(id(module), (module, []))[1].append((attr, host))
        self.hooks = []
        for module, items in by_module.values():
            self.hooks.append(module.register_forward_pre_hook(self._pre(items)))
            self.hooks.append(module.register_forward_hook(self._post(items)))

    def _pre(self, items):
        def hook(module, args):
            for attr, host in items:
                getattr(module, attr).data = host.to(self.device, non_blocking=True)
        return hook

    def _post(self, items):
        def hook(module, args, output):
            for attr, host in items:
                getattr(module, attr).data = host
        return hook

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []
