"""Reading checkpoint tensors straight into their final place.

`ShardReader` maps each shard file once (mmap) and hands out zero-copy uint8
views of a tensor's bytes, at the offsets the planner's header reader found.
Offloaded tensors are copied from those views directly into the pinned arena.
GPU-resident tensors go through `Stager`: a few small pinned buffers, filled
on the host and copied to the GPU on a side stream, so pageable memory never
feeds a device copy and nothing larger than a chunk is staged at a time.
`Progress` shows the load: a rich bar on a terminal, one summary line in logs.
`check_holds_weights` refuses a header-only checkpoint before anything is allocated.
"""
from __future__ import annotations

import mmap
import os
import sys
import time
import weakref
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, Progress as RichProgress, ProgressColumn, TextColumn,
                           TimeRemainingColumn)
from rich.text import Text

from planner.errors import CheckpointError
from planner.inputs.checkpoint import Checkpoint
from planner.units import human

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

    `plans/examples/make_checkpoints.py` (`tests/synthetic.py`) writes such
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


class _Speed(ProgressColumn):
    """Bytes per second in binary units (rich's own column counts in decimal GB/s)."""

    def render(self, task) -> Text:
        speed = task.finished_speed or task.speed
        return Text("" if speed is None else f"{human(speed)}/s", style="progress.data.speed")


class Progress:
    """Loading progress on stderr: a rich bar on a terminal, one summary line in logs.

    `enabled`:
    - None (default): on a terminal, a bar with bytes done and total (binary
      units), speed (GiB/s) and time left; elsewhere (a log, a pipe) no bar,
      and one line when the load ends: `loading: 1.50 GiB in 0.82 s (1.83 GiB/s)`;
    - True: the bar, even when stderr is not a terminal (rich then draws it once, at the end);
    - False: nothing; the caller reports (as `plan apply` does).

    The bar redraws at most 10 times a second from `update`, with no refresh
    thread: a load that raises leaves nothing running, and the bar is closed
    when this object goes away.
    """

    def __init__(self, total: int, enabled: bool | None = None, label: str = "loading"):
        self.total = total
        self.done = 0
        self.label = label
        self.start = time.perf_counter()
        self._last = 0.0
        self._summary = enabled is None and not sys.stderr.isatty()
        self._bar = None
        if enabled or (enabled is None and not self._summary):
            self._bar = RichProgress(
                TextColumn(label), BarColumn(), DownloadColumn(binary_units=True), _Speed(),
                TimeRemainingColumn(), console=Console(file=sys.stderr), auto_refresh=False,
                redirect_stdout=False, redirect_stderr=False)
            self._task = self._bar.add_task(label, total=total)
            self._bar.start()
            self._stop = weakref.finalize(self, self._bar.stop)

    def update(self, n: int) -> None:
        self.done += n
        if self._bar is None:
            return
        self._bar.update(self._task, completed=self.done)
        now = time.perf_counter()
        if now - self._last > 0.1 or self.done >= self.total:
            self._last = now
            self._bar.refresh()

    def close(self) -> float:
        """Ends the bar (or writes the summary line); returns the seconds since the start."""
        seconds = time.perf_counter() - self.start
        if self._bar is not None:
            self._bar.refresh()
            self._stop()
        elif self._summary:
            rate = f" ({human(self.done / seconds)}/s)" if seconds > 0 else ""
            print(f"{self.label}: {human(self.done)} in {seconds:.2f} s{rate}", file=sys.stderr)
        return seconds
