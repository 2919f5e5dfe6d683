"""What a user gets through the front door, against the benchmarks' loop and the link floor, in one run.

    python benchmarks/front_door.py --layers 8                              # Qwen3-30B-A3B shape, on the H100
    python benchmarks/front_door.py --model tiny --layers 2 --out /tmp/r    # smoke test (CUDA)

One checkpoint (harness/checkpoints.py, random bf16 in the model's shapes) and one plan, every routed expert on
uva; batch 1, the same prompt (the UTF-8 bytes of `PROMPT` as token ids, as `plan apply` uses them without a
tokenizer), `--new-tokens` decode steps after the prefill's token:

- `plan apply PLAN --json` in its own process, as a user runs it: each decode step replayed from a CUDA graph
  (the default), and with `--eager`;
- the benchmarks' loop on the same plan (harness/loops.py `decode_static`, graph replay), in this process;
- transformers' `model.generate` on the same loaded model (eager: what a user got before `plan apply` replayed);
- the floor: the bytes of the k experts one token touches per layer, over the UVA read bandwidth measured now
  (runtime/measure/bandwidth.py), as moe.py's floor at batch 1.

Each row's decode rate is compared with the floor and with the benchmark loop's, and its tokens with the
benchmark loop's (offplan's rows must equal it: exit 1 otherwise). Records go to OUT/front-door-MODEL.jsonl.
"""
from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from harness.checkpoints import config_for, make_checkpoint
from harness.loops import decode_static
from harness.plans import make_plan
from runtime.measure.bandwidth import uva_gbps, warm_up

EXPERTS_HOST = "format_version: 1\ncheckpoint: ckpt\nrules:\n  - {match: [experts], place: uva}\n"
PROMPT = "The capital of France is"
ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=["qwen3-30b-a3b", "tiny"])
    ap.add_argument("--layers", type=int, help="decoder layers (default: the real count)")
    ap.add_argument("--new-tokens", type=int, default=64, help="decode steps timed (default: 64)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/offplan-bench"), help="where checkpoints go")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    return ap.parse_args(argv)


def plan_apply(plan: Path, new: int, *extra: str) -> dict:
    """`plan apply PLAN --json` in a process of its own: its record of the generation."""
    done = subprocess.run([sys.executable, "-m", "offplan", "apply", str(plan), "--max-new-tokens", str(new + 1),
                           "--prompt", PROMPT, "--json", *extra], capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"plan apply failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def in_process(plan: Path, ids: torch.Tensor, new: int) -> tuple[float, list, float, list]:
    """(the benchmark loop's steps/s and tokens, transformers' model.generate steps/s and tokens), one load."""
    from runtime.hf import from_pretrained
    model, handle = from_pretrained(plan, device="cuda", progress=False)
    try:
        loop_rate, loop_tokens = decode_static(model, handle, ids, new, "graph")

        def generate(n: int) -> tuple[float, torch.Tensor]:
            torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
            return time.perf_counter() - start, out
        generate(2)  # warm-up
        first, _ = generate(1)
        seconds, out = generate(new + 1)
        return loop_rate, loop_tokens, new / (seconds - first), out[:, ids.shape[1]:ids.shape[1] + new].tolist()
    finally:
        handle.remove(restore=False)
        gc.collect()
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("front_door.py measures a GPU: no CUDA device here")
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / f"front-door-{args.model}.jsonl"
    log.write_text("")

    def record(**r) -> None:
        with log.open("a") as f:
            f.write(json.dumps(r) + "\n")
        print(json.dumps(r), flush=True)
    work = args.dir / f"front-door-{args.model}"
    work.mkdir(parents=True, exist_ok=True)
    config = config_for(args.model, args.layers)
    make_checkpoint(args.model, args.layers, work / "ckpt", "cuda")
    plan = make_plan(work, "experts-host", EXPERTS_HOST)
    new = args.new_tokens
    warm_up()
    uva = uva_gbps()
    expert_bytes = 3 * config.moe_intermediate_size * config.hidden_size * 2  # gate, up, down in bf16
    floor = uva * 1e9 / (config.num_hidden_layers * config.num_experts_per_tok * expert_bytes)
    record(kind="floor", model=args.model, layers=config.num_hidden_layers, top_k=config.num_experts_per_tok,
           expert_bytes=expert_bytes, uva_read_gbps=round(uva, 1), floor_steps_per_s=floor,
           device=torch.cuda.get_device_name(), torch=torch.__version__, new_tokens=new, prompt=PROMPT)
    ids = torch.tensor([[b % config.vocab_size for b in PROMPT.encode()]], device="cuda")
    loop_rate, loop_tokens, hf_rate, hf_tokens = in_process(plan, ids, new)
    rows = [("benchmark loop (harness decode_static, graph)", loop_rate, loop_tokens[0], None)]
    for name, extra in (("plan apply (graph)", ()), ("plan apply --eager", ("--eager",))):
        got = plan_apply(plan, new, *extra)
        rows.append((name, got["decode_tokens_per_s"], got["sequences"][0]["token_ids"][:new], got["ttft_s"]))
    rows.append(("transformers model.generate (eager)", hf_rate, hf_tokens[0], None))
    for name, rate, tokens, ttft in rows:
        record(kind="decode", name=name, steps_per_s=rate, ratio_to_floor=rate / floor,
               ratio_to_benchmark_loop=rate / loop_rate, same_tokens_as_benchmark_loop=tokens == loop_tokens[0],
               ttft_ms=None if ttft is None else ttft * 1e3)
    print(f"\nfloor {floor:.1f} steps/s (UVA {uva:.1f} GB/s)\n| path | steps/s | x floor | x benchmark loop | "
          "tokens equal |\n|---|---|---|---|---|")
    for name, rate, tokens, _ in rows:
        print(f"| {name} | {rate:.1f} | {rate / floor:.3f} | {rate / loop_rate:.3f} | {tokens == loop_tokens[0]} |")
    # offplan's rows run one loop and must agree; transformers' dynamic cache attends over another length (its
    # rounding may flip a token some steps in), so its row is reported, not required
    return 0 if all(tokens == loop_tokens[0] for name, _, tokens, _ in rows if "transformers" not in name) else 1


if __name__ == "__main__":
    sys.exit(main())
