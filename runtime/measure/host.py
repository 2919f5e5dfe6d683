"""The host's figures for experts on cpu, for `plan calibrate` (calibrate.py): what the runtime's kernel
(runtime/execute/host/native.cpp) reads while the GPU reads over UVA, and what a layer's hand-over costs.

- `cpu_expert_gbps`: native.cpp's calls over experts of Qwen3-30B-A3B's shape (1.2 GB of them, each call
  taking experts the calls just before it did not: cold, as a decode step's are), while a thread of ours keeps the
  GPU reading a pinned buffer over UVA (a replayed graph of GEMVs, again and again): one token with 1, 2, 4 or all
  8 of its top-8 experts on cpu (as a split layer's calls have a few), then 2, 4 and 8 tokens with all on cpu;
  each call's time against its touched experts' bytes, fitted by least squares to `fixed + bytes / rate`. Host
  memory feeds the link and the cores at once, each slower than alone, so the rate is the one a split plan gets.
  The calls of one to four experts pin the fixed cost: fitted over 8 to 64 experts only, it came out anywhere
  from 11 to 265 us on the same H100 machine (a small error in the slope, 75 MB from zero), where the decode's
  calls measured none beyond their bytes at the rate;
- `cpu_expert_alone_gbps`: the same calls with the GPU idle, the rate of a layer whose experts off the GPU are
  all on cpu (the cost model takes it there);
- the hand-over: a captured graph of what a decode step enqueues per layer with experts on cpu (the tokens and
  their routing copied to pinned memory, the host node, the outputs copied back), its job computing nothing
  (no expert on cpu), replayed 200 times, five times over: the fastest of the five median replays (a median
  moved between 33 and 62 us with the host CPU's slow phases, docs/calibration/; the fastest of five stayed
  within 33-37 us in four processes).

`cpu_expert_sync_us` = the hand-over + the fit's fixed cost. `cpu_threads`: the cores this process may run on,
less one for the Python thread that launches the GPU's work.

Limits: one expert shape (the plan's may be larger or smaller: the rate is what matters, and it is bytes);
the GPU's UVA reads run at full rate throughout, where a step's run only while its experts are read.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import statistics
import threading
import time
from dataclasses import dataclass

import torch

from ..execute.host import native
from ..execute.host.handoff import launch_host_func
from ..place.arena import PinnedArena
from .bandwidth import mlp_weights, random_bytes

EXPERTS, INTER, HIDDEN, TOP_K = 128, 768, 2048, 8
POINTS = ((1, 1), (1, 2), (1, 4), (1, 8), (2, 16), (4, 32), (8, 64))  # (tokens, of their pairs those on cpu)


@dataclass(frozen=True)
class HostFigures:
    threads: int
    gbps: float  # the touched experts' bytes per second, beside the GPU's UVA reads
    alone_gbps: float  # the same, with the GPU idle
    fixed_us: float  # per call, the fit's intercept
    handover_us: float  # per layer: copies, host node, copy back
    r2: float  # of the fit
    isa: str  # native.cpp's instruction set


def threads_here() -> int:
    return max(1, len(os.sched_getaffinity(0)) - 1)


def host_figures(calls: int = 24) -> HostFigures | None:
    """The module doc's figures; None where native.cpp is not built (`native.why_not`)."""
    lib = native.library()
    if lib is None:
        return None
    threads = threads_here()
    pool = native.Pool(lib, threads)
    try:
        fixed, gbps, r2 = _rate(lib, pool, calls, _uva_reads())
        alone = _rate(lib, pool, calls, contextlib.nullcontext())[1]
        handover = min(_handover(lib, pool) for _ in range(5))  # the host's slow phases only add (module doc)
        return HostFigures(threads, gbps, alone, fixed, handover, r2, pool.isa())
    finally:
        pool.close()


def _rate(lib, pool, calls: int, beside) -> tuple[float, float, float]:
    """(fixed us, GB/s, R^2) of the module doc's fit, its calls made inside the context `beside`."""
    gate_up = torch.full((EXPERTS, 2 * INTER, HIDDEN), 0.01, dtype=torch.bfloat16)  # values do not change the time
    down = torch.full((EXPERTS, HIDDEN, INTER), 0.01, dtype=torch.bfloat16)
    on_cpu = torch.zeros(EXPERTS, dtype=torch.uint8)
    expert_bytes = (gate_up[0].nbytes + down[0].nbytes)
    order = torch.randperm(EXPERTS, generator=torch.Generator().manual_seed(0))
    points: list[tuple[float, float]] = []  # (bytes, us)
    with beside:
        for tokens, on in POINTS * 2:
            x = torch.full((tokens, HIDDEN), 0.5, dtype=torch.bfloat16)
            y = torch.empty((tokens * TOP_K, HIDDEN), dtype=torch.bfloat16)
            ids = torch.empty(tokens * TOP_K, dtype=torch.long)
            job = native.job(pool, gate_up, down, on_cpu, x, ids, y, tokens, TOP_K)
            took = []
            for c in range(calls):  # each call's experts follow the last call's in a shuffled ring: cold
                first = c * tokens * TOP_K
                ids.copy_(order[(torch.arange(tokens * TOP_K) + first) % EXPERTS])
                on_cpu.zero_()[ids[:on]] = 1  # the job reads the mask where it lies
                start = time.perf_counter()
                native.run(lib, job)
                took.append(time.perf_counter() - start)
            points.append((on * expert_bytes, 1e6 * statistics.median(took[2:])))
    x, us = [p[0] for p in points], [p[1] for p in points]
    slope, fixed = statistics.linear_regression(x, us)
    mean = statistics.fmean(us)
    r2 = 1 - sum((u - slope * b - fixed) ** 2 for b, u in zip(x, us)) / max(sum((u - mean) ** 2 for u in us), 1e-12)
    return max(fixed, 0.0), 1 / slope / 1e3, r2


class _uva_reads:
    """While open, a thread of ours keeps the GPU reading 0.9 GiB of pinned memory over UVA (replayed GEMVs)."""

    def __enter__(self):
        nbytes = 8 * 14336 * 4096 * 2
        self.arena = PinnedArena(nbytes, cuda=True)
        self.arena.host_view(0, nbytes).copy_(random_bytes(nbytes))
        weights = mlp_weights(self.arena.device_view(0, nbytes))
        v = torch.randn(1, weights[0].shape[1], dtype=torch.bfloat16, device="cuda")
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for w in weights:
                torch.nn.functional.linear(v, w)
        stream.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=stream):
            for w in weights:
                torch.nn.functional.linear(v, w)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()
        time.sleep(0.05)  # the reads under way
        return self

    def _loop(self):
        done = torch.cuda.Event()
        while not self.stop.is_set():
            self.graph.replay()
            done.record()
            done.synchronize()  # the GIL released while the GPU reads

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        torch.cuda.synchronize()
        del self.graph
        self.arena.release()


def _handover(lib, pool, repeat: int = 200) -> float:
    """The per-layer hand-over as a decode step's graph runs it (module doc): median replay, us."""
    tokens, pairs = 1, TOP_K
    x_host = torch.empty((tokens, HIDDEN), dtype=torch.bfloat16, pin_memory=True)
    ids_host = torch.empty(pairs, dtype=torch.long, pin_memory=True)
    y_host = torch.empty((pairs, HIDDEN), dtype=torch.bfloat16, pin_memory=True)
    weights = torch.empty((1, 2, 2), dtype=torch.bfloat16), torch.empty((1, 2, 1), dtype=torch.bfloat16)
    on_cpu = torch.zeros(1, dtype=torch.uint8)  # none: kept alive for the job's life, as native.job asks
    job = native.job(pool, *weights, on_cpu, x_host, ids_host, y_host, tokens, TOP_K)
    ids_host.zero_()
    x = torch.zeros((tokens, HIDDEN), dtype=torch.bfloat16, device="cuda")
    ids = torch.zeros(pairs, dtype=torch.long, device="cuda")
    y = torch.empty((pairs, HIDDEN), dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        x_host.copy_(x, non_blocking=True)
        ids_host.copy_(ids, non_blocking=True)
        launch_host_func(torch.cuda.current_stream().cuda_stream, native.address(lib), ctypes.addressof(job))
        y.copy_(y_host, non_blocking=True)
    times = []
    for i in range(repeat + 10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if i >= 10:
            times.append(1e3 * start.elapsed_time(end))
    if job.error:
        raise RuntimeError("offplan: the hand-over's job failed in calibration")
    return statistics.median(times)
