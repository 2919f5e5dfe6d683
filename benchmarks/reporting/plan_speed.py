"""The planning-speed section (plan-speed-LABEL.jsonl, benchmarks/plan_speed.py): `plan build` and `plan check`
against the safetensors header scan, per model and run (`before`, `after`, ...), and where the time went."""
from __future__ import annotations

from pathlib import Path

from .records import RESULTS, read_rows

PROFILE_ROWS = 8  # functions shown per profile


def plan_speed_tables(results: Path = RESULTS) -> list[str]:
    """The section, from every RESULTS/plan-speed-*.jsonl (the `before` run first); none when there is none."""
    runs = {}
    for path in sorted(results.glob("plan-speed-*.jsonl")):
        rows = read_rows(path)
        run = next((r for r in rows if r["kind"] == "run"), None)
        if run is not None:
            runs[run["label"]] = (path, run, rows)
    if not runs:
        return []
    labels = sorted(runs, key=lambda label: (label != "before", label))
    out = ["## Planning speed: `plan build` and `plan check` against reading the headers", "",
           "`python benchmarks/plan_speed.py --profile --label LABEL` (one run per label: `before` is main's planner "
           "at the commit the run names, run with this script), in process as the `plan` command runs, on "
           "header-only checkpoints of DeepSeek-V3 and Kimi-K2 with their config.json facts; the policy prefetches "
           "the experts of 2 layers in every 4. Header scan: the safetensors library opening every shard and "
           "listing its keys and shapes. Medians of interleaved repetitions; peak RSS of a fresh process that builds "
           "or checks once. Targets: build within 2x the scan, check within 1.5x. `plan show` (of a `backend: mixed` "
           "plan under half the checkpoint as its budget) and `plan diff` (of the two plans), a reviewer's "
           "commands, have none: timed in the runs that have them.", ""]
    for label in labels:
        path, run, _ = runs[label]
        out.append(f"- `{label}` (`{path.name}`): {run.get('note') or run['planner']}; {run.get('cpu') or run['machine']}"
                   f", {run.get('cpus', '?')} CPUs, Python {run['python']}, {run['repeat']} repetitions")
    out += ["", "| model | run | header scan | plan build (x scan) | plan check (x scan) | plan show (x scan) | "
            "plan diff (x scan) | peak RSS build / check |", "|---|---|---|---|---|---|---|---|"]
    for model in dict.fromkeys(r["model"] for _, _, rows in runs.values() for r in rows if r["kind"] == "timing"):
        for label in labels:
            times = {r["what"]: r for r in runs[label][2] if r["kind"] == "timing" and r["model"] == model}
            if not times:
                continue
            scan, build = times["header scan"], times["build"]
            cells = " | ".join(f"{t['median_s']:.3f} s ({t['ratio_to_scan']:.2f}x)" if (t := times.get(k)) else "-"
                               for k in ("build", "check", "show", "diff"))  # show, diff: the runs that timed them
            out.append(f"| {model} | {label} | {scan['median_s']:.3f} s | {cells} | "
                       f"{build['peak_rss_mb']} / {times['check']['peak_rss_mb']} MB |")
    out.append("")
    for label in labels:
        timings = [r for r in runs[label][2] if r["kind"] == "timing" and r["target"]]
        missed = [f"{r['model']} {r['what']} {r['ratio_to_scan']:.2f}x (target {r['target']}x)" for r in timings
                  if r["ratio_to_scan"] > r["target"]]
        out.append(f"`{label}`: " + (f"over target: {'; '.join(missed)}." if missed else "every target met."))
    out.append("")
    for label in labels:
        profiles = [r for r in runs[label][2] if r["kind"] == "profile"]
        for model in dict.fromkeys(r["model"] for r in profiles):
            for command in ("build", "check"):
                mine = [r for r in profiles if r["model"] == model and r["command"] == command]
                if mine:
                    out += [f"Where the time went, `{label}`, {model}, `plan {command}` ({mine[0]['total_s']:.2f} s "
                            f"under cProfile): {_top(mine)}", ""]
    return out


def _top(rows: list[dict]) -> str:
    """The functions that took most, inclusive (the CLI's and build's wrappers, over 90% of the run, left out)
    and by their own time."""
    total = rows[0]["total_s"]
    inclusive = [r for r in rows if r.get("order", "cumulative") == "cumulative" and r["cumtime_s"] < 0.9 * total]
    own = [r for r in rows if r.get("order") == "own"]
    text = "; ".join(f"`{r['function']}` {r['cumtime_s']:.2f} s" for r in inclusive[:PROFILE_ROWS])
    if own:
        text += "; by own time: " + "; ".join(f"`{r['function']}` {r['tottime_s']:.2f} s" for r in own[:5])
    return text
