"""The prefill section (prefill-*.jsonl, benchmarks/prefill.py): time to first token against the link floor,
and decode beside it; the staging A/B runs (staging-ab-*.jsonl)."""
from __future__ import annotations

from .records import RESULTS, read_rows

PREFILL_LABELS = {"gpu": "all on GPU", "uva": "uva, staged for prefill", "uva-in-place": "uva, read in place",
                  "uva-gathered": "uva, staged, experts gathered", "prefetch": "prefetch", "mixed": "mixed",
                  "experts-host": "every routed expert on uva, staged",
                  "experts-host-gathered": "every routed expert on uva, gathered",
                  "experts-cpu": "every routed expert on cpu, staged"}


def prefill_tables() -> list[str]:
    """prefill-*.jsonl (benchmarks/prefill.py): time to first token against the link floor and the prefetch plan,
    and decode at batch 1 beside it, all from one run per model."""
    out = []
    for path in sorted(RESULTS.glob("prefill-*.jsonl")):
        rows = read_rows(path)
        ck = next(r for r in rows if r["kind"] == "checkpoint")
        hw = next(r for r in rows if r["kind"] == "hardware")
        prefill = [r for r in rows if r["kind"] == "prefill"]
        tokens = sorted({r["tokens"] for r in prefill})
        strategies = list(dict.fromkeys(r["strategy"] for r in prefill))
        by = {(r["strategy"], r["tokens"]): r for r in prefill}
        spread = next((r for r in rows if r["kind"] == "spread"), None)
        routing = "" if spread is None else (
            f"; routing spread as a trained model's (`--spread {spread['strength']:g}`: each router's input plus a "
            "fixed random vector per token, synthetic; the prompt touches nearly every expert)")
        experts = [r for r in prefill if r["strategy"] == "experts-host"]
        ring = any("ring_bytes" in r for r in prefill)  # recorded since the expert ring (2026-11-23)
        counted = any(r.get("ring_bytes") and r["gpu_footprint_bytes"] - ck["bytes"] + r["offloaded_bytes"]
                      >= r["ring_bytes"] for r in prefill)  # the plan's footprint holds the ring (since 2026-11-24)
        touched = " ".join(f"{r['tokens']}: {r['link_bytes'] / r['offloaded_bytes']:.0%}," for r in experts).rstrip(",")
        out += [f"## {ck['model']}: prefill (time to first token) with half the decoder layers offloaded{routing}", "",
                f"`{path.name}`: {ck['bytes'] / 1e9:.1f} GB on {ck['device']}, torch {ck['torch']}; its hardware "
                f"profile (calibrated in the run, or given with `--hardware`): H2D copy {hw['h2d_copy_gbps']} GB/s, "
                f"UVA {hw['uva_read_gbps']} GB/s, GEMMs "
                f"{hw.get('matmul_tflops', '?')} TFLOP/s, uva layers staged above {hw.get('stage_above_tokens', '?')} "
                "tokens. One prompt, a fresh cache, the logits of the last position (generate's prefill); median of "
                "3 after a warm-up. Floor = max(link bytes / H2D copy, all-GPU prefill), the link bytes being the "
                "offloaded ones, a routed expert on uva only if the prompt routes a token to it"
                + (", an embedding on uva by the rows of the prompt's tokens. Each cell: ms, x floor, x the prefetch "
                   "plan. `=`: logits bitwise equal to all-GPU's. `staged`: routed experts on uva streamed through "
                   "the expert ring ahead of their layer at prefill (`uva: {stage_experts: true}`; "
                   "runtime/execute/ring.py, "
                   f"at most 1 GiB allocated per prefill, {'in' if counted else 'not in'} the footprint)" if ring else
                   ". Measured before 2026-11-23, with the code of then: an embedding on uva counted whole in the "
                   "floor, and `staged` routed experts lay whole in 2 slots of a layer each, in the footprint. Each "
                   "cell: ms, x floor, x the prefetch plan. `=`: logits bitwise equal to all-GPU's")
                + "; `gathered`: each touched expert read once after the router."
                + (f" The share of the expert bytes the prompt touches, by tokens: {touched}." if touched else ""), "",
                "| plan | offloaded | " + " | ".join(f"{t} tokens" for t in tokens) + " |",
                "|---|---|" + "---|" * len(tokens)]
        for st in strategies:
            cells = []
            for t in tokens:
                r, pf = by.get((st, t)), by.get(("prefetch", t))
                if r is None:
                    cells.append("")
                    continue
                vs = f", {r['prefill_ms'] / pf['prefill_ms']:.2f}x pf" if pf and st not in ("gpu", "prefetch") else ""
                cells.append(f"{r['prefill_ms']:.1f} ({r['ratio_to_floor']:.2f}x{vs}){' =' if r['same_logits'] else ' ≠'}")
            off = by[(st, tokens[0])]["offloaded_bytes"] / 1e9
            out.append(f"| {PREFILL_LABELS.get(st, st)} | {off:.1f} GB | " + " | ".join(cells) + " |")
        if any(r.get("predicted_ms") is not None for r in prefill):
            out += ["", "The planner's prediction (the plan's `cost.prefill_us` at `workload.prompt_tokens` = T, same "
                    "placement) over the measured prefill: 1.00 is exact, above 1 pessimistic. `-`: mixed places "
                    "differently at that T.", "",
                    "| plan | " + " | ".join(f"{t} tokens" for t in tokens) + " |", "|---|" + "---|" * len(tokens)]
            for st in strategies:
                cells = []
                for t in tokens:
                    r = by.get((st, t))
                    pred = r.get("predicted_ms") if r else None
                    cells.append("-" if pred is None else f"{pred:.1f} ms ({pred / r['prefill_ms']:.2f}x)")
                out.append(f"| {PREFILL_LABELS.get(st, st)} | " + " | ".join(cells) + " |")
        decode = [r for r in rows if r["kind"] == "decode"]
        modes = list(dict.fromkeys(r["mode"] for r in decode))
        dby = {(r["strategy"], r["mode"]): r for r in decode}
        out += ["", "Decode at batch 1 of the same loads, steps/s (eager `generate`; CUDA graph replay), with "
                "`uva, staged` over `uva, read in place`: what staging costs decode. Graph replay runs no Python and "
                "is the stable figure; eager `generate` is CPU-bound and, on this machine, the same plan loaded again "
                "has measured 15-25% apart, so its ratio is within noise. All-GPU MoE runs the experts implementation "
                "transformers picks for the loaded model (prefill.py does not record which; moe.py compares them), "
                "plans with experts on uva run offplan's. The all-GPU eager figure (the first decode of each process) "
                "is below what the link-bound plans reach and is not explained: not investigated.", "",
                "| plan | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]
        for st in strategies:
            cells = []
            for mode in modes:
                r, base = dby.get((st, mode)), dby.get(("uva-in-place", mode))
                if r is None:
                    cells.append("")
                    continue
                staged = st in ("uva", "uva-gathered")
                vs = f" ({r['steps_per_s'] / base['steps_per_s']:.3f}x in place)" if staged and base else ""
                cells.append(f"{r['steps_per_s']:.2f}{vs}{'' if r['same_tokens'] else ' ≠'}")
            out.append(f"| {PREFILL_LABELS.get(st, st)} | " + " | ".join(cells) + " |")
        out.append("")
    return out


def staging_ab() -> list[str]:
    """staging-ab-*.jsonl (prefill.py --spread 2 --tokens 2048 --strategies uva uva-gathered uva-in-place, run
    again): decode of plans that differ only in what prefill stages, against each other."""
    runs = [read_rows(p) for p in sorted(RESULTS.glob("staging-ab-*.jsonl"))]
    if not runs:
        return []
    names = {"uva": "experts staged", "uva-gathered": "experts gathered", "uva-in-place": "nothing staged"}
    cells = []
    for st, name in names.items():
        rates = [f"{r['steps_per_s']:.2f}" for rows in runs for r in rows
                 if r["kind"] == "decode" and r["mode"] == "graph" and r["strategy"] == st]
        cells.append(f"{name} {' and '.join(rates)}")
    return ["Decode does not see prefill staging: the three uva plans of the spread run, loaded again in "
            f"{len(runs)} more processes on 2026-11-22, when staged experts lay whole in 2 slots of a layer each "
            "instead of streaming through the ring (`python benchmarks/prefill.py --model qwen3-30b-a3b --layers 8 --spread 2 "
            "--tokens 2048 --strategies uva uva-gathered uva-in-place`, `staging-ab-*.jsonl`), replay a batch-1 "
            "decode graph at " + "; ".join(cells) + " steps/s: one plan loaded again moves as much as the plans "
            "differ, so the single run's ratios above are between-load noise (not investigated).", ""]
