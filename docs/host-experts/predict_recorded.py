"""The cost model against the recorded experts-on-cpu rows, offline: each row's plan built again over a header-only
checkpoint of the run's shape, with the run's calibrated hardware, and predicted for graph replay.

    python docs/host-experts/predict_recorded.py [--cpu-gbps G --sync-us U] [--runs run3]   # figures to try

The rows are benchmarks/results/moe-cpu-qwen3-30b-a3b-RUN.jsonl (8 layers of Qwen3-30B-A3B, graph replay; run1
and run2 by the Inductor kernel and its Python worker, run3 by native.cpp):
the first `fraction` of every layer's experts on cpu, the rest on uva (benchmarks/harness/host_rows.py). Their
recorded `predicted_steps_per_s` came from harness/plans.py `predicted_us`, which predicts an eager step (its
CostModel is built without `graphs`), so this script predicts again, replayed. Also: the host's own time per
call (`host_mean_us`, or `host_median_us` in older runs) fitted as a fixed cost plus a rate over the touched
experts' bytes.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from planner.decide.build import build  # noqa: E402
from planner.decide.cost import CostModel  # noqa: E402
from planner.inputs.config import read_config  # noqa: E402
from planner.inputs.checkpoint import open_checkpoint  # noqa: E402
from planner.inputs.hardware import H100, Hardware, dumps_hardware  # noqa: E402
from planner.inputs.policy import load_policy  # noqa: E402
from planner.layers.graph import build_graph  # noqa: E402
from planner.layers.groups import FusedGroups  # noqa: E402
from synthetic import qwen3_moe, write_header_only  # noqa: E402

EXPERTS, TOP_K, EXPERT_BYTES = 128, 8, 3 * 768 * 2048 * 2


def rows(run: str) -> tuple[Hardware, list[dict]]:
    got = [json.loads(l) for l in (ROOT / f"benchmarks/results/moe-cpu-qwen3-30b-a3b-{run}.jsonl").open()]
    hw = next(r for r in got if r["kind"] == "hardware")
    fields = {f.name for f in dataclasses.fields(Hardware)}
    return Hardware(**{k: v for k, v in hw.items() if k in fields}), \
        [r for r in got if r["kind"] == "decode" and r.get("cpu_fraction") and r["mode"] == "graph"]


def predict(work: Path, hw: Hardware, fraction: float, batch: int) -> float:
    count = round(fraction * EXPERTS)
    numbers = "|".join(map(str, range(count)))
    (work / "hw.yaml").write_text(dumps_hardware(hw))
    policy = work / "p.policy.yaml"
    policy.write_text("format_version: 1\ncheckpoint: ./ckpt\nhardware: hw.yaml\nrules:\n"
                      f"  - {{match: ['re:experts\\.({numbers})\\.'], place: cpu}}\n"
                      "  - {match: [experts], place: uva}\n")
    plan = build(load_policy(policy), work)
    ckpt = open_checkpoint(work / "ckpt")
    graph = build_graph(list(ckpt.tensors), facts=read_config(ckpt.root))
    groups = FusedGroups.find(n for l in graph.stack_layers() for n in l.params)
    model = CostModel(graph, ckpt.tensors, hw, batch, groups, TOP_K, graphs=True)
    return 1e6 / model.predict(plan.params).step_us


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-gbps", type=float, help="cpu_expert_gbps to try (default: the built-in profile's)")
    ap.add_argument("--sync-us", type=float, help="cpu_expert_sync_us to try (default: the built-in profile's)")
    ap.add_argument("--runs", nargs="+", default=["run3"])
    args = ap.parse_args()
    gbps, sync = args.cpu_gbps or H100.cpu_expert_gbps, args.sync_us or H100.cpu_expert_sync_us
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_header_only(work / "ckpt", qwen3_moe(layers=8), shard_bytes=2**30)
        (work / "ckpt" / "config.json").write_text(json.dumps({"num_experts_per_tok": TOP_K, "num_experts": EXPERTS}))
        print(f"cpu_expert_gbps {gbps}, cpu_expert_sync_us {sync}")
        print("| run | fraction on cpu | threads | batch | measured steps/s | predicted | measured / predicted |")
        print("|---|---|---|---|---|---|---|")
        for run in args.runs:
            hw, decode = rows(run)
            hw = dataclasses.replace(hw, cpu_expert_gbps=gbps, cpu_expert_sync_us=sync)
            for r in decode:
                guess = predict(work, hw, r["cpu_fraction"], r["batch"])
                print(f"| {run} | {r['cpu_fraction']} | {r['cpu_threads']} | {r['batch']} | {r['steps_per_s']:.1f} "
                      f"| {guess:.1f} | {r['steps_per_s'] / guess:.2f} |")
            touched = np.array([EXPERTS * (1 - (1 - TOP_K / EXPERTS) ** r["batch"]) * r["cpu_fraction"]
                                for r in decode]) * EXPERT_BYTES
            host = np.array([r.get("host_mean_us", r.get("host_median_us")) for r in decode])
            fixed, per_byte = np.linalg.lstsq(np.vstack([np.ones_like(touched), touched]).T, host, rcond=None)[0]
            print(f"\n{run}: the host's time per call = {fixed:.0f} us + the touched experts' bytes at "
                  f"{1 / per_byte / 1e3:.1f} GB/s\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
