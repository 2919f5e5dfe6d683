"""The expert ring: at prefill, the host experts of staged layers streamed through a few GPU buffers.

A long prompt touches nearly every routed expert of a layer (planner/decide/staging.py),
so prefill copies a staged layer's experts in pinned memory to the GPU ahead
of the layer instead of reading them through the zero-copy view once its
router has picked them. They do not need a slot holding the layer's experts
whole (Qwen3-30B-A3B: 1.1 GiB a layer, twice over for the overlap): offplan's
experts implementation (experts.py) gathers each forward's expert rows into
a tensor of its own anyway, so a row is free again as soon as it is gathered.
The ring is therefore `positions` buffers of `cap` bytes, the plan's
`prefill.ring_bytes` in all, and a layer's host rows pass through them in
chunks:

- at load, each staged experts module (a *unit*) has its fused parameters'
  host rows cut into chunks of whole rows (runs of consecutive experts, one
  copy each; no chunk spans two units), in forward order; chunk k uses
  position k mod `positions`;
- when a staged forward begins (`begin`: the input embedding's hook, or the
  first staged layer's), the ring is allocated and the first `positions`
  chunks are copied on the copy stream;
- the unit's experts forward (`fill`, through `offplan::expert_fill`): per
  chunk, the compute stream waits for its copy, copies its rows into the
  forward's gathered rows (device to device), and records that the chunk is
  consumed; the chunk `positions` further on is then copied into the same
  buffer once that record has passed. So the link streams the next chunks
  while the layer's grouped GEMMs and the next layer's attention run, as far
  ahead as the ring holds;
- after the last chunk the ring is released to torch's caching allocator:
  it is working memory of the prefill, like the gathered rows and the
  activations, and decode never allocates it.

The copies are enqueued in forward order by the CPU, each after the compute
work that frees its buffer was enqueued (a stream waiting on an event not
yet recorded would not wait). A unit that did not run in this forward (a
vision tower skipped by a text prompt) has its chunks dropped when a later
unit fills. Without CUDA the same schedule runs with synchronous copies, so
CI exercises it: a chunk in the wrong buffer gives wrong outputs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from planner.errors import PlanFileError

from ..place.arena import align, typed

CHUNKS = 4  # positions the ring is cut into, unless a row needs more room: copies start as a chunk frees


@dataclass
class _Piece:
    param: int  # index of the fused parameter in the unit's list (experts.fused_params order)
    first: int  # experts [first, end) of it
    end: int
    offset: int  # bytes into the chunk's buffer
    src: torch.Tensor  # the pinned rows [end - first, ...]


@dataclass
class _Chunk:
    unit: int
    pieces: list[_Piece] = field(default_factory=list)
    used: int = 0  # bytes


class ExpertRing:
    """The chunks, their events, and the per-forward buffer (module doc)."""

    def __init__(self, ring_bytes: int, units: list[list[tuple[int, torch.Tensor, list[int]]]],
                 device: torch.device, copy_stream):
        """`units`, in forward order: per staged experts module, its (parameter index, pinned tensor [E, ...],
        experts in pinned memory) for each fused parameter with host rows."""
        self.device, self.copy_stream = device, copy_stream
        self.cuda = device.type == "cuda"
        rows = [src[0].numel() * src.element_size() for params in units for _, src, _ in params]
        self.cap = max([align(ring_bytes // CHUNKS), *rows])
        self.positions = ring_bytes // self.cap
        if units and not self.positions:
            raise PlanFileError(f"the plan's prefill ring ({ring_bytes} bytes) cannot hold one expert row "
                                f"({max(rows)} bytes); rebuild the plan")
        self.chunks: list[_Chunk] = []
        self.first: list[int] = []  # per unit: its first chunk
        for u, params in enumerate(units):
            self.first.append(len(self.chunks))
            chunk = None
            for param, src, host in params:
                row = src[0].numel() * src.element_size()
                for first, end in _runs(host):
                    while first < end:
                        if chunk is None or chunk.used + row > self.cap:
                            chunk = _Chunk(u)
                            self.chunks.append(chunk)
                        n = min(end - first, (self.cap - chunk.used) // row)
                        chunk.pieces.append(_Piece(param, first, first + n, chunk.used, src[first:first + n]))
                        chunk.used += n * row
                        first += n
        self.first.append(len(self.chunks))
        self.copied_events = [torch.cuda.Event() for _ in self.chunks] if self.cuda else []
        self.consumed_events = [torch.cuda.Event() for _ in self.chunks] if self.cuda else []
        self.buffer: torch.Tensor | None = None
        self.copied = self.consumed = 0
        self.used: list[bool] = []

    @property
    def ring_bytes(self) -> int:
        return self.positions * self.cap

    def _view(self, k: int, piece: _Piece) -> torch.Tensor:
        start = (k % self.positions) * self.cap + piece.offset
        return typed(self.buffer[start:start + piece.src.numel() * piece.src.element_size()], piece.src.dtype,
                     tuple(piece.src.shape))

    def begin(self) -> None:
        """A staged forward begins: a fresh buffer, the first chunks' copies started."""
        if not self.chunks:
            return
        if self.cuda:  # the previous forward's reads of the ring are enqueued before these copies
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            self.copy_stream.wait_event(done)
        self.buffer = torch.empty(self.ring_bytes, dtype=torch.uint8, device=self.device)
        if self.cuda:
            self.buffer.record_stream(self.copy_stream)
        self.copied = self.consumed = 0
        self.used = [False] * len(self.chunks)
        self._refill()

    def _refill(self) -> None:
        while self.copied < min(self.consumed + self.positions, len(self.chunks)):
            k = self.copied
            if not self.cuda:
                for piece in self.chunks[k].pieces:
                    self._view(k, piece).copy_(piece.src)
            else:
                if k >= self.positions and self.used[k - self.positions]:
                    self.copy_stream.wait_event(self.consumed_events[k - self.positions])
                with torch.cuda.stream(self.copy_stream):
                    for piece in self.chunks[k].pieces:
                        self._view(k, piece).copy_(piece.src, non_blocking=True)
                    self.copied_events[k].record(self.copy_stream)
            self.copied += 1

    def fill(self, unit: int, rows: list[torch.Tensor]) -> None:
        """Copy `unit`'s host rows from the ring into `rows` (its fused parameters' gathered rows, [E, ...] each,
        in expert order) on the current stream, chunk by chunk (module doc)."""
        if self.buffer is None or self.consumed > self.first[unit]:  # not begun, or this unit already filled
            self.begin()
        while self.consumed < self.first[unit]:  # units that did not run in this forward: their chunks dropped
            self.consumed += 1
            self._refill()
        stream = torch.cuda.current_stream(self.device) if self.cuda else None
        for k in range(self.first[unit], self.first[unit + 1]):
            if stream is not None:
                stream.wait_event(self.copied_events[k])
            for piece in self.chunks[k].pieces:
                rows[piece.param][piece.first:piece.end].copy_(self._view(k, piece))
            if stream is not None:
                self.consumed_events[k].record(stream)
            self.used[k] = True
            self.consumed = k + 1
            self._refill()
        if self.consumed == len(self.chunks):
            self.buffer = None  # back to the caching allocator (record_stream keeps it from the copy stream's reuse)


def _runs(experts: list[int]) -> list[tuple[int, int]]:
    """[first, end) of each run of consecutive experts: [0, 1, 2, 5] -> [(0, 3), (5, 6)]."""
    out: list[tuple[int, int]] = []
    for e in sorted(experts):
        if out and out[-1][1] == e:
            out[-1] = (out[-1][0], e + 1)
        else:
            out.append((e, e + 1))
    return out
