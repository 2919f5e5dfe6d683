"""DeepSeek-V3's and GLM-4.5's tensor-parallel plans (planner/layers/shards.py) on two GPUs, as the CPU test runs them
over gloo (tests/execute/test_parallel.py `test_shared_experts_families_share_what_one_process_computes`).

    python docs/tp-families/probe.py --out DIR                 # needs two GPUs; writes DIR/tp-families.jsonl
    python docs/tp-families/probe.py --out DIR --device cpu    # the same over gloo, eagerly (a smoke test)

Per family (tiny config, random weights, a dense first layer, then routed experts and a shared one), per plan
(the CPU test's policies: some of the model on uva, every routed expert on uva, every routed expert on cpu), in
bf16, and float32 where its experts are read from pinned memory (all in HBM, float32 runs transformers'
grouped_mm, which no CUDA graph captures: test_parallel_gpu.py): two processes over NCCL, each decoding 8 greedy
steps replayed from a CUDA graph. Each record: the two processes' logits equal, the largest logit error against
transformers' own model in one process on the GPU over the largest logit (the CPU test's TOLERANCE: 2% in bf16,
1e-5 in float32), the greedy tokens of the pair, of transformers (float32), the decode mode, each process's
peak GPU memory during its load, and its host engine's (threads, calls) where experts are on cpu. Exit 1 if any
row is outside the tolerance, its processes disagree, a GPU row did not replay a graph, or float32 tokens differ.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "execute")]

import torch  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args(argv)

    from parallel_ranks import PROMPT, load_and_run
    from runtime.distributed.launch import run_ranks
    from runtime.execute.generation import PlainHandle
    from test_parallel import POLICIES, SHARED, TOLERANCE, _hardware
    from tiny_models import logits, make_plan, reference, save_family

    args.out.mkdir(parents=True, exist_ok=True)
    rows, bad = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        _hardware(tmp)
        plans, checkpoints = {}, {}
        for family, (make_config, _) in SHARED.items():
            for dtype in (torch.bfloat16, torch.float32):
                kind = str(dtype).removeprefix("torch.")
                checkpoints[family, dtype] = save_family(make_config(), tmp / f"{family}-{kind}", dtype=dtype)
                for name in ("uva", "experts", "cpu") if dtype is torch.bfloat16 else ("experts",):
                    plans[family, dtype, name] = str(make_plan(tmp, checkpoints[family, dtype], POLICIES[name],
                                                               name=f"{family}-{kind}-{name}"))
        dev = args.device
        zero, one = run_ranks(load_and_run, 2, list(plans.values()), dev, 8, dev == "cpu", device=dev)
        for (family, dtype, name), a, b in zip(plans, zero, one):
            ref = reference(checkpoints[family, dtype], device=dev, dtype=dtype)
            want = logits(ref, dev).cpu().float()
            err = (a["logits"].float() - want).abs().max().item() / want.abs().max().item()
            theirs = PlainHandle(ref).generate(torch.tensor(PROMPT), 8, eager=True).tokens \
                if dtype is torch.float32 else None
            row = {"family": family, "dtype": str(dtype).removeprefix("torch."), "plan": name, "mode": a["mode"],
                   "ranks_equal": bool(torch.equal(a["logits"], b["logits"]) and a["tokens"] == b["tokens"]),
                   "error_over_largest_logit": err, "tolerance": TOLERANCE[dtype], "tokens": a["tokens"],
                   "transformers_tokens": theirs, "load_peak_bytes": [a["peak"], b["peak"]],
                   "host": [a["host"], b["host"]], "torch": torch.__version__,
                   "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                   "gpus": torch.cuda.device_count() if dev == "cuda" else 0}
            ok = (row["ranks_equal"] and err <= TOLERANCE[dtype] and (theirs is None or theirs == a["tokens"])
                  and (dev == "cpu" or a["mode"] == "graph"))
            bad += not ok
            rows.append(row)
            same = "= transformers'" if theirs == a["tokens"] else a["tokens"]
            print(f"{family} {row['dtype']} {name}: {a['mode']}, error {err:.2e} (tolerance {TOLERANCE[dtype]:g}), "
                  f"ranks equal {row['ranks_equal']}, tokens {same}{'' if ok else '  <-- FAILED'}")
            del ref
    with open(args.out / "tp-families.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
