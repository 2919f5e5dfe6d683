"""Turn benchmarks/results/*.jsonl into benchmarks/RESULTS.md and benchmarks/decode.png.

    python benchmarks/report.py            # needs matplotlib for the plot

Each section is a module of benchmarks/reporting/. The dense section recomputes
its ratios from the raw records (reporting/dense.py says how); the MoE, prefill
and quantized sections take theirs from the records, each against the floor and
the fastest all-GPU path of the same run. The planning-speed section is
the one measured on a CPU machine: planning needs no GPU.
"""
from __future__ import annotations

import argparse
import sys

from planner.files import write_atomic
from reporting.dense import align_table, load, model_tables, plot
from reporting.front_door import front_door_tables
from reporting.memory import memory_tables
from reporting.host_experts import host_experts_tables
from reporting.moe import moe_tables
from reporting.parallel import parallel_tables
from reporting.peers import peers_tables
from reporting.plan_speed import plan_speed_tables
from reporting.prefill import prefill_tables, staging_ab
from reporting.quantized import quantized_tables
from reporting.records import HERE


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description="write benchmarks/RESULTS.md (and decode.png, with matplotlib) from "
                            "benchmarks/results/*.jsonl").parse_args(argv)
    models = load()
    plotted = plot(models, HERE / "decode.png")
    write_atomic(HERE / "RESULTS.md", render(models, plotted or (HERE / "decode.png").is_file()), "results")
    print(f"wrote {HERE / 'RESULTS.md'}")
    return 0


def render(models: dict, with_plot: bool) -> str:
    """RESULTS.md from the records (`models`: reporting.dense `load()`); `with_plot`: link decode.png (kept when
    matplotlib is missing and an earlier run drew it)."""
    lines = ["# Decode benchmark results", "",
             "Produced by `benchmarks/decode.py` and `benchmarks/moe.py` on the project's H100 (PCIe Gen5) machine "
             "and summarised by "
             "`python benchmarks/report.py` from the raw records in `benchmarks/results/`. Commands:", "",
             "```sh",
             "python docs/uva-align/uva_align.py",
             "python benchmarks/decode.py --model llama-8b --fractions 0.5 --batches 1 8 --accelerate-batches 1 8 "
             "--strategies accelerate uva uva-64b prefetch mixed",
             "python benchmarks/moe.py --layers 8",
             "python benchmarks/moe.py --layers 8 --batches 1 --modes graph compiled-graph --baselines batched_mm "
             "grouped_mm --host-implementations offplan --lookahead-ab   # then: mv results/moe-qwen3-30b-a3b.jsonl "
             "results/moe-qwen3-30b-a3b-b1.jsonl",
             "for m in graph compiled-graph; do python benchmarks/moe.py --batches 1 --modes $m --baselines "
             "batched_mm grouped_mm --host-implementations offplan --lookahead-ab; mv results/moe-qwen3-30b-a3b.jsonl "
             "results/moe-qwen3-30b-a3b-b1-48layers-$m.jsonl; done   # all 48 layers: 61 GB of disk",
             "python benchmarks/moe.py --batches 8 32 --modes graph --baselines grouped_mm --transformers-baselines "
             "grouped_mm --host-implementations offplan   # then: mv results/moe-qwen3-30b-a3b.jsonl "
             "results/moe-qwen3-30b-a3b-b8-b32-48layers.jsonl",
             "python benchmarks/moe_kernels.py --layers 8 --skew 0.7 --resident 0.25 0.5 --compiled",
             "python benchmarks/moe_predict.py --layers 8; python benchmarks/moe_predict.py --layers 8 --skew 0.7",
             "python benchmarks/moe.py --layers 8 --modes graph --baselines batched_mm grouped_mm "
             "--transformers-baselines --host-implementations offplan --skew 0.7 --resident 0.25 0.5 "
             "--budget-batches 1 8",
             "python benchmarks/moe.py --layers 8 --modes graph --baselines batched_mm grouped_mm "
             "--transformers-baselines --host-implementations offplan --skew 0.7 --spread 2 --resident 0.25 0.5 "
             "--budget-batches 1 8   # and with --skew 1.6",
             "python benchmarks/decode.py --model llama-8b --strategies prefetch --modes graph",
             "python benchmarks/decode.py --model llama-8b --strategies prefetch --fractions 0.5 --modes compiled",
             "python benchmarks/prefill.py --model llama-8b",
             "python benchmarks/prefill.py --model qwen3-30b-a3b --layers 8",
             "python benchmarks/prefill.py --model qwen3-30b-a3b --layers 8 --spread 2",
             "python benchmarks/quantized.py --layers 8",
             "python benchmarks/front_door.py --layers 8 --strategies gpu experts-uva experts-uva-fp8 --label a   # "
             "a and b: two H200s, before the one-launch route and gather",
             "python benchmarks/front_door.py --layers 8 --strategies gpu prefetch mixed uva --label b",
             "python benchmarks/front_door.py --layers 8 --strategies gpu experts-uva experts-uva-fp8 mixed --label c"
             "   # an H100, with them",
             "python benchmarks/front_door.py --layers 8 --strategies gpu experts-uva experts-uva-fp8 mixed --label d"
             "   # an H100, the budget counting working memory, generate timed as the median of 3 calls",
             "python benchmarks/front_door.py --layers 8 --strategies experts-uva experts-split --batches 1 8 "
             "--label split   # an H100: the plan's split of the experts between the host's cores and the link",
             "python benchmarks/front_door.py --layers 8 --strategies uva mixed experts-uva-fp8 --batches 1 8 --label g"
             "   # an H200, eight distinct prompts, the loop's and generate's calls alternating",
             "python benchmarks/front_door.py --layers 8 --strategies experts-uva experts-split --batches 1 8 "
             "--label h200-guess   # an H200, the lookahead's guess without cuBLAS (its 32 MiB workspace)",
             "python benchmarks/front_door.py --layers 8 --strategies experts-split --batches 1 8 --apply-calls 3 "
             "--label h200-split-again   # another H200 lease: is h200-guess's split apply at batch 8 (0.86x) noise?",
             "python benchmarks/front_door.py --layers 8 --strategies experts-uva experts-split --batches 1 "
             "--no-pair-eager --label h200-cli   # an H200, plan apply after this session's CLI changes (running.py)",
             "python benchmarks/front_door.py --layers 8 --strategies experts-split --batches 1 --apply-calls 3 "
             "--no-pair-eager --label h200-split-apply   # an H200, main at 9f09c49: is h200-split-again's apply at "
             "batch 1 (0.85x the loop) noise?",
             "python benchmarks/front_door.py --layers 8 --strategies experts-uva experts-split --batches 1 "
             "--label h200-eager2   # an H200, an eager step calling the host engine directly (experts.py)",
             "python benchmarks/front_door.py --layers 8 --strategies gpu gpu-fp8 experts-uva --batches 1 8 "
             "--apply-calls 1 --label h200-h   # an H200, main at cea293b (after branch gpu-mxfp4-gemv landed)",
             "python benchmarks/moe.py --batches 1 4 8 --modes graph --baselines --transformers-baselines "
             "--host-implementations offplan --cpu-split --new-tokens 24   # all 48 layers; then: mv "
             "results/moe-qwen3-30b-a3b.jsonl results/moe-cpu-qwen3-30b-a3b-48layers-split.jsonl; with "
             "--host-implementations --cpu-fractions 1 in place of the last two: -48layers-all",
             "python benchmarks/moe.py --batches 1 4 8 --modes graph --baselines --transformers-baselines "
             "--host-implementations offplan --cpu-split --new-tokens 24   # all 48 layers, the lookahead over split "
             "layers and the cost model's later side: -48layers-split-fresh (an H100, right after writing the "
             "checkpoint), -48layers-split-h200 (an H200 machine, the checkpoint written, synced and the page cache "
             "dropped first)",
             "python benchmarks/moe.py --batches 1 --modes graph compiled-graph --baselines --transformers-baselines "
             "--host-implementations offplan --cpu-split --new-tokens 24   # all 48 layers, on an H200, each step "
             "replayed and compiled-then-replayed: -48layers-split-compiled-h200; with --modes compiled-graph alone, "
             "on an H100, the checkpoint written, synced and the page cache dropped first: "
             "-48layers-split-compiled-h100",
             "python benchmarks/moe.py --batches 1 --modes graph compiled-graph --baselines --transformers-baselines "
             "--host-implementations offplan --cpu-split --new-tokens 24   # all 48 layers, an H200, main at f18e95a: "
             "-48layers-split-compiled-h200-r2; then on the same machine, its checkpoint kept, --modes compiled-graph "
             "--host-implementations --cpu-fractions 1.0 in place of theirs: -48layers-all-compiled-h200",
             "python benchmarks/moe.py --batches 1 4 8 --modes graph --baselines --transformers-baselines "
             "--host-implementations --cpu-fractions 0.5 0.7 1 --lookahead-ab --new-tokens 24   # all 48 layers: "
             "-48layers-lookahead (an H100); with --cpu-fractions 0.7 1: -48layers-lookahead-h200",
             "python benchmarks/moe.py --layers 8 --batches 1 8 --modes graph compiled-graph --baselines batched_mm "
             "--transformers-baselines --host-implementations offplan --cpu-split --cpu-fractions 1   # then: mv "
             "results/moe-qwen3-30b-a3b.jsonl results/moe-cpu-qwen3-30b-a3b-run4.jsonl (stopped by the machine's "
             "time limit before its --cpu-split rows)",
             "python benchmarks/moe.py --layers 8 --batches 1 8 --modes graph --baselines batched_mm "
             "--transformers-baselines --host-implementations offplan --skew 0.7 --resident 0.25 --budget-batches 1 8 "
             "--new-tokens 24   # then: mv results/moe-qwen3-30b-a3b-skew0.7.jsonl "
             "results/moe-qwen3-30b-a3b-skew0.7-cpu.jsonl",
             "python benchmarks/prefill.py --model qwen3-30b-a3b --layers 8 --spread 2 --strategies experts-host "
             "experts-cpu --tokens 2048 8192 --new-tokens 16   # then: mv results/prefill-qwen3-30b-a3b-spread2.jsonl "
             "results/prefill-qwen3-30b-a3b-spread2-cpu.jsonl",
             "python benchmarks/prefill.py --model qwen3-30b-a3b --layers 8 --spread 2 --strategies experts-host "
             "experts-cpu --tokens 2048 8192 --new-tokens 16   # on an H200, main at 9f09c49 (the H100 row above at "
             "8192: 1.16x); then: mv results/prefill-qwen3-30b-a3b-spread2.jsonl "
             "results/prefill-qwen3-30b-a3b-spread2-cpu-h200.jsonl",
             "python benchmarks/prefill.py --model qwen3-30b-a3b --layers 8 --spread 2 --strategies experts-host "
             "--hardware H200.yaml   # on an H200, at 98ebed3 (its all-GPU experts without grouped_mm's masks, "
             "as main's since 4822f74: docs/moe-prefill/), with a profile `plan calibrate` wrote there "
             "earlier; then: mv results/prefill-qwen3-30b-a3b-spread2.jsonl "
             "results/prefill-qwen3-30b-a3b-spread2-h200.jsonl",
             "python benchmarks/prefill.py --model llama-8b --strategies prefetch uva mixed --new-tokens 4   # an "
             "H200 on 2026-11-27, the prefill's timeline in the planner; then: mv results/prefill-llama-8b.jsonl "
             "results/prefill-llama-8b-h200.jsonl",
             "python benchmarks/prefill.py --model qwen3-30b-a3b --layers 8 --spread 2 --strategies prefetch uva "
             "experts-host experts-cpu --new-tokens 16   # an H200 on 2026-11-27, a fresh calibration; then: mv "
             "results/prefill-qwen3-30b-a3b-spread2.jsonl results/prefill-qwen3-30b-a3b-spread2-h200-b.jsonl, its "
             "experts-cpu rows left out (that machine had not built the host kernel)",
             "python docs/moe-prefill/probe.py --out docs/moe-prefill   # on an H200: where an all-GPU MoE prefill "
             "spends its time, transformers' grouped_mm against its arithmetic without the masks",
             "python benchmarks/memory.py --model qwen3-30b-a3b --layers 8",
             "python benchmarks/memory.py --model llama-8b --layers 8 --strategies gpu uva prefetch mixed",
             "python benchmarks/memory.py --model llama-8b --layers 8 --strategies gpu uva --label logits   # on an "
             "H200, since the runtime's prefill asks for the last position's logits only",
             "python benchmarks/memory.py --model qwen3-30b-a3b --layers 8 --gpus 2 --label 2gpu-h200 --strategies gpu "
             "uva prefetch mixed experts-uva experts-split experts-uva-fp8   # two H200s",
             "python benchmarks/parallel.py --model qwen3-30b-a3b --layers 8 --gpus 1 2 --batches 1 8   # then: mv "
             "results/parallel-qwen3-30b-a3b-8layers.jsonl results/parallel-qwen3-30b-a3b-4xh200-run1.jsonl; with "
             "--gpus 1 4: -run2; on two H200s: -2xh200; again on two H200s on 2026-11-27, each process with its share of the "
             "host's cores: -2xh200-run2; with --gpus 1 2 4 on four H200s on 2026-11-27, so: -4xh200-run3",
             "python benchmarks/parallel.py --model qwen3-30b-a3b --layers 8 --fp8 --gpus 1 2 --batches 1 8   # then: "
             "mv results/parallel-qwen3-30b-a3b-8layers-fp8.jsonl results/parallel-qwen3-30b-a3b-fp8-2xh200.jsonl",
             "python benchmarks/parallel.py --model llama-8b --gpus 1 2   # then: mv results/parallel-llama-8b.jsonl "
             "results/parallel-llama-8b-2xh200.jsonl",
             "python benchmarks/parallel.py --model qwen3-30b-a3b --layers 8 --gpus 1 2 --batches 1 8 "
             "--cpu-shares 0 0.3 0.5   # on two H200s of a 32-core host; then: mv "
             "results/parallel-qwen3-30b-a3b-8layers-cpu.jsonl results/parallel-qwen3-30b-a3b-8layers-cpu-2xh200.jsonl",
             "PYTHONPATH=CHECKOUT_OF_MAIN python benchmarks/plan_speed.py --profile -n 3 --label before "
             "--note 'main at COMMIT'   # on a CPU machine, as the next",
             "python benchmarks/plan_speed.py --profile --label after --note 'this tree'",
             "benchmarks/peers/stage.sh   # here; then on the GPU machine, carrying .peers: bash "
             "benchmarks/peers/build.sh; python benchmarks/peers.py --layers 8 --llama-cpp build/llama.cpp/bin",
             "python benchmarks/peers.py --layers 8 --build   # an H200 machine, the lookahead over split layers, the "
             "cost model's later side and equal-memory plans with cpu_experts: peers-qwen3-30b-a3b-h200-split",
             "python benchmarks/moe.py --layers 8 --batches 1 4 8 --modes graph --baselines batched_mm "
             "--transformers-baselines --host-implementations offplan --cpu-fractions 0.3 0.5 --cpu-threads 8 15   "
             "# then: mv results/moe-qwen3-30b-a3b.jsonl results/moe-cpu-qwen3-30b-a3b-run1.jsonl; run2: --batches 1 "
             "4 --cpu-threads 8, on another machine",
             "python benchmarks/moe.py --layers 8 --batches 1 4 8 --modes graph --baselines --transformers-baselines "
             "--host-implementations offplan --cpu-fractions 0.3 0.5 --cpu-threads 8 15 --cpu-split   # an H200, "
             "main at b11c0ad (the native host kernel, a calibrated profile): moe-cpu-qwen3-30b-a3b-run5-h200",
             "python benchmarks/moe.py --layers 8 --batches 1 4 8 --modes graph --baselines --transformers-baselines "
             "--host-implementations offplan --cpu-fractions 0.3 0.5 0.7 --cpu-threads 8 15 --cpu-split   # an H200, "
             "branch host-threads at 2218318, since landed (the host's figures measured at each --cpu-threads in the "
             "run, the split at 8 threads; docs/host-experts/): moe-cpu-qwen3-30b-a3b-run6-h200",
             "python benchmarks/report.py",
             "```", "",
             "Random bf16 weights in the real shapes. Dense tables: HF transformers eager decode (`generate`, "
             "greedy, 16-token prompts, 32 new tokens after a warm-up; prefill excluded); limit = 1 / max(offloaded "
             "bytes / H2D floor measured in the same run, best all-GPU step). "
             "A mixed plan may beat the limit computed from its offloaded bytes: UVA moves only the bytes a step "
             "touches (embedding rows, routed experts).", ""]
    lines += align_table()
    for name, m in sorted(models.items()):
        lines += model_tables(name, m)
    lines += moe_tables()
    lines += host_experts_tables()
    lines += prefill_tables()
    lines += staging_ab()
    lines += quantized_tables()
    lines += front_door_tables()
    lines += memory_tables()
    lines += parallel_tables()
    lines += peers_tables()
    lines += plan_speed_tables()
    if with_plot:
        lines += ["![decode tokens/s against the offloaded fraction](decode.png)", ""]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
