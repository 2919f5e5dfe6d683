"""At load: is this host as fast as the plan assumed for its experts on cpu?

A plan that puts experts on cpu was predicted, and its split between cpu and uva chosen, with the hardware
profile's `cpu_expert_gbps` and `cpu_expert_sync_us`, which the plan's cost section records. Applied on a host
that reads its experts much slower (fewer memory channels, another process on the cores, a profile from another
machine), the plan runs slower than it says, and perhaps slower than with those experts on uva. So once the
engine is ready, `probe` times native.cpp over one module's experts on cpu (the module with the most, up to
`EXPERTS` of them, each read once: `ceil(n / k)` tokens routed to them) and sets the time against the plan's for
the same bytes; bind.py warns (`HostSlowerWarning`) when it is more than `SLOWER` times that. An FP8 module's
bytes are its stored ones, data and scales, as the cost model counts them (planner/decide/cost.py); native.cpp
converts each FP8 row as it reads it, so where the host's cores, not its memory, set the pace, FP8 experts probe
slower per byte than the bf16 ones the plan's rate was measured on, and a warning may say so.

Limits: the probe reads with the GPU idle, where a decode step reads beside the link's UVA reads (the plan's rate
is the one beside them), so it errs towards no warning; it runs only where native.cpp computes the module (the
Python worker is slower by design, and `plan apply` says so when it runs) and where the experts probed hold at
least `MIN_BYTES` (fewer fit in the CPU's caches, and time the fixed cost only); its first call wakes the pool's
threads and is not timed; the best of `CALLS` timed calls is taken, each a few milliseconds at most.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from . import native

EXPERTS = 32  # experts read per timed call: 300 MB at Qwen3-30B-A3B's shape, 4 ms at 75 GB/s
MIN_BYTES = 32 << 20
CALLS = 3
SLOWER = 2.0  # the host's time over the plan's above which the load warns (issue 24: "differs by > 2x")


class HostSlowerWarning(RuntimeWarning):
    """The host computes its experts much slower than the plan assumed (pace.py)."""


@dataclass(frozen=True)
class Pace:
    """One probe: `nbytes` of experts read by the host in `measured_us` (the best call), where the plan's figures
    give `planned_us`."""

    nbytes: int
    measured_us: float
    planned_us: float
    gbps: float  # the plan's cpu_expert_gbps
    sync_us: float  # the plan's cpu_expert_sync_us

    @property
    def slower(self) -> float:
        return self.measured_us / self.planned_us

    def message(self) -> str:
        return (f"this host computed {self.nbytes / 1e6:.0f} MB of experts on cpu in {self.measured_us:.0f} us "
                f"({self.nbytes / self.measured_us / 1e3:.1f} GB/s), {self.slower:.1f}x the {self.planned_us:.0f} "
                f"us that the plan assumed (cpu_expert_gbps {self.gbps:g}, cpu_expert_sync_us {self.sync_us:g}): "
                "decode will be slower than the plan predicts, perhaps slower than with those experts on uva. "
                "Measure this host with `plan calibrate` and build the plan again with its profile")


def probe(engine, gbps: float, sync_us: float, *, experts: int = EXPERTS, min_bytes: int | None = None) -> Pace | None:
    """Time native.cpp over up to `experts` of the engine's module with the most experts on cpu (module doc);
    None where nothing is probed: no native module, no figures in the plan (one written before they were
    recorded), or fewer than `min_bytes` (default MIN_BYTES) to read."""
    min_bytes = MIN_BYTES if min_bytes is None else min_bytes
    if engine.native is None or gbps <= 0:
        return None
    m = max((m for m in engine.modules if m.native), key=lambda m: int(m.on_cpu.sum()))
    chosen = m.on_cpu.nonzero().flatten()[:min(experts, engine.max_tokens * m.top_k)]
    nbytes = chosen.numel() * m.expert_bytes
    if nbytes < min_bytes:
        return None
    tokens = math.ceil(chosen.numel() / m.top_k)
    ids = torch.cat([chosen, chosen[-1:].expand(tokens * m.top_k - chosen.numel())])  # each read once
    views = engine._views
    views["x"][:tokens].zero_()
    views["ids"][:ids.numel()].copy_(ids)
    job = m.job(engine.native.pool, views["x"], views["ids"], views["y"], tokens)  # not the engine's: its calls
    wake = m.job(engine.native.pool, views["x"], views["ids"], views["y"], 1, 1)  # are not counted as the model's
    native.run(engine.lib, wake)
    best = math.inf
    for _ in range(CALLS):
        start = time.perf_counter()
        native.run(engine.lib, job)
        best = min(best, time.perf_counter() - start)
    if job.error or wake.error:  # routed to an expert the module lacks: a bug here, not the host's pace
        raise RuntimeError(f"offplan: the host's probe routed a pair to expert {job.bad or wake.bad}")
    return Pace(nbytes, best * 1e6, nbytes / (gbps * 1e3) + sync_us, gbps, sync_us)
