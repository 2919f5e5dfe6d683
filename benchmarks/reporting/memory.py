"""The GPU-memory section (memory-*.jsonl, benchmarks/memory.py): offplan's own peak against the plan's footprint."""
from __future__ import annotations

from .records import RESULTS, read_rows


def memory_tables() -> list[str]:
    out = []
    for path in sorted(RESULTS.glob("memory-*.jsonl")):
        rows = read_rows(path)
        run = next(r for r in rows if r["kind"] == "run")
        gpus = run.get("gpus", 1)
        over = (f" Tensor parallel over {gpus} GPUs (`gpus: {gpus}`), each plan's processes one per GPU: every "
                "figure is one GPU's, and each row is its fullest GPU's (offplan's own peak per GPU in the record)."
                if gpus > 1 else "")
        out += [f"## {run['model']}: does the GPU budget hold{f' on each of {gpus} GPUs' if gpus > 1 else ''}?", "",
                f"`{path.name}` (`benchmarks/memory.py`; {run['layers']} decoder layers, {run['device']}, torch "
                f"{run['torch']}): one plan per strategy with `workload: {{prompt_tokens: {run['prompt_tokens']}}}`, "
                f"loaded, then `handle.generate` of a {run['prompt_tokens']}-token prompt and {run['new_tokens']} "
                "decode steps (prefill eager, decode replayed). Peak: `max_memory_allocated` from before the load. "
                "transformers' own (activations, KV cache) is the all-GPU plan's peak less its weights; offplan's "
                "own = a plan's peak less that. Footprint: the plan's `gpu_footprint_bytes` (resident, pools, and "
                "the experts' working memory at its peak). Target: offplan's own / footprint <= 1.01." + over, "",
                "| plan | footprint GB | of it working memory GB | peak GB | offplan's own GB | offplan's own / "
                "footprint |", "|---|---|---|---|---|---|"]
        for r in rows:
            if r["kind"] == "memory":
                working = r["working_buffer_bytes"] + max(r["working_decode_bytes"], r["working_prefill_bytes"])
                out.append(f"| {r['strategy']} | {r['footprint_bytes'] / 1e9:.3f} | {working / 1e9:.3f} | "
                           f"{r['peak_bytes'] / 1e9:.3f} | {r['offplan_peak_bytes'] / 1e9:.3f} | "
                           f"{r['ratio_to_footprint']:.3f} |")
        skipped = [f"{r['strategy']} ({r['reason']})" for r in rows if r["kind"] == "skipped"]
        out += ["", f"Not run: {'; '.join(skipped)}."] if skipped else []
        out.append("")
    return out
