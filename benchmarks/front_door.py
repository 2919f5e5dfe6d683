"""What a user gets through the front door, for every kind of plan, against the benchmarks' loop, in one run.

    python benchmarks/front_door.py --layers 8                              # Qwen3-30B-A3B shape, every strategy
    python benchmarks/front_door.py --layers 8 --strategies gpu uva --label a   # a part of the table per run
    python benchmarks/front_door.py --model tiny --layers 2 --out /tmp/r    # smoke test (CUDA)

One checkpoint (harness/checkpoints.py, random bf16 in the model's shapes; `tiny` has FP8-sized experts), its
block-scaled FP8 copy (tests/quantized_models.py) for the `-fp8` strategies, the hardware calibrated now, and one
plan per strategy, built as a user builds it (default workload: batch 1, CUDA graph replay):

- `gpu`: everything on the GPU;  `gpu-fp8`: the same, FP8 weights;  `uva`: every other decoder layer on uva;
  `prefetch`: every other decoder layer streamed (group 2, step 2);  `mixed`: `backend: mixed` under a budget of
  half the checkpoint's bytes and the experts' working memory with every expert on uva (planner/decide/working.py);
- `experts-uva`: every routed expert on uva (the README's main job);  `experts-uva-fp8`: the same, FP8 weights;
- `experts-split`: `backend: mixed` with `cpu_experts: true` under the experts-uva plan's GPU footprint: the plan
  splits the experts between the host's cores and the link (runtime/execute/host/).

At each `--batches` B (the first B of `PROMPTS`, distinct prompts of one length, each its UTF-8 bytes as token
ids, as `plan apply` takes them without a tokenizer; beyond 8, again from the first), `--new-tokens` decode steps
after the prefill's token, greedy:

- `loop`: the benchmarks' loop (harness/loops.py `decode_static`'s generator, each step replayed from a CUDA graph);
- `generate`: the runtime's `handle.generate` as a user calls it, replayed (the default), and with `eager=True`;
  the loop's calls and the replayed ones alternate, three of each, and each row is its calls' median (the link's
  rate moves a few percent between calls). Each eager call comes right after one of each all-GPU plan's (`gpu`, and `gpu-fp8`
  where an FP8 strategy runs; loaded once and kept beside, `--no-pair-eager` to not), whose medians bound that
  row: the host's CPU sets an eager step's pace, and it runs in phases up to about 1.9x slower for seconds to a
  minute (docs/calibration/), so an all-GPU eager rate measured minutes away moves the ratio with it;
- `apply`: `plan apply PLAN --prompt P... --json` in its own process (graph replay, the default), `--apply-calls`
  times (2): their mean;
- `transformers`: transformers' `model.generate` on the loaded model (eager, dynamic cache), for `experts-uva` at
  batch 1 only: what a user got before.

Each row's rate is set against the loop's (issue target: apply and generate >= 0.95x), eager rows against the lower
of the all-GPU plan's eager rate at that batch (the calls alternating with its own, where paired), of the same
checkpoint (`gpu-fp8` for the FP8 rows, where measured; `gpu` otherwise, and for FP8 rows also beside it), and the
link floor (target >= 0.8x; the floor, for the experts-uva, -fp8 and -split rows at batch 1: the bytes of the k
experts a token touches per layer over the UVA read rate calibrated now), and the plan's predicted step for that
batch and mode as `plan apply` gives it (at the plan's batch its own figure of that mode; at another, the same
policy built for that batch and mode, where it places as the plan does; none otherwise). offplan's rows must give
the loop's tokens (exit 1 otherwise). Records go to
OUT/front-door-MODEL[-LABEL].jsonl, a table is printed last.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from harness.checkpoints import config_for, make_checkpoint
from harness.plans import experts_working_bytes, make_plan, offloaded_layers
from reporting.front_door import eager_ratios
from planner.decide.build import step_at
from planner.inputs.checkpoint import open_checkpoint
from planner.inputs.hardware import dumps_hardware, load_hardware
from planner.planfile import load_plan

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from quantized_models import write_fp8  # noqa: E402  (the published FP8 layout's writer)

PROMPTS = tuple(f"The capital of {c} is" for c in ("France", "Greece", "Norway", "Sweden", "Poland", "Brazil",
                                                      "Canada", "Mexico"))  # one length: no padding
APPLY_CALLS = 2  # plan apply runs per row, each a process and a load of its own: their mean
ROOT = Path(__file__).resolve().parent.parent
STRATEGIES = ("gpu", "gpu-fp8", "uva", "prefetch", "mixed", "experts-uva", "experts-uva-fp8", "experts-split")
CALLS = 3  # handle.generate is timed as the median of this many calls: eager steps wait on the host's CPU, which
# stalled for tens of ms at a time on the H100 machine (docs/front-door/README.md)
EXPERTS_UVA = "rules:\n  - {match: [experts], place: uva}\n"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=["qwen3-30b-a3b", "tiny"])
    ap.add_argument("--layers", type=int, help="decoder layers (default: the real count)")
    ap.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=64, help="decode steps timed (default: 64)")
    ap.add_argument("--hardware", type=Path, help="a `plan calibrate` profile to use instead of calibrating now")
    ap.add_argument("--pair-eager", action=argparse.BooleanOptionalAction, default=True,
                    help="alternate each eager row's calls with the all-GPU plans' (default; they stay loaded: "
                         "--no-pair-eager where two models do not fit)")
    ap.add_argument("--apply-calls", type=int, default=APPLY_CALLS, help="plan apply processes per row, their "
                    f"mean (default: {APPLY_CALLS})")
    ap.add_argument("--label", help="a suffix for the records' file (a part of the table per run)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/offplan-bench"), help="where checkpoints go")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    return ap.parse_args(argv)


def policy(strategy: str, layers: int, budget_bytes: int, split_bytes: int = 0) -> str:
    """`budget_bytes`: mixed's budget; `split_bytes`: experts-split's."""
    head = f"format_version: 1\ncheckpoint: {'fp8' if strategy.endswith('fp8') else 'ckpt'}\nhardware: hw.yaml\n"
    if strategy == "uva":
        alternation = "|".join(map(str, offloaded_layers(layers, 0.5)))
        return head + f"rules:\n  - match: ['re:^model\\.layers\\.({alternation})\\.']\n    place: uva\n"
    return head + {"gpu": "", "gpu-fp8": "", "prefetch": "prefetch: {group_size: 2, num_in_group: 1, step: 2}\n",
                   "mixed": f"backend: mixed\nbudget_gib: {budget_bytes / 2**30!r}\nprefetch: {{step: 2}}\n",
                   "experts-uva": EXPERTS_UVA, "experts-uva-fp8": EXPERTS_UVA,
                   "experts-split": f"backend: mixed\ncpu_experts: true\nbudget_gib: {split_bytes / 2**30!r}\n",
                   }[strategy]


def predicted_steps_per_s(plan: Path, applied, batch: int, graph: bool) -> float | None:
    """The plan's prediction at `batch`, eager or replayed, as `plan apply` gives it (planner/decide/build.py
    `step_at`: at the plan's batch its own figure of that mode, at another its policy built again for that batch
    and mode where it places every tensor as the plan does; else none)."""
    step = step_at(applied, plan, batch, graph)
    return 1e6 / step if step else None


def prompts(batch: int) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] for i in range(batch)]


def plan_apply(plan: Path, new: int, batch: int) -> dict:
    """`plan apply PLAN --json` in a process of its own: its record of the generation."""
    done = subprocess.run([sys.executable, "-m", "offplan", "apply", str(plan), "--max-new-tokens", str(new + 1),
                           *(a for p in prompts(batch) for a in ("--prompt", p)), "--json"], capture_output=True,
                          text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"plan apply {plan} --batch {batch} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def in_process(plan: Path, ids: torch.Tensor, new: int, batches: list[int], transformers: bool,
               beside: dict) -> tuple[dict, dict]:
    """(path, batch) -> (steps/s, tokens) of the loop, handle.generate replayed and eager, and (if asked, at batch 1)
    transformers' model.generate; one load. And (path, batch) -> {strategy: steps/s} of the all-GPU handles
    `beside` ({strategy: handle}), whose eager calls alternate with the eager path's (module doc): their medians."""
    from runtime.hf import from_pretrained
    model, handle = from_pretrained(plan, device="cuda", progress=False)
    out, paired = {}, {}
    try:
        for b in batches:
            x = ids[:b]
            loop = handle.generator()  # decode_static's: the loop the benchmarks time (the replayed generate's own)
            for path, eager in (("generate", False), ("generate --eager", True)):
                pairs = beside if eager else {}
                for h in (handle, *pairs.values()):
                    h.generator(eager=eager).prepare(x, new + 1)  # what plan apply does before it times
                calls, by, loops = [], {name: [] for name in pairs}, []
                for _ in range(CALLS):
                    for name, h in pairs.items():
                        by[name].append(h.generate(x, new + 1, eager=True).decode_tokens_per_s)
                    if not eager:  # the loop's calls alternate with the replayed ones
                        loops.append(loop(x, new + 1))
                    calls.append(handle.generate(x, new + 1, eager=eager))
                for name, got in (("loop", loops), (path, calls)):
                    if got:
                        got = sorted(got, key=lambda g: g.decode_tokens_per_s)[CALLS // 2]  # the median call
                        out[name, b] = got.decode_tokens_per_s, [t[:new] for t in got.tokens]
                if pairs:
                    paired[path, b] = {name: statistics.median(v) for name, v in by.items()}
        if transformers and 1 in batches:
            out["transformers", 1] = hf_generate(model, ids[:1], new)
    finally:
        handle.remove(restore=False)
        del model, handle
        gc.collect()
        torch.cuda.empty_cache()
    return out, paired


def hf_generate(model, ids: torch.Tensor, new: int) -> tuple[float, list]:
    import time

    def run(n: int) -> tuple[float, torch.Tensor]:
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            got = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - start, got
    run(2)  # warm-up
    first, _ = run(1)
    seconds, got = run(new + 1)
    return new / (seconds - first), got[:, ids.shape[1]:ids.shape[1] + new].tolist()


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("front_door.py measures a GPU: no CUDA device here")
    from runtime.measure.calibrate import calibrate
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / f"front-door-{args.model}{'-' + args.label if args.label else ''}.jsonl"
    log.write_text("")

    def record(**r) -> None:
        with log.open("a") as f:
            f.write(json.dumps(r) + "\n")
        print(json.dumps(r), flush=True)
    work = args.dir / f"front-door-{args.model}"
    work.mkdir(parents=True, exist_ok=True)
    shape = "tiny-128" if args.model == "tiny" else args.model
    config = config_for(shape, args.layers)
    ckpt = make_checkpoint(shape, args.layers, work / "ckpt", "cuda")
    fp8 = any(s.endswith("fp8") for s in args.strategies)
    if fp8 and not (work / "fp8" / "model.safetensors.index.json").is_file():
        write_fp8(ckpt, work / "fp8", device="cuda")
    hw = load_hardware(args.hardware) if args.hardware else calibrate().hardware
    (work / "hw.yaml").write_text(dumps_hardware(hw))
    total = open_checkpoint(ckpt).total_bytes
    budget = total // 2 + experts_working_bytes(work, "format_version: 1\ncheckpoint: ckpt\nhardware: hw.yaml\n")
    record(kind="run", model=args.model, layers=config.num_hidden_layers, top_k=config.num_experts_per_tok,
           checkpoint_bytes=total, device=torch.cuda.get_device_name(), torch=torch.__version__,
           new_tokens=args.new_tokens, prompts=prompts(max(args.batches)), hardware=hw.__dict__)
    ids = torch.tensor([[c % config.vocab_size for c in p.encode()] for p in prompts(max(args.batches))],
                       device="cuda")
    new, failures = args.new_tokens, []
    split = load_plan(make_plan(work, "experts-uva", policy("experts-uva", config.num_hidden_layers, budget))
                      ).summary.gpu_footprint_bytes  # experts-split's budget
    beside = {}  # the all-GPU handles whose eager calls alternate with each eager row's
    if args.pair_eager:
        from runtime.hf import from_pretrained
        for name in ("gpu", "gpu-fp8") if fp8 else ("gpu",):
            beside[name] = from_pretrained(make_plan(work, f"{name}-beside", policy(name, config.num_hidden_layers,
                                                                                      budget)), progress=False)[1]
    for strategy in args.strategies:
        text = policy(strategy, config.num_hidden_layers, budget, split)
        plan = make_plan(work, strategy, text)
        applied = load_plan(plan)
        floor = None
        if strategy.startswith("experts-"):  # batch 1: the k experts a token touches per layer, over the link
            experts = open_checkpoint(work / ("fp8" if strategy.endswith("fp8") else "ckpt")).tensors
            host = sum(t.nbytes for n, t in experts.items() if ".mlp.experts." in n)
            floor = hw.uva_read_gbps * 1e9 * config.num_experts / (host * config.num_experts_per_tok)
        got, paired = in_process(plan, ids, new, args.batches, strategy == "experts-uva", beside)
        for b in args.batches:
            runs = [plan_apply(plan, new, b) for _ in range(args.apply_calls)]
            got["apply", b] = (statistics.mean(r["decode_tokens_per_s"] for r in runs),
                               [s["token_ids"][:new] for s in runs[0]["sequences"]])
        for (path, b), (rate, tokens) in got.items():
            graph = path in ("loop", "generate", "apply")
            loop_rate, loop_tokens = got["loop", b]
            same = tokens == loop_tokens
            if not same and path != "transformers":  # its dynamic cache attends over another length
                failures.append(f"{strategy} {path} batch {b}")
            record(kind="decode", strategy=strategy, path=path, batch=b, mode="graph" if graph else "eager",
                   steps_per_s=rate, ratio_to_loop=rate / loop_rate, same_tokens_as_loop=same,
                   floor_steps_per_s=floor if b == 1 else None, paired_eager_steps_per_s=paired.get((path, b)),
                   predicted_steps_per_s=None if path == "transformers" else
                   predicted_steps_per_s(plan, applied, b, graph),
                   gpu_bytes=applied.summary.gpu_bytes, uva_bytes=applied.summary.uva_bytes,
                   prefetch_bytes=applied.summary.prefetch_bytes)
    for h in beside.values():
        h.remove(restore=False)
    print("\n" + "\n".join(table([json.loads(l) for l in log.read_text().splitlines()])))
    if failures:
        print("tokens differ from the loop's: " + "; ".join(failures), file=sys.stderr)
    return 1 if failures else 0


def table(rows: list[dict]) -> list[str]:
    """Markdown: per strategy and batch, each path's steps/s and its ratios (module doc); then resident FP8 against
    bf16, where both all-GPU plans ran."""
    decode = [r for r in rows if r["kind"] == "decode"]
    out = ["| plan | batch | path | mode | steps/s | x loop | eager: x min(all-GPU eager, floor) | the same, bf16 "
           "all-GPU | predicted | tokens = loop's |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in decode:
        eager, bf16 = (f"{v:.2f}" if v else "" for v in eager_ratios(decode, r))
        predicted = f"{r['predicted_steps_per_s']:.1f}" if r["predicted_steps_per_s"] else ""
        out.append(f"| {r['strategy']} | {r['batch']} | {r['path']} | {r['mode']} | {r['steps_per_s']:.1f} | "
                   f"{r['ratio_to_loop']:.3f} | {eager} | {bf16} | {predicted} | {r['same_tokens_as_loop']} |")
    rate = {(r["strategy"], r["path"], r["batch"]): r["steps_per_s"] for r in decode}
    fp8 = [f"resident FP8 / bf16, {path}, batch {batch}: {v / rate['gpu', path, batch]:.2f}"
           for (strategy, path, batch), v in rate.items() if strategy == "gpu-fp8" and ("gpu", path, batch) in rate]
    return out + ([""] + fp8 if fp8 else [])


if __name__ == "__main__":
    sys.exit(main())
