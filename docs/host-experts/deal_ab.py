"""Dealt against static, alternating: each step's experts dealt between the host and the link (the policy's
`cpu_deal`, runtime/execute/host/deal.py) against each expert computed where it is placed (`cpu_deal: false`),
on the same machine in the same minutes. The host's cores run in phases (docs/front-door/: up to 1.9x apart), so
arms measured one after the other compare the phases as much as the arms; here both plans of a pair and the
all-uva plan stay loaded and take turns, round by round, which goes first alternating.

Pairs: `--shares F...` puts the first F of every layer's experts on cpu, the rest on uva (harness/host_rows.py
`cpu_rules`); `--split` the plan's own split at each batch (`backend: mixed`, `cpu_experts: true`, the all-uva
plan's GPU footprint as the budget), built dealt and static (the static plan may choose another share).

    python docs/host-experts/deal_ab.py --layers 8 --batches 1 8 --shares 0.6 0.7 --split --out deal-ab.jsonl

Each row: the arm, its round, steps/s of a replayed decode (`handle.generate`, `--new-tokens` after a warm-up
call), the host's mean time per module call over it, and the plan's prediction (its own batch's for the split;
batch 1's for the shares).

Runs against branch `cpu-deal` (commit b9f23bd), whose dealing is not on main (README.md here, "Dealing each
step's experts"): `git worktree add /tmp/deal b9f23bd`, then run it there.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from harness.checkpoints import make_checkpoint  # noqa: E402
from harness.host_rows import DEAL, cpu_rules  # noqa: E402
from harness.plans import make_plan  # noqa: E402
from planner.planfile import load_plan  # noqa: E402
from runtime.hf import from_pretrained  # noqa: E402


class Arm:
    def __init__(self, name: str, plan: Path, batch: int, new: int):
        self.name, self.plan, self.batch, self.new = name, plan, batch, new
        self.model, self.handle = from_pretrained(plan, progress=False)
        vocab = self.model.config.get_text_config().vocab_size
        self.ids = torch.randint(3, vocab, (batch, 16), generator=torch.Generator().manual_seed(1234)).cuda()
        self.handle.generate(self.ids, new + 1)  # capture, warm-up

    def run(self) -> dict:
        engine = self.handle.host_experts
        before = engine.times().get(self.batch, (0, 0.0)) if engine else (0, 0.0)
        got = self.handle.generate(self.ids, self.new + 1)
        after = engine.times().get(self.batch, (0, 0.0)) if engine else (0, 0.0)
        calls = after[0] - before[0]
        return {"steps_per_s": round(got.decode_tokens_per_s, 2),
                "host_mean_us": round(1e6 * (after[1] - before[1]) / calls) if calls else None}

    def close(self) -> None:
        self.handle.remove(restore=False)
        del self.model, self.handle
        torch.cuda.empty_cache()


def pair(work: Path, head: str, name: str, body: str, batch: int) -> list[tuple[str, Path]]:
    return [(f"{name}{'' if deal else '-static'}", make_plan(work, f"ab-{name}-b{batch}-{int(deal)}",
                                                              head + body + DEAL[deal]))
            for deal in (True, False)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/offplan-bench"))
    ap.add_argument("--hardware", type=Path, required=True, help="a `plan calibrate` profile")
    ap.add_argument("--batches", type=int, nargs="+", default=[1])
    ap.add_argument("--shares", type=float, nargs="*", default=[])
    ap.add_argument("--split", action="store_true")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    work = args.dir / f"deal-ab-{args.layers}"
    work.mkdir(parents=True, exist_ok=True)
    make_checkpoint("qwen3-30b-a3b", args.layers, work / "ckpt", "cuda")
    (work / "hw.yaml").write_text(args.hardware.read_text())
    head = "format_version: 1\ncheckpoint: ckpt\nhardware: hw.yaml\n"
    uva_plan = make_plan(work, "ab-uva", head + "rules:\n  - {match: [experts], place: uva}\n")
    budget = load_plan(uva_plan).summary.gpu_footprint_bytes / 2**30
    rows, device = [], torch.cuda.get_device_name()
    for b in args.batches:
        uva = Arm("uva", uva_plan, b, args.new_tokens)
        pairs = [pair(work, head, f"cpu{f:g}", cpu_rules(round(f * 128), 128), b) for f in args.shares]
        if args.split:
            pairs.append(pair(work, head, "split", f"backend: mixed\ncpu_experts: true\nbudget_gib: {budget!r}\n"
                                                   f"workload: {{batch_size: {b}, cuda_graphs: true}}\n", b))
        for arms in pairs:
            loaded = [Arm(name, path, b, args.new_tokens) for name, path in arms]
            for r in range(args.rounds):
                order = [uva, *loaded] if r % 2 == 0 else [*loaded[::-1], uva]
                for arm in order:
                    plan = load_plan(arm.plan)
                    s = plan.summary
                    rows.append({"arm": arm.name, "batch": b, "round": r, "device": device, "layers": args.layers,
                                 "cpu_fraction": round(s.cpu_bytes / max(1, s.cpu_bytes + s.uva_bytes), 3),
                                 "cpu_deal": plan.cost.cpu_deal,
                                 "predicted_steps_per_s": round(1e6 / s.predicted_step_us, 1), **arm.run()})
                    print(json.dumps(rows[-1]), flush=True)
            for arm in loaded:
                arm.close()
        uva.close()
    for (name, b) in dict.fromkeys((r["arm"], r["batch"]) for r in rows):
        got = [r["steps_per_s"] for r in rows if (r["arm"], r["batch"]) == (name, b)]
        print(f"{name:>14} b{b}: median {statistics.median(got):7.1f} steps/s over {len(got)} rounds "
              f"({min(got):.1f}-{max(got):.1f})")
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
