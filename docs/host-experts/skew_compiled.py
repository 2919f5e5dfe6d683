r"""The skewed budget's plans (`benchmarks/moe.py --skew`), replayed and compiled: does compiling the step lift the
cpu share's gain at batch 1 towards issue 24's 1.3x?

moe.py measures its budget plans (harness/budgets.py `measure_budgets`) replayed only, where the cpu share gained
1.13x at batch 1 (README, "Not done yet"). There a layer's fixed GPU work (0.29 ms) is most of the step, and the
same in both plans; compiling shortens it (docs/host-experts/README.md), which leaves the off-GPU reads, where the two
plans differ, a larger share. This probe makes moe.py's own run (checkpoint, calibration, skewed router, a routing
profile on other prompts, the three plans per `--resident` fraction) and measures every plan in both replayed modes:
`measure_budgets` is handed the run with its `measure` asked for both modes where it asks for "graph" alone. Each
plan with experts on cpu is then measured once more without the experts lookahead (`Run.load(lookahead=False)`): a
module whose experts are all in HBM or on cpu still takes part in it on main, and its guess (among no experts the link
reads: any two) has their rows read over the link (19 MB) until the next module stops it, beside the host's calls
(about 150 us each here). docs/host-experts/README.md, "The skewed budget's cpu share", has the three runs.
The per-expert plans, the hardware profile and the routing profile are copied to OUT/plans, for the cost model to
be read again.

    PYTHONPATH=.:$PYTHONPATH python docs/host-experts/skew_compiled.py --layers 8 --batches 1 \
        --baselines batched_mm --transformers-baselines --skew 0.7 --resident 0.25 --budget-batches 1 \
        --new-tokens 24 --out OUT     # on a GPU machine; records in OUT/moe-qwen3-30b-a3b-skew0.7.jsonl
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import moe  # noqa: E402
from harness.budgets import measure_budgets, record_profile  # noqa: E402


def main(argv=None) -> int:
    args = moe.parse_args(argv)
    run = moe.Run(args)
    gpu = run.plan("gpu", "")
    for implementation in args.baselines:
        run.measure(f"gpu-{implementation}", gpu, implementation, list(moe.REPLAYED), offloaded=False)
    measure = run.measure

    def both(name, plan, implementation, modes, **kw):
        return measure(name, plan, implementation, list(moe.REPLAYED) if modes == ["graph"] else modes, **kw)
    run.measure = both
    measure_budgets(run, record_profile(run, gpu))
    for fraction in args.resident:
        name = f"budget-per-expert-cpu-{fraction:g}"
        measure(f"{name}-no-lookahead", run.work / f"{name}.plan.yaml", None, list(moe.REPLAYED), offloaded=True,
                batches=args.budget_batches, floor=False, lookahead=False, resident_fraction=fraction)
    (args.out / "plans").mkdir(exist_ok=True)
    for path in [run.work / "hw.yaml", run.work / "routing.yaml", *run.work.glob("budget-per-expert*.plan.yaml")]:
        shutil.copy(path, args.out / "plans")
    rows = [json.loads(line) for line in run.log.read_text().splitlines()]
    got = {(r["name"], r["mode"], r["batch"]): r["steps_per_s"] for r in rows if r["kind"] == "decode"}
    print("\n| plan | mode | batch | steps/s | x per-expert without cpu |\n|---|---|---|---|---|")
    for (name, mode, b), rate in got.items():
        plain = got.get((name.replace("-cpu-", "-").removesuffix("-no-lookahead"), mode, b)) if "-cpu-" in name \
            else None
        print(f"| {name} | {mode} | {b} | {rate:.1f} | {'-' if plain is None else f'{rate / plain:.2f}'} |")
    return 1 if run.failures else 0


if __name__ == "__main__":
    sys.exit(main())
