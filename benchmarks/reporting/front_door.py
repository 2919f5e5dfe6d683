"""The front-door section (front-door-*.jsonl, benchmarks/front_door.py): what `plan apply` and `handle.generate`
decode at, per kind of plan and batch, against the benchmarks' loop, the link floor and the plan's prediction."""
from __future__ import annotations

from .records import RESULTS, fmt, read_rows


def front_door_tables() -> list[str]:
    out = []
    for path in sorted(RESULTS.glob("front-door-*.jsonl")):
        out += _run_table(path, read_rows(path))
    return out


def _run_table(path, rows: list[dict]) -> list[str]:
    """One run's table: its own all-GPU eager rate bounds its eager rows."""
    run = next(r for r in rows if r["kind"] == "run")
    decode = [r for r in rows if r["kind"] == "decode"]
    gpu_eager = {r["batch"]: r["steps_per_s"] for r in decode
                 if r["strategy"] == "gpu" and r["path"] == "generate --eager"}
    plans = ", ".join(dict.fromkeys(r["strategy"] for r in decode))
    out = [f"## {run['model']}: through the front door ({plans})", "",
           f"`{path.name}` (`benchmarks/front_door.py`; {run['layers']} decoder layers, {run['device']}, torch "
           f"{run['torch']}; UVA {run['hardware']['uva_read_gbps']} GB/s and H2D {run['hardware']['h2d_copy_gbps']} "
           "GB/s calibrated in the run). One plan per strategy, built as a user builds it; the prompt "
           f"{run['prompt']!r} as token ids (its bytes), B copies at batch B, greedy, {run['new_tokens']} decode "
           "steps. `loop`: the benchmarks' loop; `generate`: `handle.generate` as a user calls it; `apply`: `plan "
           "apply PLAN --batch B` in its own process; `transformers`: `model.generate` on the loaded model (eager, "
           "dynamic cache). x loop: against the loop (target for apply and generate: >= 0.95). Eager rows: against "
           "the lower of this run's all-GPU plan's eager rate at that batch and, at batch 1 with experts on uva, the "
           "link floor (the k experts a token touches per layer over the UVA rate; target >= 0.8). Predicted: the "
           "plan's decode step for that batch and mode (the same policy with that workload). At batch 8 the "
           "sequences are copies of one prompt, so they route alike and a step reads what one sequence's does; the "
           "plan predicts 8 distinct tokens' routing, so its batch-8 figures of plans with experts in host memory do "
           "not compare (measured / predicted left out there).", "",
           "| plan | batch | path | mode | steps/s | x loop | eager x min(all-GPU eager, floor) | x floor | "
           "predicted steps/s | measured / predicted | tokens = loop's |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in decode:
        bound = [v for v in (gpu_eager.get(r["batch"]), r["floor_steps_per_s"]) if v]
        eager = r["steps_per_s"] / min(bound) if r["mode"] == "eager" and bound else None
        floor = r["steps_per_s"] / r["floor_steps_per_s"] if r["floor_steps_per_s"] else None
        pred = r["predicted_steps_per_s"]
        alike = r["batch"] > 1 and r["uva_bytes"] + r["prefetch_bytes"] > 0 and r["strategy"] != "prefetch"
        out.append(f"| {r['strategy']} | {r['batch']} | {r['path']} | {r['mode']} | {r['steps_per_s']:.1f} | "
                   f"{r['ratio_to_loop']:.3f} | {fmt(eager)} | {fmt(floor)} | {fmt(pred, '.1f')} | "
                   f"{fmt(r['steps_per_s'] / pred if pred and not alike else None)} | {r['same_tokens_as_loop']} |")
    return out + [""]
