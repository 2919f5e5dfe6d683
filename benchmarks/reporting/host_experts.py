"""The experts-on-cpu section (moe-cpu-*.jsonl, benchmarks/moe.py --cpu-fractions): the host CPU computing a share
of every layer's experts beside the GPU reading the rest over uva, against every expert on uva in the same run."""
from __future__ import annotations

from .records import RESULTS, fmt, read_rows, run_header


def host_experts_tables() -> list[str]:
    out = []
    for path in sorted(RESULTS.glob("moe-cpu-*.jsonl")):
        rows = read_rows(path)
        decoded = [r for r in rows if r["kind"] == "decode"]
        uva = {(r["mode"], r["batch"]): r["steps_per_s"] for r in decoded if r["name"] == "experts-host-offplan"}
        layers = next(r["layers"] for r in rows if r["kind"] == "floor")
        out += [f"## {path.stem}: experts on cpu beside experts on uva, {layers} layers", "",
                "`python benchmarks/moe.py --cpu-fractions F... --cpu-threads N...` (harness/host_rows.py; each run's "
                "command is in the list above): the "
                "first F of every layer's experts computed by the host's N threads (runtime/execute/host/), the rest "
                "read over uva; `the plan's split` (`--cpu-split`): `backend: mixed` with `cpu_experts: true` under "
                "the all-uva plan's GPU footprint, built for that batch, F its share of the experts' bytes; `no lookahead` "
                "(`--lookahead-ab`): the same plan without the experts lookahead. x uva: against every expert on uva in "
                "the same run and mode. The host's time per "
                "module forward (median over the timed call's forwards, its prefill's included, in older runs; the "
                "mean over the decode steps' forwards where the kernel column names it) counts whatever runs "
                "around the kernel in the host's thread; the prediction is the plan's.", "",
                "- " + run_header(path, rows)]
        hw = next(r for r in rows if r["kind"] == "hardware")
        per_threads = [r for r in rows if r["kind"] == "host-calibration"]  # measured at each --cpu-threads
        out += [f"- the host's figures, {', '.join(host_figures(r) for r in per_threads)}: each thread count's rows "
                "and plans take their own" if per_threads else
                f"- the host's figures in the profile: {host_figures(hw)}"
                + ("; the rows at other threads took these rates" if any(
                    r.get("cpu_threads") not in (None, hw["cpu_threads"]) for r in decoded) else "")]
        out += ["", "| experts on cpu | threads | mode | batch | steps/s | x uva | x floor | host ms per module | "
                "predicted steps/s | kernel |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in (r for r in decoded if "cpu_fraction" in r):
            base, median = uva.get((r["mode"], r["batch"])), r.get("host_mean_us", r.get("host_median_us"))
            share = f"{r['cpu_fraction']:.2f}, the plan's split" if r.get("split_by_plan") else f"{r['cpu_fraction']:g}"
            share += ", no lookahead" if r["name"].endswith("-no-lookahead") else ""
            out.append(f"| {share} | {r['cpu_threads']} | {r['mode']} | {r['batch']} | "
                       f"{r['steps_per_s']:.1f} | {fmt(r['steps_per_s'] / base if base else None)} | "
                       f"{fmt(r['ratio_to_floor'])} | {fmt(None if median is None else median / 1e3)} | "
                       f"{fmt(r.get('predicted_steps_per_s'), '.1f')} | {r.get('host_kernel', 'compiled')} |")
        out.append("")
    return out


def host_figures(r: dict) -> str:
    """A profile's (or a `host-calibration` row's) host figures for experts on cpu, in words."""
    return (f"{r['cpu_threads']} threads: {r['cpu_expert_gbps']:g} GB/s beside UVA reads"
            + (f", {r['cpu_expert_alone_gbps']:g} alone" if r.get("cpu_expert_alone_gbps") else "")
            + f", {r['cpu_expert_sync_us']:g} us a call and hand-over")
