"""The host's figures for experts on cpu, for `plan calibrate` (calibrate.py): what the runtime's kernel
(runtime/execute/host/native.cpp) reads while the GPU reads over UVA, and what a layer's hand-over costs.

- `cpu_expert_gbps`: native.cpp's calls over experts of Qwen3-30B-A3B's shape (1.2 GB of them, each call
  taking experts the calls just before it did not: cold, as a decode step's are), while a thread of ours keeps the
  GPU reading a pinned buffer over UVA (a replayed graph of GEMVs, again and again): one token with 1, 2, 4 or all
  8 of its top-8 experts on cpu (as a split layer's calls have a few), then 2, 4 and 8 tokens with all on cpu;
  each call's time beyond the fixed cost against its touched experts' bytes, fitted by least squares to
  `bytes / rate`. Host memory feeds the link and the cores at once, each slower than alone, so the rate is the one
  a split plan gets;
- the fixed cost of a call: calls of one token to one tiny expert, which wake the kernel's workers and meet at
  its barrier as a decode step's do, with nothing to read. An intercept fitted instead moved from 11 to 265 us
  over 8 to 64 experts (a small error in the slope, 75 MB from zero), and 0-29 us over 1 to 64 experts between
  three calibrations in a row (docs/calibration/);
- `cpu_expert_alone_gbps`: the same calls with the GPU idle, the rate of a layer whose experts off the GPU are
  all on cpu (the cost model takes it there);
- the hand-over: a captured graph of what a decode step enqueues per layer with experts on cpu (the tokens and
  their routing copied to pinned memory, the host node, the outputs copied back), its job computing nothing
  (no expert on cpu), replayed 200 times: its median replay.

Rounds. The host's CPU runs in phases, seconds to a minute long, in which everything it does is slower, about
1.4-1.9x (docs/calibration/): a fit made inside one such phase moved the rates 9-17% and the fixed cost over 100%
between calibrations. So the figures are measured in rounds (`HostRounds.round`: each point's median call beside
UVA reads and alone, one hand-over and the fixed cost), which `plan calibrate` spreads between its other
measurements, about a minute; each point (and the hand-over, and the fixed cost) keeps its fastest round, since a
phase only adds time, and the fits go through those. The median round's slowdown against the fastest is reported,
as the eager lines' is.

`cpu_expert_sync_us` = the hand-over + the fixed cost. `cpu_threads`: the threads the kernel ran with:
asked (`plan calibrate --cpu-threads N`, at most the cores this process may run on), or the cores this process
may run on less one for the Python thread that launches the GPU's work. A plan computes with the profile's
`cpu_threads`, so a machine that will run other work beside the model calibrates at the threads it will give.

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

from planner.errors import OffplanError

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
    fixed_us: float  # per call: a call of a tiny expert (`_fixed_call`)
    handover_us: float  # per layer: copies, host node, copy back
    r2: float  # of the rate's line
    isa: str  # native.cpp's instruction set
    rounds: int = 1  # of each point, the fastest kept (module doc)
    slowdown: float = 1.0  # the median round's time against the fastest, the calls of 8 experts beside UVA reads

    def profile_fields(self) -> dict:
        """The hardware profile's fields these figures give (planner/inputs/hardware.py)."""
        return dict(cpu_expert_gbps=round(self.gbps, 1), cpu_expert_alone_gbps=round(self.alone_gbps, 1),
                    cpu_expert_sync_us=round(self.fixed_us + self.handover_us, 1), cpu_threads=self.threads,
                    cpu_rates_threads=self.threads)


def threads_here() -> int:
    return max(1, len(os.sched_getaffinity(0)) - 1)


def check_threads(threads: int | None) -> int:
    """The threads to measure with: `threads`, or `threads_here()` for None. More than the cores this process may
    run on is an error (before anything is measured), naming both and how to get more."""
    cores = len(os.sched_getaffinity(0))
    if threads is None:
        return threads_here()
    if threads < 1 or threads > cores:
        raise OffplanError(f"--cpu-threads {threads}: this process may run on {cores} cores (its CPU affinity), so "
                           f"the host kernel can run 1 to {cores} threads; ask for at most {cores}"
                           + (f" ({threads_here()} leaves one for the thread that launches the GPU's work)"
                              if cores > 1 else "")
                           + ", or widen the affinity (`taskset -c`, the container's CPU limit)")
    return threads


class HostRounds:
    """The module doc's figures, measured a round at a time (`round`) and reduced once (`figures`).

        rounds = HostRounds.start(threads)   # None where native.cpp is not built (`native.why_not`)
        for ...: rounds.round()                # between other measurements, so that the rounds span time
        figures = rounds.figures()             # and the kernel's pool is closed
    """

    def __init__(self, lib, threads: int, calls: int):
        self.lib, self.calls = lib, calls
        self.pool = native.Pool(lib, threads)
        self.threads = threads
        self.gate_up = torch.full((EXPERTS, 2 * INTER, HIDDEN), 0.01, dtype=torch.bfloat16)  # values: no matter
        self.down = torch.full((EXPERTS, HIDDEN, INTER), 0.01, dtype=torch.bfloat16)
        self.beside: list[list[float]] = []  # per round, per point (POINTS): the median call, us
        self.alone: list[list[float]] = []
        self.handovers: list[float] = []
        self.fixed: list[float] = []  # per round: a call of a tiny expert, us (`_fixed_call`)

    @classmethod
    def start(cls, threads: int | None = None, calls: int = 24) -> "HostRounds | None":
        lib = native.library()
        return None if lib is None else cls(lib, check_threads(threads), calls)

    def round(self) -> None:
        self.beside.append(self._points(_uva_reads()))
        self.alone.append(self._points(contextlib.nullcontext()))
        self.handovers.append(_handover(self.lib, self.pool))
        self.fixed.append(_fixed_call(self.lib, self.pool))

    def figures(self) -> HostFigures:
        """Each point's fastest round, fitted (module doc); the pool closed."""
        try:
            isa = self.pool.isa()
        finally:
            self.pool.close()
        expert_bytes = self.gate_up[0].nbytes + self.down[0].nbytes
        return fastest_rounds(self.threads, isa, [on * expert_bytes for _, on in POINTS], self.beside, self.alone,
                              self.handovers, self.fixed)

    def _points(self, beside) -> list[float]:
        """Each point's median call (us), the calls made inside the context `beside`."""
        on_cpu = torch.zeros(EXPERTS, dtype=torch.uint8)
        order = torch.randperm(EXPERTS, generator=torch.Generator().manual_seed(len(self.beside)))
        medians = []
        with beside:
            for tokens, on in POINTS:
                x = torch.full((tokens, HIDDEN), 0.5, dtype=torch.bfloat16)
                y = torch.empty((tokens * TOP_K, HIDDEN), dtype=torch.bfloat16)
                ids = torch.empty(tokens * TOP_K, dtype=torch.long)
                job = native.job(self.pool, self.gate_up, self.down, on_cpu, x, ids, y, tokens, TOP_K)
                took = []
                for c in range(self.calls):  # each call's experts follow the last call's in a shuffled ring: cold
                    first = c * tokens * TOP_K
                    ids.copy_(order[(torch.arange(tokens * TOP_K) + first) % EXPERTS])
                    on_cpu.zero_()[ids[:on]] = 1  # the job reads the mask where it lies
                    start = time.perf_counter()
                    native.run(self.lib, job)
                    took.append(time.perf_counter() - start)
                medians.append(1e6 * statistics.median(took[2:]))
        return medians


def host_figures(threads: int | None = None, rounds: int = 4) -> HostFigures | None:
    """The module doc's figures from `rounds` rounds back to back (calibrate.py spreads them instead); None where
    native.cpp is not built (`native.why_not`)."""
    measuring = HostRounds.start(threads)
    if measuring is None:
        return None
    for _ in range(rounds):
        measuring.round()
    return measuring.figures()


def fastest_rounds(threads: int, isa: str, nbytes: list[float], beside: list[list[float]], alone: list[list[float]],
                   handovers: list[float], fixed_calls: list[float]) -> HostFigures:
    """The figures from rounds of measurements: per round, each point's median call (us) beside UVA reads and
    alone, the points' bytes `nbytes`, a hand-over and a call of a tiny expert (the fixed cost). Each keeps its
    fastest round (a slow phase only adds time); the rates are the points' time beyond the fixed cost over their
    bytes (a line through the origin), since an intercept fitted from 9 MB to 600 MB moved 0-29 us between
    calibrations (docs/calibration/); `slowdown` is the median round of the calls of 8 experts (POINTS' (1, 8))
    against their fastest, beside UVA reads."""
    fixed = min(fixed_calls)
    gbps, r2 = _rate(nbytes, [min(r[i] for r in beside) - fixed for i in range(len(nbytes))])
    alone_gbps = _rate(nbytes, [min(r[i] for r in alone) - fixed for i in range(len(nbytes))])[0]
    eight = [r[POINTS.index((1, 8))] for r in beside]
    return HostFigures(threads, gbps, alone_gbps, fixed, min(handovers), r2, isa, len(beside),
                       statistics.median(eight) / min(eight))


def _rate(x: list[float], us: list[float]) -> tuple[float, float]:
    """(GB/s, R^2) of `us` = bytes / rate over the points' bytes `x`: least squares through the origin."""
    slope = sum(b * u for b, u in zip(x, us)) / sum(b * b for b in x)
    mean = statistics.fmean(us)
    r2 = 1 - sum((u - slope * b) ** 2 for b, u in zip(x, us)) / max(sum((u - mean) ** 2 for u in us), 1e-12)
    return 1 / slope / 1e3, r2


def _fixed_call(lib, pool, repeat: int = 200) -> float:
    """A call's fixed cost (us): the median of `repeat` calls of one token to one tiny expert (64 x 32 weights:
    no time to read), which wake the pool's workers, deal out their chunks and meet at the barrier as a decode
    step's calls do."""
    hidden, inter = 64, 16
    gate_up = torch.full((1, 2 * inter, hidden), 0.01, dtype=torch.bfloat16)
    down = torch.full((1, hidden, inter), 0.01, dtype=torch.bfloat16)
    on_cpu = torch.ones(1, dtype=torch.uint8)
    x, ids = torch.full((1, hidden), 0.5, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.long)
    y = torch.empty((1, hidden), dtype=torch.bfloat16)
    job = native.job(pool, gate_up, down, on_cpu, x, ids, y, 1, 1)
    took = []
    for _ in range(repeat + 10):
        start = time.perf_counter()
        native.run(lib, job)
        took.append(time.perf_counter() - start)
    return 1e6 * statistics.median(took[10:])


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
