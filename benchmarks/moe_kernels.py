r"""Where a graph-replayed MoE decode step spends its GPU time, kernel by kernel, per placement.

    python benchmarks/moe_kernels.py --layers 8 --skew 0.7 --resident 0.5    # on the H100
    python benchmarks/moe_kernels.py --model tiny --layers 2 --out /tmp/k     # smoke test, any CUDA GPU

The same run as benchmarks/moe.py (its checkpoint, prompts, RouterSkew and
plans): all on the GPU (transformers' `batched_mm`), every expert in pinned
memory (offplan's experts implementation), and, with `--resident`, the
per-expert budget plan that keeps that fraction of the expert bytes resident
(the routing profile recorded on other prompts, as moe.py does). For each, a
batch-1 decode step with a static cache is captured in a CUDA graph, replayed
`--steps` times to time it (CUDA events), then replayed under `torch.profiler`:
every kernel's GPU time, summed by kernel name and divided by the steps. The
step's time less the kernels' sum is time the GPU ran no kernel (gaps between
the graph's kernels). With `--compiled`, the gpu and experts-host placements
are measured again with the model under `torch.compile` (Inductor's fused
kernels), captured the same way.

Records go to OUT/moe-kernels-MODEL.jsonl: one per placement (step time, kernel
sum, link bytes per step) and one per kernel name (count and GPU µs per step).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

import moe
from harness.budgets import record_profile
from harness.loops import PROMPT_LEN
from harness.routers import touched_experts


def parse_args(argv=None) -> argparse.Namespace:
    ap = moe.model_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                                     formatter_class=argparse.RawDescriptionHelpFormatter))
    ap.add_argument("--skew", type=float, help="RouterSkew strength, as moe.py")
    ap.add_argument("--resident", type=float, nargs="*", default=[], help="per-expert budget fractions (--skew)")
    ap.add_argument("--steps", type=int, default=50, help="replays timed, and profiled")
    ap.add_argument("--compiled", action="store_true", help="also under torch.compile")
    ap.add_argument("--top", type=int, default=12, help="kernel names printed per placement")
    return ap.parse_args(argv)


def kernel_us(prof, steps: int) -> dict[str, tuple[int, float]]:
    """Kernel name -> (launches per step, GPU µs per step), from a profile of `steps` replays."""
    out: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            out[e.name][0] += 1
            out[e.name][1] += e.device_time_total
    return {k: (round(n / steps), us / steps) for k, (n, us) in out.items()}


def profile_step(run, plan: Path, implementation: str | None, compiled: bool, steps: int):
    """(step µs, kernel name -> (launches, µs) per step, bytes read from pinned memory per step) of a
    graph-replayed batch-1 decode step."""
    from transformers import StaticCache
    model, handle = run.load(plan, implementation)
    try:
        host_bytes = touched_experts(model, run.ids, 1, 16)[1]
        prompt = run.ids[:1]
        # every call writes the cache one position on (replays included): room for all of them
        cache = StaticCache(config=model.config, max_cache_len=PROMPT_LEN + 2 * steps + 16)
        ids = torch.zeros(1, 1, dtype=torch.long, device="cuda")
        pos = torch.tensor([PROMPT_LEN], device="cuda")
        step = torch.compile(model) if compiled else model

        def prefill():
            cache.reset()
            model(prompt, past_key_values=cache, cache_position=torch.arange(PROMPT_LEN, device="cuda"))
            handle.join()
        with torch.no_grad():
            prefill()
            graph, _ = handle.capture(lambda: step(ids, past_key_values=cache, cache_position=pos).logits,
                                      warmup=3)
            prefill()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                graph.replay()
            end.record()
            end.synchronize()
            step_us = start.elapsed_time(end) * 1e3 / steps
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    graph.replay()
                torch.cuda.synchronize()
        return step_us, kernel_us(prof, steps), host_bytes
    finally:
        handle.remove(restore=False)
        del model, handle


def main(argv=None) -> int:
    args = parse_args(argv)
    moe_args = ["--model", args.model, "--dir", str(args.dir), "--out", str(args.out), "--batches", "1",
                "--profile-prompts", "32"]
    moe_args += ["--layers", str(args.layers)] if args.layers else []
    moe_args += ["--skew", str(args.skew)] if args.skew is not None else []
    from planner.inputs.hardware import H100, dumps_hardware
    args.out.mkdir(parents=True, exist_ok=True)
    hw = args.out / "moe-kernels-hw.yaml"  # the built-in H100 figures: the profile needs no calibration
    hw.write_text(dumps_hardware(H100))
    moe_args += ["--hardware", str(hw)]
    run = moe.Run(moe.parse_args(moe_args))
    # CUPTI starts with the first profile; started after a graph's capture, it breaks that graph's replays
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]):
        torch.zeros(1, device="cuda").add_(1)
    log = args.out / f"moe-kernels-{args.model}.jsonl"
    log.write_text("")

    def record(**r):
        with log.open("a") as f:
            f.write(json.dumps(r) + "\n")

    gpu = run.plan("gpu", "")
    cases = [("gpu-batched_mm", gpu, "batched_mm", False), ("experts-host-offplan", run.plan("experts-host",
             moe.EXPERTS_HOST), None, False)]
    if args.resident:
        from harness.plans import experts_working_bytes
        from planner.planfile import load_plan
        profile = record_profile(run, gpu)
        layer_experts = run.experts * run.expert_bytes
        dense = run.info.total_bytes - run.layers * layer_experts
        workload = f"workload: {{batch_size: 1, routing: {profile.name}, cuda_graphs: true}}\n"
        working = experts_working_bytes(run.work, "format_version: 1\ncheckpoint: ckpt\nhardware: hw.yaml\n",
                                        workload)  # the budget counts it (planner/decide/working.py)
        for f in args.resident:
            budget = (dense + f * run.layers * layer_experts + working) / 2**30
            plan = run.plan(f"budget-per-expert-{f:g}", f"backend: mixed\nbudget_gib: {budget!r}\n{workload}")
            load_plan(plan)
            cases.append((f"budget-per-expert-{f:g}", plan, None, False))
    if args.compiled:
        cases += [(name + "-compiled", plan, impl, True) for name, plan, impl, _ in cases[:2]]
    for name, plan, impl, compiled in cases:
        step_us, kernels, host = profile_step(run, plan, impl, compiled, args.steps)
        total = sum(us for _, us in kernels.values())
        link_us = host / (run.hw.uva_read_gbps * 1e3)
        record(kind="step", name=name, step_us=step_us, kernel_us=total, gap_us=step_us - total,
               kernels=sum(n for n, _ in kernels.values()), host_bytes_per_step=host, link_floor_us=link_us)
        print(f"\n{name}: step {step_us:.0f} us, kernels {total:.0f} us "
              f"({sum(n for n, _ in kernels.values())} launches), gaps {step_us - total:.0f} us; "
              f"pinned-memory reads {host / 1e6:.1f} MB/step = {link_us:.0f} us at the UVA rate")
        for k, (n, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:args.top]:
            record(kind="kernel", name=name, kernel=k, launches=n, us=us)
            print(f"  {us:8.1f} us  {n:4d}x  {k[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
