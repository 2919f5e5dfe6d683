"""Reading checkpoint tensors straight into their final place.

`ShardReader` maps each shard file once (mmap) and hands out zero-copy uint8
views of a tensor's bytes, at the offsets the planner's header reader found.
Offloaded tensors are copied from those views directly into the pinned arena.
GPU-resident tensors go through `Stager`: a few small pinned buffers, filled
on the host and copied to the GPU on a side stream, so pageable memory never
feeds a device copy and nothing larger than a chunk is staged at a time.
`Progress` draws a one-line bar (bytes, GB/s) only when stderr is a terminal.
`check_holds_weights` refuses a header-only checkpoint before anything is allocated.
"""
from __future__ import annotations

import mmap
import os
import sys
import time
from pathlib import Path

import torch

from planner.checkpoint import Checkpoint
from planner.errors import CheckpointError
from planner.report import human

HOLE_MIN_BYTES = 2**20  # smaller shards are never called header-only: one file system block may hold them
HOLE_FRACTION = 16  # header-only: under 1/16 of the data's bytes allocated on disk

STAGING_CHUNK = 64 * 2**20
STAGING_BUFFERS = 2

TORCH_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
    "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def check_holds_weights(checkpoint: Checkpoint) -> None:
    """Refuse a header-only checkpoint: valid headers over data regions that are holes in sparse files.

    `plans/examples/make_checkpoints.py` (`planner.synthetic`) writes such
    checkpoints so that big models can be planned without their weights; loading
    one would read zeros. A shard counts as header-only when the file system
    has allocated (`st_blocks`) under 1/16 of the bytes its tensors need. A real
    shard has all its bytes allocated (compressing file systems store random
    weights at more than half their size), so only shards whose tensors hold at
    least 1 MiB are judged: below that, block rounding could blur the two. A
    file system that reports no allocation (`st_blocks` 0 or absent) is not judged.
    """
    need: dict[str, int] = {}
    for info in checkpoint.tensors.values():
        need[info.shard] = need.get(info.shard, 0) + info.nbytes
    holes = {}  # shard -> (bytes its tensors need, bytes allocated)
    for shard, nbytes in sorted(need.items()):
        try:
            allocated = os.stat(Path(checkpoint.root) / shard).st_blocks * 512
        except (OSError, AttributeError):  # AttributeError: no st_blocks on this platform
            continue
        if nbytes >= HOLE_MIN_BYTES and 0 < allocated < nbytes // HOLE_FRACTION:
            holes[shard] = (nbytes, allocated)
    if not holes:
        return
    headline = (f"{checkpoint.root}: the checkpoint holds no weights: the data of "
                + ("its shards are" if len(holes) == len(need) else f"{len(holes)} of its {len(need)} shards are")
                + f" holes in sparse files ({human(sum(n for n, _ in holes.values()))} of tensors, "
                f"{human(sum(a for _, a in holes.values()))} on disk). It is a header-only checkpoint, for planning "
                "only (plans/examples/make_checkpoints.py writes them). To load the model, download the real "
                "checkpoint, point the policy's `checkpoint:` at it and run `plan build` again")
    problems = [] if len(holes) == len(need) else [
        f"{shard}: its tensors need {human(n)}, {human(a)} is on disk" for shard, (n, a) in holes.items()]
    raise CheckpointError(headline, problems)


class ShardReader:
    """Zero-copy views of tensor bytes in mmap'd shard files. Close it when done."""

    def __init__(self, checkpoint: Checkpoint):
        self.checkpoint = checkpoint
        self._maps: dict[str, mmap.mmap] = {}

    def raw(self, name: str) -> torch.Tensor:
        """The tensor's bytes as a flat uint8 CPU tensor backed by the file."""
        info = self.checkpoint.tensors[name]
        mm = self._maps.get(info.shard)
        if mm is None:
            with open(Path(self.checkpoint.root) / info.shard, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: views are writable, the file never is
            self._maps[info.shard] = mm
        if info.nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(mm, dtype=torch.uint8, count=info.nbytes, offset=info.offset)

    def typed(self, name: str) -> torch.Tensor:
        """The tensor with its checkpoint dtype and shape (copied if unaligned)."""
        info = self.checkpoint.tensors[name]
        dtype = TORCH_DTYPES.get(info.dtype)
        if dtype is None:
            raise ValueError(f"{name}: cannot convert {info.dtype} to another dtype")
        raw = self.raw(name)
        if info.offset % dtype.itemsize:
            raw = raw.clone()
        return raw.view(dtype).view(info.shape)

    def close(self) -> None:
        for mm in self._maps.values():
            try:
                mm.close()
            except BufferError:  # a view is still alive; the map goes with it
                pass
        self._maps.clear()


class Stager:
    """Host -> GPU copies through small pinned buffers on a side stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.buffers = [torch.empty(STAGING_CHUNK, dtype=torch.uint8, pin_memory=True)
                        for _ in range(STAGING_BUFFERS)]
        self.events = [None] * STAGING_BUFFERS
        self.next = 0

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy uint8 host bytes `src` into uint8 device bytes `dst` (same length)."""
        n = src.numel()
        for start in range(0, n, STAGING_CHUNK):
            m = min(STAGING_CHUNK, n - start)
            i = self.next
            self.next = (i + 1) % STAGING_BUFFERS
            if self.events[i] is not None:
                self.events[i].synchronize()  # the buffer's previous copy has left it
            buf = self.buffers[i][:m]
            buf.copy_(src[start:start + m])
            with torch.cuda.stream(self.stream):
                dst[start:start + m].copy_(buf, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self.stream)
            self.events[i] = ev

    def finish(self) -> None:
        """Wait for every copy, then free the staging buffers."""
        self.stream.synchronize()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self.buffers = []
        self.events = []


class Progress:
    """`loading 3.2/16.1 GB  5.1 GB/s` on stderr, redrawn at most 10 times a second, TTY only."""

    def __init__(self, total: int, enabled: bool | None = None, label: str = "loading"):
        self.total = total
        self.done = 0
        self.label = label
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.start = time.perf_counter()
        self._last = 0.0

    def update(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if self.enabled and (now - self._last > 0.1 or self.done >= self.total):
            self._last = now
            rate = self.done / max(now - self.start, 1e-9) / 1e9
            sys.stderr.write(f"\r{self.label} {self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB  {rate:.2f} GB/s ")
            sys.stderr.flush()

    def close(self) -> float:
        """Seconds since the start; ends the bar's line."""
        if self.enabled:
            sys.stderr.write("\n")
        return time.perf_counter() - self.start
