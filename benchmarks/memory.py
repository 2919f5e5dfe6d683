"""Does the GPU budget hold? offplan's own peak GPU memory, measured, against the plan's footprint, in one run.

    python benchmarks/memory.py --model qwen3-30b-a3b --layers 8                  # every MoE strategy
    python benchmarks/memory.py --model llama-8b --layers 8 --strategies gpu uva prefetch mixed
    python benchmarks/memory.py --model tiny --layers 4 --prompt-tokens 300 --out /tmp/r   # smoke test (CUDA)
    python benchmarks/memory.py --model qwen3-30b-a3b --layers 8 --gpus 2 --label 2gpu  # tensor parallel, per GPU

A plan's footprint (`summary.gpu_footprint_bytes`) is every byte offplan holds on the GPU at once: the resident
tensors, the prefetch and prefill staging pools and the experts' working memory at its peak (planner/decide/
working.py), sized for the policy's `workload` (here batch 1 and a prompt of `--prompt-tokens`). What it leaves
out is what transformers allocates whatever the placement: activations and the KV cache.

Per strategy (one plan each, built as a user builds it, `workload: {prompt_tokens: T}`), in this process:
- `gpu`: everything on the GPU;  `uva`: every other decoder layer on uva;  `prefetch`: every other decoder layer
  streamed (group 2, step 2);  `mixed`: `backend: mixed` under a budget of half the checkpoint's bytes, plus the
  experts' working memory with every expert on uva (MoE);
- `experts-uva`: every routed expert on uva;  `experts-split`: the first half of each layer's experts on uva;
  `experts-cpu`: every routed expert computed by the host;  `experts-uva-fp8`: experts-uva over a block-scaled
  FP8 copy of the checkpoint (tests/quantized_models.py).
Each is loaded (`runtime.hf.from_pretrained`), then `handle.generate` runs a prompt of T random token ids and
`--new-tokens` decode steps (its defaults: the prefill eager with the plan's staging, decode replayed from a
CUDA graph). The peak is torch's `max_memory_allocated` (and the peak of requested bytes, before the caching
allocator rounds them up) from before the load to the end, less what was allocated before it.

transformers' own share is measured on the all-GPU plan at the same shapes: its peak less its footprint (the
weights). offplan's own peak on a plan = its peak less that share. Target (issue 25): offplan's own peak <= the
plan's footprint + 1%, on every row. With `--gpus N` every plan is tensor parallel over N GPUs (`gpus: N`; not
`experts-cpu`, which is one GPU's only), each its own process (runtime/distributed/launch.py), and each GPU's
peak is held against the plan's footprint, which is each GPU's; a row's ratio is its fullest GPU's (issue 26:
a per-GPU budget holds on every GPU). `mixed` then gets each GPU's share of the budget. A strategy the planner
refuses to split at that shape (tiny's FP8 shares are not whole 128-blocks) is recorded as skipped, with the
planner's message, and so is `experts-cpu`; the report lists them under the table. Records go to
OUT/memory-MODEL[-LABEL].jsonl, a table is printed last; the exit code is 1 when a row misses the target.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

from harness.checkpoints import config_for, make_checkpoint
from harness.plans import experts_working_bytes, make_plan, offloaded_layers
from planner.errors import InputError
from planner.inputs.checkpoint import open_checkpoint
from planner.planfile import load_plan

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from quantized_models import write_fp8  # noqa: E402  (the published FP8 layout's writer)

STRATEGIES = ("gpu", "uva", "prefetch", "mixed", "experts-uva", "experts-split", "experts-cpu", "experts-uva-fp8")
TARGET = 1.01


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=["qwen3-30b-a3b", "llama-8b", "tiny"])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--gpus", type=int, default=1, help="tensor parallel over this many GPUs (default: 1)")
    ap.add_argument("--label", default="", help="suffix of the record file")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/offplan-bench"), help="where checkpoints go")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    return ap.parse_args(argv)


def policy(strategy: str, layers: int, experts: int, budget: int, prompt_tokens: int, gpus: int = 1) -> str:
    head = f"format_version: 1\ncheckpoint: {'fp8' if strategy.endswith('fp8') else 'ckpt'}\n" + (
        f"gpus: {gpus}\n" if gpus > 1 else "")
    workload = f"workload: {{prompt_tokens: {prompt_tokens}}}\n"
    half = "|".join(map(str, range(experts // 2)))
    body = {"gpu": "", "prefetch": "prefetch: {group_size: 2, num_in_group: 1, step: 2}\n",
            "uva": "rules:\n  - match: ['re:^model\\.layers\\.(" + "|".join(map(str, offloaded_layers(layers, 0.5)))
                   + ")\\.']\n    place: uva\n",
            "mixed": f"backend: mixed\nbudget_gib: {budget / 2**30!r}\nprefetch: {{step: 2}}\n",
            "experts-uva": "rules:\n  - {match: [experts], place: uva}\n",
            "experts-split": f"rules:\n  - match: ['re:\\.mlp\\.experts\\.({half})\\.']\n    place: uva\n",
            "experts-cpu": "rules:\n  - {match: [experts], place: cpu}\n",
            "experts-uva-fp8": "rules:\n  - {match: [experts], place: uva}\n"}[strategy]
    return head + body + workload


def peak(plan: Path, ids: torch.Tensor, new: int) -> dict:
    """Load `plan`, generate once; the peaks of allocated and requested bytes since before the load."""
    from runtime.hf import from_pretrained
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    requested = torch.cuda.memory_stats().get("requested_bytes.all.current", 0)
    torch.cuda.reset_peak_memory_stats()
    model, handle = from_pretrained(plan, device="cuda", progress=False)
    try:
        torch.cuda.synchronize()
        loaded = torch.cuda.max_memory_allocated() - base
        got = handle.generate(ids, new + 1)
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats()
        return dict(peak_bytes=torch.cuda.max_memory_allocated() - base, load_peak_bytes=loaded,
                    requested_peak_bytes=stats.get("requested_bytes.all.peak", 0) - requested,
                    tokens=got.tokens[0][:new], mode=got.mode)
    finally:
        handle.remove(restore=False)
        del model, handle
        gc.collect()
        torch.cuda.empty_cache()


def rank_peak(rank: int, plan: str, ids: torch.Tensor, new: int) -> dict:
    """`peak` in one process of a tensor-parallel plan, on its own GPU."""
    return peak(Path(plan), ids.cuda(), new)


def peaks(plan: Path, ids: torch.Tensor, new: int, gpus: int) -> list[dict]:
    """`peak` on each GPU: this process's, or one process per GPU's under tensor parallelism."""
    if gpus == 1:
        return [peak(plan, ids, new)]
    from runtime.distributed.launch import run_ranks
    return run_ranks(rank_peak, gpus, str(plan), ids.cpu(), new, device="cuda")


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("memory.py measures a GPU: no CUDA device here")
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / f"memory-{args.model}{'-' + args.label if args.label else ''}.jsonl"
    log.write_text("")

    def record(**r) -> None:
        with log.open("a") as f:
            f.write(json.dumps(r) + "\n")
        print(json.dumps(r), flush=True)
    work = args.dir / f"memory-{args.model}"
    work.mkdir(parents=True, exist_ok=True)
    shape = "tiny-128" if args.model == "tiny" else args.model
    config = config_for(shape, args.layers)
    moe = hasattr(config, "num_experts")
    strategies = [s for s in args.strategies if moe or not s.startswith("experts")]
    ckpt = make_checkpoint(shape, args.layers, work / "ckpt", "cuda")
    if "experts-uva-fp8" in strategies and not (work / "fp8" / "model.safetensors.index.json").is_file():
        write_fp8(ckpt, work / "fp8", device="cuda")
    total = open_checkpoint(ckpt).total_bytes
    budget = total // 2 + (experts_working_bytes(work, "format_version: 1\ncheckpoint: ckpt\n",
                                                 f"workload: {{prompt_tokens: {args.prompt_tokens}}}\n") if moe else 0)
    budget //= args.gpus  # each GPU's: about its share of the weights and of their working memory
    record(kind="run", model=args.model, layers=config.num_hidden_layers, checkpoint_bytes=total,
           prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, device=torch.cuda.get_device_name(),
           torch=torch.__version__, gpus=args.gpus)
    ids = torch.randint(3, config.vocab_size, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    ids = ids.cuda()
    order = ["gpu"] + [s for s in strategies if s != "gpu"]  # transformers' own share first
    own = None
    misses = []
    for strategy in order:
        text = policy(strategy, config.num_hidden_layers, getattr(config, "num_experts", 0), budget,
                      args.prompt_tokens, args.gpus)
        if args.gpus > 1 and strategy == "experts-cpu":
            record(kind="skipped", strategy=strategy, reason="experts on cpu are one GPU's only (not tensor parallel)")
            continue
        try:
            plan = make_plan(work, f"{strategy}-{args.gpus}gpu" if args.gpus > 1 else strategy, text)
        except InputError as e:  # under tensor parallelism: e.g. tiny's FP8 shares are not whole scale blocks
            if strategy == "gpu" or args.gpus == 1:
                raise
            record(kind="skipped", strategy=strategy, reason=str(e))
            continue
        s = load_plan(plan).summary
        each = peaks(plan, ids, args.new_tokens, args.gpus)
        if strategy == "gpu":  # per GPU
            own = [{k: g[k] - s.gpu_footprint_bytes for k in ("peak_bytes", "requested_peak_bytes")} for g in each]
        mine = [g["peak_bytes"] - o["peak_bytes"] for g, o in zip(each, own)]
        fullest = max(range(len(each)), key=mine.__getitem__)
        got, offplan = each[fullest], mine[fullest]
        requested = got["requested_peak_bytes"] - own[fullest]["requested_peak_bytes"]
        ratio = offplan / s.gpu_footprint_bytes
        if strategy in args.strategies and ratio > TARGET:
            misses.append(strategy)
        record(kind="memory", strategy=strategy, footprint_bytes=s.gpu_footprint_bytes, gpu_bytes=s.gpu_bytes,
               pool_bytes=s.prefetch_buffer_bytes + s.stage_buffer_bytes, working_decode_bytes=s.working_decode_bytes,
               working_prefill_bytes=s.working_prefill_bytes, working_buffer_bytes=s.working_buffer_bytes,
               transformers_bytes=own[fullest]["peak_bytes"], offplan_peak_bytes=offplan,
               offplan_requested_bytes=requested, offplan_peak_bytes_per_gpu=mine, gpu=fullest,
               ratio_to_footprint=ratio, requested_ratio_to_footprint=requested / s.gpu_footprint_bytes,
               **{k: got[k] for k in ("peak_bytes", "load_peak_bytes", "requested_peak_bytes", "mode")})
    for r in map(json.loads, log.read_text().splitlines()):
        if r["kind"] == "skipped":
            print(f"skipped {r['strategy']}: {r['reason']}", file=sys.stderr)
    print("\n" + "\n".join(table([json.loads(l) for l in log.read_text().splitlines()])))
    if misses:
        print(f"over the footprint + {TARGET - 1:.0%}: {', '.join(misses)}", file=sys.stderr)
    return 1 if misses else 0


def table(records: list[dict]) -> list[str]:
    """The markdown table of a run's records (benchmarks/report.py puts it in RESULTS.md)."""
    gb = lambda b: f"{b / 1e9:.3f}"  # noqa: E731
    out = ["| plan | footprint GB | of it working memory GB | peak GB | less transformers' own GB | offplan's own "
           "/ footprint | requested / footprint |", "|---|---|---|---|---|---|---|"]
    for r in records:
        if r["kind"] == "memory":
            working = r["working_buffer_bytes"] + max(r["working_decode_bytes"], r["working_prefill_bytes"])
            out.append(f"| {r['strategy']} | {gb(r['footprint_bytes'])} | {gb(working)} | {gb(r['peak_bytes'])} | "
                       f"{gb(r['offplan_peak_bytes'])} | {r['ratio_to_footprint']:.3f} | "
                       f"{r['requested_ratio_to_footprint']:.3f} |")
    return out


if __name__ == "__main__":
    sys.exit(main())
