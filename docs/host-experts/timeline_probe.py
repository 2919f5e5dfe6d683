"""Where a replayed decode step with every expert on cpu spends its time: the GPU's kernels, and the gaps between them.

In every host-bound row on record (benchmarks/results/moe-cpu-*.jsonl: every expert on cpu, or 70% of them), a
decoder layer took 272-305 us more than the host's own time per call (`host_mean_us`), where the cost model counts
the layer's kernels (moe_layer_gpu_us, about 120 us) and the hand-over (cpu_expert_sync_us, 36-80 us). This probe
profiles a few replayed steps of 8 Qwen3-30B-A3B layers with every routed expert on cpu (torch.profiler: the
kernels and copies a CUDA graph runs are traced one by one; its host nodes are not) and splits each step into the
GPU's busy time and its idle gaps: the gaps above `WAIT_US` are the layers' waits for the host, the rest of the
step is what the GPU does serially around them.

    python docs/host-experts/timeline_probe.py OUT.json    # on a GPU machine, offplan installed
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from harness.checkpoints import make_checkpoint  # noqa: E402
from harness.plans import make_plan  # noqa: E402
from runtime.hf import from_pretrained  # noqa: E402

LAYERS, STEPS, WAIT_US = 8, 16, 100.0
PROMPT = [ord(c) for c in "The capital of France is"]


def intervals(prof) -> list[tuple[float, float, str]]:
    """The GPU's activities (kernels, copies, memsets) as (start us, end us, name), by start."""
    out = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
           if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(out)


def split(spans: list[tuple[float, float, str]]) -> dict:
    """Busy time (union of the spans) and the idle gaps between them, over the whole traced call."""
    busy, gaps, end = 0.0, [], spans[0][0]
    for start, stop, _ in spans:
        if start > end:
            gaps.append(start - end)
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    waits = [g for g in gaps if g > WAIT_US]
    return dict(span_us=end - spans[0][0], busy_us=busy, gaps=len(gaps), idle_us=sum(gaps),
                waits=len(waits), wait_us=sum(waits), median_wait_us=statistics.median(waits) if waits else None,
                small_idle_us=sum(g for g in gaps if g <= WAIT_US), activities=len(spans))


def main(argv: list[str]) -> int:
    work = Path("/tmp/timeline")
    work.mkdir(parents=True, exist_ok=True)
    make_checkpoint("qwen3-30b-a3b", LAYERS, work / "ckpt", "cuda")
    plan = make_plan(work, "cpu", "format_version: 1\ncheckpoint: ckpt\nrules:\n  - {match: [experts], place: cpu}\n")
    model, handle = from_pretrained(plan, device="cuda", progress=False)
    out = {"device": torch.cuda.get_device_name(), "layers": LAYERS, "steps": STEPS}
    try:
        ids = torch.tensor([PROMPT], device="cuda")
        generate = handle.generator()
        generate.prepare(ids, STEPS + 1)
        for _ in range(2):
            generate(ids, STEPS + 1)
        host = handle.host_experts
        before = host.times().get(1, (0, 0.0))
        got = generate(ids, STEPS + 1)
        calls, seconds = (a - b for a, b in zip(host.times().get(1, (0, 0.0)), before))
        out["untraced"] = dict(step_us=1e6 * got.decode_s / got.decode_steps, host_mean_us=1e6 * seconds / calls)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            got = generate(ids, STEPS + 1)
            torch.cuda.synchronize()
        spans = intervals(prof)
        out["traced"] = dict(step_us=1e6 * got.decode_s / got.decode_steps, **split(spans))
        names: dict[str, list[float]] = {}
        for start, stop, name in spans:
            names.setdefault(name, []).append(stop - start)
        out["by_name"] = sorted(([n[:90], len(v), sum(v)] for n, v in names.items()), key=lambda r: -r[2])[:40]
    finally:
        handle.remove()
    t, u = out["traced"], out["untraced"]
    steps = STEPS + 1  # the traced call: the prefill and STEPS decode steps
    print(f"untraced: step {u['step_us']:.0f} us, host {u['host_mean_us']:.0f} us a call")
    print(f"traced: step {t['step_us']:.0f} us; GPU busy {t['busy_us'] / steps:.0f} us a step, waits over "
          f"{WAIT_US:.0f} us: {t['waits']} ({t['waits'] / steps:.1f} a step, median {t['median_wait_us']:.0f} us), "
          f"small gaps {t['small_idle_us'] / steps:.0f} us a step, {t['activities'] / steps:.0f} activities a step")
    for name, count, total in out["by_name"][:15]:
        print(f"  {total / steps:8.1f} us a step  {count / steps:6.1f}x  {name}")
    with open(argv[0], "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
