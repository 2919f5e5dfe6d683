"""The experts-on-cpu section (moe-cpu-*.jsonl, benchmarks/moe.py --cpu-fractions): the host CPU computing a share
of every layer's experts beside the GPU reading the rest over uva, against every expert on uva in the same run."""
from __future__ import annotations

from .records import RESULTS, fmt, read_rows, run_header


def host_experts_tables() -> list[str]:
    out = []
    for path in sorted(RESULTS.glob("moe-cpu-*.jsonl")):
        rows = read_rows(path)
        decoded = [r for r in rows if r["kind"] == "decode"]
        uva = {r["batch"]: r["steps_per_s"] for r in decoded if r["name"] == "experts-host-offplan"}
        out += [f"## {path.stem}: experts on cpu beside experts on uva", "",
                "`python benchmarks/moe.py --layers 8 --modes graph --baselines batched_mm --transformers-baselines "
                "--host-implementations offplan --cpu-fractions F... --cpu-threads N...` (harness/host_rows.py): the "
                "first F of every layer's experts computed by the host's N threads (runtime/execute/host/), the rest "
                "read over uva, decode steps replayed from CUDA graphs. x uva: against every expert on uva in the "
                "same run. The host's median time per module forward includes its Python around the kernel.", "",
                "- " + run_header(path, rows), "",
                "| experts on cpu | threads | batch | steps/s | x uva | x floor | host ms per module | predicted steps/s |",
                "|---|---|---|---|---|---|---|---|"]
        out += [f"| {r['cpu_fraction']:g} | {r['cpu_threads']} | {r['batch']} | {r['steps_per_s']:.1f} | "
                f"{fmt(r['steps_per_s'] / uva[r['batch']] if r['batch'] in uva else None)} | "
                f"{fmt(r['ratio_to_floor'])} | {fmt((r.get('host_median_us') or 0) / 1e3)} | "
                f"{fmt(r.get('predicted_steps_per_s'), '.1f')} |" for r in decoded if "cpu_fraction" in r]
        out.append("")
    return out
