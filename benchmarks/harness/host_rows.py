"""moe.py's rows with experts on cpu (runtime/execute/host/): the plans, and the host's figures over a timed decode.

With `--cpu-fractions F...`, for each F the first F of every layer's experts (by number: under uniform routing,
that share of the touched ones) are computed by the host CPU, the rest read over uva, with `--cpu-threads` host
threads each (the plan's `cpu_threads`); F = 1 puts every expert on cpu. With `--cpu-split`, the plan's own split
instead: `backend: mixed` with `cpu_experts: true` under the all-uva plan's GPU footprint, one plan per batch (its
workload, replayed), each measured at its batch. They decode in each of the run's modes (under torch.compile the
hand-over's custom ops stay opaque to Inductor). Each row carries the plan's prediction (for a replayed step) and
its ratio to the UVA floor,
the host's median time per module forward of a decode step, and the tokens are compared with the
all-GPU model's as moe.py's other rows (the host sums each GEMV in another order: a near tie between two tokens
can break the other way).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from planner.inputs.hardware import dumps_hardware, load_hardware
from planner.planfile import load_plan

from .plans import predicted_us

UVA_REST = "  - {match: [experts], place: uva}\n"


def cpu_rules(count: int, experts: int) -> str:
    """Rules putting experts 0 .. count-1 of every layer on cpu and the rest on uva."""
    if count >= experts:
        return "rules:\n  - {match: [experts], place: cpu}\n"
    numbers = "|".join(map(str, range(count)))
    return f"rules:\n  - {{match: ['re:experts\\.({numbers})\\.'], place: cpu}}\n" + UVA_REST


def measure_cpu(run, fraction: float, threads: int | None) -> None:
    """The first `fraction` of every layer's experts on cpu, on the host's `threads` (None: the profile's), the
    rest on uva: measured by `run` (moe.py's Run) in its graph and eager modes, with the plan's predictions."""
    hardware = profile(run, threads)
    name = f"experts-cpu{fraction:g}" + ("" if threads is None else f"-t{threads}")
    plan = run.plan(name, cpu_rules(round(fraction * run.experts), run.experts), hardware)
    hw = load_hardware(run.work / hardware)
    predicted = {b: 1e6 / predicted_us(plan, hw, b, graphs=True) for b in run.args.batches}
    run.measure(name, plan, None, run.args.modes, offloaded=True, predicted=predicted, cpu_fraction=fraction,
                cpu_threads=hw.cpu_threads)
    if run.args.lookahead_ab and fraction < 1 and 1 in run.args.batches:  # its uva share read without a guess
        run.measure(f"{name}-no-lookahead", plan, None, run.args.modes, offloaded=True, lookahead=False, batches=[1],
                    predicted=predicted, cpu_fraction=fraction, cpu_threads=hw.cpu_threads)


def measure_split(run, host: Path, threads: int | None) -> None:
    """The plan's own split at each batch (module doc), on the host's `threads` (None: the profile's), beside
    `host`, the all-uva plan whose GPU footprint is the budget: the share of the experts' bytes off the GPU that
    the plan put on cpu goes into the rows (`cpu_fraction`)."""
    budget = load_plan(host).summary.gpu_footprint_bytes / 2**30
    hardware = profile(run, threads)
    for b in run.args.batches:
        name = f"experts-split-b{b}"
        path = run.plan(name, f"backend: mixed\ncpu_experts: true\nbudget_gib: {budget!r}\n"
                              f"workload: {{batch_size: {b}, cuda_graphs: true}}\n", hardware)
        plan = load_plan(path)
        s = plan.summary
        run.measure(name, path, None, run.args.modes, offloaded=True, batches=[b],
                    predicted={b: 1e6 / s.predicted_step_us}, split_by_plan=True, gpu_bytes=s.gpu_bytes,
                    cpu_fraction=s.cpu_bytes / max(1, s.cpu_bytes + s.uva_bytes + s.prefetch_bytes),
                    cpu_threads=plan.cost.cpu_threads if s.cpu_bytes else None)


def profile(run, threads: int | None) -> str:
    """The run's hardware profile (None), or one for `threads` host threads: its file name. On CUDA the host's
    figures are measured again with those threads (runtime/measure/host.py `host_figures`, rounds back to back,
    recorded as a `host-calibration` row), so that each thread count's rows are predicted from its own rates (a host's
    rate is not proportional to its threads); once per run and thread count. Without CUDA, or where the kernel is not
    built, a copy with `cpu_threads: threads` and the run's rates, which `plan build` warns of."""
    if threads is None:
        return "hw.yaml"
    name = f"hw-t{threads}.yaml"
    if threads not in run.host_profiles:
        host = None
        if run.cuda:
            from runtime.measure.host import host_figures
            host = host_figures(threads)
        if host is None:
            hw = dataclasses.replace(run.hw, cpu_threads=threads)
        else:
            hw = dataclasses.replace(run.hw, **host.profile_fields())
            run.record(kind="host-calibration", **host.profile_fields(), fixed_us=round(host.fixed_us, 1),
                       handover_us=round(host.handover_us, 1), r2=round(host.r2, 4), isa=host.isa,
                       rounds=host.rounds, slowdown=round(host.slowdown, 2))
        (run.work / name).write_text(dumps_hardware(hw))
        run.host_profiles[threads] = name
    return run.host_profiles[threads]


class HostTiming:
    """The host's figures over one timed decode of a plan with experts on cpu: `mark()` where timing starts
    (replayed: once the step is captured and warmed up; eager: before the whole call), `figures(batch)` after:
    over the decode steps' forwards only (those of `batch` tokens), not the timed call's prefill."""

    def __init__(self, handle):
        self.host = getattr(handle, "host_experts", None)
        self.start = None

    def mark(self) -> None:
        self.start = self.host.times()

    def figures(self, batch: int) -> dict:
        """The mean time of the host's work per module forward of a decode step (in the thread that runs it:
        native.cpp's caller, or the worker), how many there were, and who computed them."""
        if self.start is None:
            return {}
        calls, seconds = self.host.times().get(batch, (0, 0.0))
        before = self.start.get(batch, (0, 0.0))
        calls, seconds = calls - before[0], seconds - before[1]
        engine = self.host
        return dict(host_mean_us=1e6 * seconds / calls if calls else None, host_decode_calls=calls,
                    host_kernel="native " + engine.native.pool.isa() if engine.native is not None
                    else "compiled" if engine.kernel.compiled else "eager", kernel_misses=engine.kernel.misses)
