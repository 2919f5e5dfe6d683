"""Several GPUs of one host, each reading its share of the offloaded weights over its own link (tensor
parallelism), against one GPU and against the floor of the links, all in one run.

    python benchmarks/parallel.py --model llama-8b --gpus 1 2             # 50% of the layers streamed (prefetch)
    python benchmarks/parallel.py --model qwen3-30b-a3b --layers 8 --gpus 1 2 --batches 1 8   # experts on uva
    python benchmarks/parallel.py --model tiny --layers 2 --gpus 1 2 --out /tmp/r            # smoke test
    python benchmarks/parallel.py --model tiny --layers 2 --device cpu --out /tmp/r          # on the CPU (gloo, eager, no floor)
    python benchmarks/parallel.py --model qwen3-30b-a3b --layers 8 --fp8 --batches 1 8     # block-scaled FP8
    python benchmarks/parallel.py --model qwen3-30b-a3b --layers 8 --cpu-shares 0 0.4 --batches 1 8  # host cores too
    python benchmarks/parallel.py --model tiny --layers 2 --device cpu --fp8 --fp8-block 16 --out /tmp/r

One checkpoint (harness/checkpoints.py: random bf16 in the model's shapes; with `--fp8`, written again as
block-scaled FP8 in square blocks of `--fp8-block`, 128 by default as published, by tests/quantized_models.py,
and every plan is of that); per GPU count N, one plan: the same
policy with `gpus: N` (N = 1: no parallel section), every figure in it one GPU's share:
- llama-8b: `prefetch: {group_size: 2, num_in_group: 1, step: 2}` (every other layer streamed through 2 slots);
- qwen3-30b-a3b: every routed expert on uva (`rules: [{match: [experts], place: uva}]`);
  with `--cpu-shares F ...`, per share F the first round(F x experts) experts of each layer on cpu instead (the
  host computes them: each process its share of them, with its share of the host's cores, as the plan says:
  planner/inputs/hardware.py `one_of`), from a profile naming every core but one (`cpu_threads`), so that one
  GPU's process and N processes together run as many host threads. Share 0 is the all-uva plan.
Each N runs in N processes (runtime/distributed/launch.py, NCCL), started afresh. Each process first measures its own link
while every process does the same (a barrier between): H2D copies of 1 GiB from pinned memory and UVA GEMVs
over the runtime's arena (runtime/measure/bandwidth.py), so N = 1 measures a link alone and N = 2 both links at
once. Then it loads its share of the plan and decodes: greedy, the runtime's generation with each decode step
replayed from a CUDA graph (what `plan apply` runs), `--new-tokens` steps per batch after a captured warm-up.

The floor, per process (every process reads alike, at once): llama, the bytes it streams per step (its plan's
prefetched bytes) over its H2D rate; qwen3, the bytes of the touched experts' rows that it reads from pinned memory
per decode step (FP8: its bytes and its scales'), counted by an untimed greedy `generate` over the same prompts
(harness/routers.py `touched_experts`: its share of each expert), over its UVA rate. x floor = steps/s over 1 /
floor time, with the slowest process's rate (with experts on cpu the floor is still the all-uva plan's: above 1x
the host's cores add to the links). Speed-up = steps/s over the one-GPU run's. Tokens: each N's against
the one-GPU run's (tensor parallelism sums in another order: test_parallel.py states the tolerance), the steps that
agree before the first difference. Memory: each process's peak during its load against its share's footprint, and
its peak during decode above what the load left (activations, KV cache, graphs: not in the plan). Records go to
OUT/parallel-MODEL.jsonl (`-cpu` appended with --cpu-shares).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from harness.checkpoints import make_checkpoint
from harness.loops import decode_static, prompts
from harness.plans import make_plan
from harness.routers import touched_experts
from planner.inputs.config import read_config
from planner.inputs.hardware import H100, dumps_hardware
from planner.planfile import load_plan
from runtime.distributed.launch import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from quantized_models import write_fp8  # noqa: E402  (the published FP8 layout's writer)

POLICY = {"llama-8b": "prefetch: {group_size: 2, num_in_group: 1, step: 2}\n",
          "qwen3-30b-a3b": "rules:\n  - {match: [experts], place: uva}\n",
          "tiny": "rules:\n  - {match: [experts], place: uva}\n"}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(POLICY))
    ap.add_argument("--layers", type=int, help="decoder layers (default: the real count)")
    ap.add_argument("--gpus", type=int, nargs="+", default=[1, 2], help="GPU counts to run (default: 1 2)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1])
    ap.add_argument("--new-tokens", type=int, default=32, help="decode steps timed (default: 32)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/offplan-bench"), help="where checkpoints go")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--fp8", action="store_true", help="plan the checkpoint written as block-scaled FP8")
    ap.add_argument("--fp8-block", type=int, default=128,
                    help="rows and columns per FP8 scale (default: 128, the published models'; the tiny model's "
                         "shares need 16)")
    ap.add_argument("--cpu-shares", type=float, nargs="+", default=[0.0],
                    help="MoE: per share, that fraction of each layer's experts on cpu, the rest on uva (default: 0)")
    return ap.parse_args(argv)


def measure(rank: int, plan: str, moe: bool, batches: list[int], new: int, device: str) -> dict:
    """One process: its link's rates while every process measures its own, then its share's decode."""
    import torch.distributed as dist
    from runtime.hf import from_pretrained
    from runtime.measure.bandwidth import h2d_copy_gbps, uva_gbps, warm_up
    cuda = device == "cuda"
    if cuda:
        warm_up(1.0)
    dist.barrier()
    h2d = h2d_copy_gbps() if cuda else None
    dist.barrier()
    uva = uva_gbps() if cuda else None
    dist.barrier()
    model, handle = from_pretrained(plan, device=device, progress=False)
    out = {"rank": rank, "h2d_copy_gbps": h2d, "uva_read_gbps": uva,
           "load_peak_bytes": handle.stats().peak_gpu_bytes_during_load, "load_seconds": handle.stats().load_seconds,
           "rows": []}
    try:
        ids = prompts(model.config.vocab_size, device)
        for b in batches:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if cuda else 0
            rate, tokens = decode_static(model, handle, ids, new, "graph" if cuda else "eager", batch=b)
            peak = torch.cuda.max_memory_allocated() - base if cuda else 0
            host = touched_experts(model, ids, b, new)[1] if moe else None
            out["rows"].append({"batch": b, "steps_per_s": rate, "tokens": tokens, "decode_peak_bytes": peak,
                                "host_bytes_per_step": host})
    finally:
        handle.remove(restore=False)
    return out


def experts_on_cpu(share: float, experts: int) -> str:
    """The policy's rules for `share` of each layer's experts on cpu (the first ones by number), the rest on uva."""
    first = round(share * experts)
    if first == 0:
        return POLICY["qwen3-30b-a3b"]
    numbers = "|".join(str(i) for i in range(first))
    return (f"hardware: hw.yaml\nrules:\n  - {{match: ['re:\\.experts\\.(?:{numbers})\\.'], place: cpu}}\n"
            "  - {match: [experts], place: uva}\n")


def agree(a: list[list[int]], b: list[list[int]]) -> int:
    """Decode steps equal in every sequence before the first that differs."""
    n = 0
    for step in zip(*(zip(x, y) for x, y in zip(a, b))):
        if any(p != q for p, q in step):
            break
        n += 1
    return n


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.dir / f"parallel-{args.model}-{args.layers or 'all'}"
    work.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    cuda = args.device == "cuda"
    make_checkpoint(args.model, args.layers, work / "ckpt", args.device)
    if args.fp8:
        write_fp8(work / "ckpt", work / "fp8", device=args.device, block=args.fp8_block)
    out = args.out / (f"parallel-{args.model}{f'-{args.layers}layers' if args.layers else ''}{'-fp8' * args.fp8}"
                      f"{'-cpu' * any(args.cpu_shares)}.jsonl")
    (work / "hw.yaml").write_text(dumps_hardware(dataclasses.replace(H100, cpu_threads=max(1, os.cpu_count() - 1))))
    records = [{"kind": "run", "model": args.model, "layers": args.layers, "fp8": args.fp8,
                "fp8_block": args.fp8_block if args.fp8 else None,
                "device": torch.cuda.get_device_name() if cuda else "cpu",
                "gpus_on_host": torch.cuda.device_count() if cuda else 0, "torch": torch.__version__,
                "checkpoint_seconds": round(time.perf_counter() - t, 1)}]
    out.write_text(json.dumps(records[0]) + "\n")  # each record as it comes: a run cut short keeps what it measured
    moe = args.model != "llama-8b"
    base: dict[int, dict] = {}
    experts = read_config(work / "ckpt").experts or 0
    for share, n in ((share, n) for share in args.cpu_shares for n in args.gpus):
        ckpt = "fp8" if args.fp8 else "ckpt"
        body = f"format_version: 1\ncheckpoint: {ckpt}\nworkload: {{cuda_graphs: true}}\n" + (
            experts_on_cpu(share, experts) if moe else POLICY[args.model]) + (f"gpus: {n}\n" if n > 1 else "")
        plan_path = make_plan(work, f"gpus{n}-cpu{share}", body)
        plan = load_plan(plan_path)
        ranks = run_ranks(measure, n, str(plan_path), moe, args.batches, args.new_tokens, args.device,
                          device=args.device)
        h2d = min(r["h2d_copy_gbps"] for r in ranks) if cuda else None
        uva = min(r["uva_read_gbps"] for r in ranks) if cuda else None
        for i, b in enumerate(args.batches):
            rows = [r["rows"][i] for r in ranks]
            rate = min(r["steps_per_s"] for r in rows)
            per_step = rows[0]["host_bytes_per_step"] if moe else plan.summary.prefetch_bytes
            floor = (uva if moe else h2d) * 1e9 / per_step if per_step and cuda else None
            if n == args.gpus[0] and share == args.cpu_shares[0]:
                base[b] = {"rate": rate, "tokens": rows[0]["tokens"], "gpus": n}
            rec = {"kind": "decode", "gpus": n, "batch": b, "cpu_share": share, "steps_per_s": rate,
                   "floor_steps_per_s": floor, "ratio_to_floor": rate / floor if floor else None,
                   "speedup": rate / base[b]["rate"], "speedup_over_gpus": base[b]["gpus"],
                   "tokens_agree_steps": agree(rows[0]["tokens"], base[b]["tokens"]), "new_tokens": args.new_tokens,
                   "tokens_equal_across_ranks": all(r["tokens"] == rows[0]["tokens"] for r in rows),
                   "bytes_per_step_per_gpu": per_step, "link": "uva" if moe else "h2d",
                   "h2d_copy_gbps": [r["h2d_copy_gbps"] for r in ranks],
                   "uva_read_gbps": [r["uva_read_gbps"] for r in ranks],
                   "predicted_steps_per_s": 1e6 / plan.summary.predicted_step_us if b == 1 and cuda else None,
                   "footprint_bytes": plan.summary.gpu_footprint_bytes, "cpu_bytes": plan.summary.cpu_bytes,
                   "cpu_threads": plan.cost.cpu_threads if plan.summary.cpu_bytes else None,
                   "load_peak_bytes": [r["load_peak_bytes"] for r in ranks],
                   "decode_peak_bytes": [r["decode_peak_bytes"] for r in rows],
                   "load_seconds": statistics.fmean(r["load_seconds"] for r in ranks)}
            records.append(rec)
            with out.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            print(json.dumps({k: v for k, v in rec.items() if not isinstance(v, list)}), flush=True)
    print(f"\n| GPUs | cpu share | batch | steps/s | x floor | x {args.gpus[0]} GPU | predicted steps/s "
          "| tokens agree |")
    print("|---|---|---|---|---|---|---|---|")
    for r in records[1:]:
        f = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        print(f"| {r['gpus']} | {r['cpu_share']} | {r['batch']} | {r['steps_per_s']:.1f} | {f(r['ratio_to_floor'])} "
              f"| {f(r['speedup'])} "
              f"| {f(r['predicted_steps_per_s'])} | {r['tokens_agree_steps']}/{r['new_tokens']} |")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
