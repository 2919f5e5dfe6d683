"""How far apart the probes' figures are under each way of reducing their rounds (README.md has the result):

    python docs/calibration/analyse.py              # the probe-*.json beside this file

No GPU needed. Spread: the largest figure over the smallest, less 1.
"""
from __future__ import annotations

import glob
import json
import statistics as st
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROUNDS = {"median of the probe's 14 rounds (calibrate's reduction)": st.median, "fastest round": min,
          "first quartile of the rounds": lambda v: st.quantiles(v, n=4)[0]}


def spread(values: list[float]) -> str:
    return f"{100 * (max(values) / min(values) - 1):.0f}%"


def line(xs, ys) -> tuple[float, float]:
    slope, intercept = st.linear_regression(xs, ys)
    return intercept, slope


def main() -> None:
    probes = [json.loads(Path(f).read_text()) for f in sorted(glob.glob(str(HERE / "probe-*.json")))]
    print(f"{len(probes)} probes on {probes[0]['device']}\n")
    print("| reduction | per layer (dense), us | spread | per step, us | spread | per MoE layer, us | spread |")
    print("|---|---|---|---|---|---|---|")
    for name, reduce in ROUNDS.items():
        dense = [line([int(n) for n in p["llama"]], [reduce([st.median(r) for r in rounds])
                                                     for rounds in p["llama"].values()]) for p in probes]
        moe = [line([int(n) for n in p["moe"]], [reduce(r) for r in p["moe"].values()])[1] for p in probes]
        cells = [", ".join(f"{d[1]:.0f}" for d in dense), spread([d[1] for d in dense]),
                 ", ".join(f"{d[0]:.0f}" for d in dense), spread([d[0] for d in dense]),
                 ", ".join(f"{m:.0f}" for m in moe), spread(moe)]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\nhost kernel (median call per point, fitted): GB/s beside UVA reads, alone; fixed us")
    for what in ("beside", "alone"):
        fits = [line([q["bytes"] for q in p["host"][what]], [st.median(q["us"][2:]) for q in p["host"][what]])
                for p in probes]
        rates = [1 / f[1] / 1e3 for f in fits]
        print(f"  {what}: {', '.join(f'{r:.1f}' for r in rates)} GB/s ({spread(rates)}); fixed "
              f"{', '.join(f'{f[0]:.0f}' for f in fits)} us")
    hand = [p["host"]["handover_us"] for p in probes]
    print("hand-over, five medians of 200 replays per probe:", [[round(h, 1) for h in v] for v in hand])
    print(f"  the median of five: {[round(st.median(v), 1) for v in hand]} ({spread([st.median(v) for v in hand])}); "
          f"the fastest of five: {[round(min(v), 1) for v in hand]} ({spread([min(v) for v in hand])})")
    print("\neach Llama count's round medians, us (the phases: every count slower at once)")
    for i, p in enumerate(probes, 1):
        print(f"  probe {i}, 32 layers:", [round(st.median(r)) for r in p["llama"]["32"]])


if __name__ == "__main__":
    main()
