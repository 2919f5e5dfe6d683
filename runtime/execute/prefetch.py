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

The hooks call the two steps as custom ops (ops.py) threaded through the
layer's activations, so torch.compile traces them without graph breaks and
keeps them in order.

CUDA graphs: `synchronize()` drains the copy stream and marks every copy
already issued as complete, so a forward captured next waits only on copies
recorded inside the capture (an event recorded outside a capture cannot be
waited on inside it). `join()` makes the current stream wait for the copy
stream: at the end of a captured forward it joins the copies the last layers
start for the first ones; in eager use, call it after a forward that a graph
replay follows.

Each prefetched layer's pinned bytes are its slot image, laid out as the plan
says (layout.py), so a copy is one `cudaMemcpyAsync` of the image.

Without CUDA the same schedule runs with synchronous copies into CPU slots:
CI exercises the rotation, and a wrong rotation gives wrong outputs.

Lifecycle: `PrefetchEngine(...)` (allocates slots, registers hooks, issues the
first copies) -> forward passes -> `remove()` (hooks removed, streams drained,
slots freed). It is the only owner of its streams and events.
"""
from __future__ import annotations

import torch

from planner.errors import OffplanError
from planner.plan import PrefetchSchedule

from ..place.arena import PinnedArena
from ..place.layout import StreamedLayer
from . import ops


class PrefetchEngine:
    def __init__(self, schedule: PrefetchSchedule, streamed: list[StreamedLayer], arena: PinnedArena,
                 device: torch.device):
        self.schedule = schedule
        self.layers = {l.name: l for l in streamed}
        self.arena = arena
        self.device = device
        self.cuda = device.type == "cuda"
        self.slots = [torch.empty(schedule.slot_bytes, dtype=torch.uint8, device=device)
                      for _ in range(schedule.slots)]
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.ready = {name: torch.cuda.Event() for name in self.layers} if self.cuda else {}
        self.starts: dict[str, list[str]] = {}
        for t in schedule.schedule:
            self.starts.setdefault(t.after, []).append(t.layer)
        self.hooks = []
        self.copies = 0  # layer copies issued, for stats and tests
        self.names = list(self.layers)  # the ops name layers by index
        self._complete: set[str] = set()  # copies known finished: no wait needed (see synchronize)
        self.expected = 0  # index of the prefetched layer the next forward step should reach
        self.reprimes = 0  # forwards that started over after one stopped part-way
        self.key = ops.register(self)
        for i, layer in enumerate(self.layers.values()):
            self.hooks.append(layer.module.register_forward_pre_hook(self._pre_hook(i), with_kwargs=True))
            self.hooks.append(layer.module.register_forward_hook(self._post_hook(i)))
        self._prime()

    def _prime(self) -> None:
        """Copy the first layer of each slot: the state every forward starts from."""
        if self.expected != 0:
            self.reprimes += 1
        for t in self.schedule.schedule[: self.schedule.slots]:
            self._copy(t.layer)

    @property
    def pool_bytes(self) -> int:
        return sum(s.numel() for s in self.slots)

    def slot_view(self, layer: str, offset: int, nbytes: int) -> torch.Tensor:
        """Bytes [offset, offset + nbytes) of the slot `layer` streams through: where its tensor lives."""
        return self.slots[self.layers[layer].slot][offset:offset + nbytes]

    def _pre_hook(self, index: int):
        def hook(module, args, kwargs):
            if args and isinstance(args[0], torch.Tensor):
                return (ops.prefetch_wait(args[0], self.key, index), *args[1:]), kwargs
            if isinstance(kwargs.get("hidden_states"), torch.Tensor):
                return args, {**kwargs, "hidden_states": ops.prefetch_wait(kwargs["hidden_states"], self.key, index)}
            self.wait(index)  # no activation to thread through: correct eagerly, unordered if compiled
            return None
        return hook

    def _post_hook(self, index: int):
        def hook(module, args, output):
            if not self.starts.get(self.names[index]):
                return None
            if isinstance(output, torch.Tensor):
                return ops.prefetch_start(output, self.key, index)
            if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
                return (ops.prefetch_start(output[0], self.key, index), *output[1:])
            self.start_after(index)
            return None
        return hook

    def wait(self, index: int) -> None:
        """The current stream waits for layer `index`'s copy (the body of `offplan::prefetch_wait`).

        The rotation assumes every forward runs the prefetched layers in plan
        order. A forward that starts over at the first layer after one stopped
        part-way (an exception) re-primes the slots to their start-of-pass state;
        any other order is refused, since the slot would hold another layer.
        """
        if index != self.expected:
            if index != 0:
                raise OffplanError(
                    f"prefetched layer {self.names[index]} ran out of order (expected {self.names[self.expected]}): "
                    "a prefetch plan's layers must run in plan order, every forward")
            self._prime()
        self.expected = (index + 1) % len(self.names)
        name = self.names[index]
        if self.cuda and name not in self._complete:
            torch.cuda.current_stream(self.device).wait_event(self.ready[name])

    def start_after(self, index: int) -> None:
        """Start the copies layer `index` frees a slot for (the body of `offplan::prefetch_start`)."""
        for target in self.starts.get(self.names[index], ()):
            self._copy(target)

    def _copy(self, name: str) -> None:
        layer = self.layers[name]
        slot = self.slots[layer.slot]
        self.copies += 1
        self._complete.discard(name)
        image = self.arena.host_view(layer.host_offset, layer.nbytes)
        if not self.cuda:
            slot[:layer.nbytes].copy_(image)
            return
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        self.copy_stream.wait_event(done)
        with torch.cuda.stream(self.copy_stream):
            slot[:layer.nbytes].copy_(image, non_blocking=True)
            self.ready[name].record(self.copy_stream)

    def synchronize(self) -> None:
        """Wait for every copy in flight; later waits on them are skipped (before and after a capture)."""
        if self.cuda:
            self.copy_stream.synchronize()
            self._complete = set(self.layers)

    def join(self) -> None:
        """Make the current stream wait for the copy stream (end of a captured forward)."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []
        self.synchronize()
        self.slots = []
        self.ready = {}
        self.copy_stream = None
