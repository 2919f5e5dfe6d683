"""The front-door section (front-door-*.jsonl, benchmarks/front_door.py): what `plan apply` and `handle.generate`
decode at, per kind of plan and batch, against the benchmarks' loop, the link floor and the plan's prediction."""
from __future__ import annotations

from .records import RESULTS, fmt, read_rows


def front_door_tables() -> list[str]:
    out = []
    for path in sorted(RESULTS.glob("front-door-*.jsonl")):
        out += _run_table(path, read_rows(path))
    return out


def eager_ratios(decode: list[dict], r: dict) -> tuple[float | None, float | None]:
    """Eager row `r`'s rate over the lower of its link floor and the all-GPU eager rate at its batch of its own
    checkpoint (`gpu-fp8` for an FP8 row where the run has it, `gpu` otherwise); and, for an FP8 row measured so,
    over the lower of the floor and bf16's (`gpu`) beside it. The all-GPU rate is the one measured alternating
    with the row's calls where the run did (`paired_eager_steps_per_s`), else the all-GPU plan's own eager row.
    (None, None) for other rows."""
    eager = {(x["strategy"], x["batch"]): x["steps_per_s"] for x in decode if x["path"] == "generate --eager"}
    paired = r.get("paired_eager_steps_per_s") or {}

    def over(gpu: str) -> float | None:
        bound = [v for v in (paired.get(gpu) or eager.get((gpu, r["batch"])), r["floor_steps_per_s"]) if v]
        return r["steps_per_s"] / min(bound) if bound else None
    if r["mode"] != "eager":
        return None, None
    fp8 = r["strategy"].endswith("fp8") and ("gpu-fp8", r["batch"]) in eager
    return over("gpu-fp8" if fp8 else "gpu"), over("gpu") if fp8 else None


def _floor(r: dict, run: dict) -> float | None:
    """A row's link floor, steps/s: as recorded (experts on uva at batch 1), or for the prefetch plan, which copies
    its streamed layers whole every step at any batch, their bytes over the run's calibrated H2D rate."""
    if r["floor_steps_per_s"] or r["strategy"] != "prefetch" or not r["prefetch_bytes"]:
        return r["floor_steps_per_s"]
    return run["hardware"]["h2d_copy_gbps"] * 1e9 / r["prefetch_bytes"]


def _prompts(run: dict) -> str:
    if "prompts" not in run:  # runs before distinct prompts
        return f"the prompt {run['prompt']!r} as token ids (its bytes), B copies at batch B"
    return (f"{len(run['prompts'])} distinct prompts of one length ({run['prompts'][0]!r}, "
            f"{run['prompts'][1]!r}, ...) as token ids (their bytes), the first B at batch B; the loop's and "
            "generate's calls alternating, three each, each row their median; apply's processes' mean (`--apply-calls`, "
            "2 by default)"
            if len(run["prompts"]) > 1 else f"the prompt {run['prompts'][0]!r} as token ids (its bytes)")


def _run_table(path, rows: list[dict]) -> list[str]:
    """One run's table: its own all-GPU eager rates bound its eager rows."""
    run = next(r for r in rows if r["kind"] == "run")
    decode = [{**r, "floor_steps_per_s": _floor(r, run)} for r in rows if r["kind"] == "decode"]
    plans = ", ".join(dict.fromkeys(r["strategy"] for r in decode))
    out = [f"## {run['model']}: through the front door ({plans})", "",
           f"`{path.name}` (`benchmarks/front_door.py`; {run['layers']} decoder layers, {run['device']}, torch "
           f"{run['torch']}; UVA {run['hardware']['uva_read_gbps']} GB/s and H2D {run['hardware']['h2d_copy_gbps']} "
           "GB/s calibrated in the run). One plan per strategy, built as a user builds it; " + _prompts(run) +
           f", greedy, {run['new_tokens']} decode "
           "steps. `loop`: the benchmarks' loop; `generate`: `handle.generate` as a user calls it; `apply`: `plan "
           "apply PLAN` in its own process; `transformers`: `model.generate` on the loaded model (eager, "
           "dynamic cache), over key lengths the process meets for the first time, at each of which torch's cuDNN "
           "attention builds a graph: most of its time (docs/front-door/, `hf_generate_probe.py`). x loop: against "
           "the loop (target for apply and generate: >= 0.95). Eager rows: against "
           "the lower of this run's all-GPU plan's eager rate at that batch, of the same checkpoint (`gpu-fp8` for "
           "FP8 rows where the run has it; the bf16 one's beside it; in runs that record it, measured alternating "
           "with the row's own calls), and the link floor: at batch 1 with experts on uva, the k experts a token "
           "touches per layer over the UVA rate; for the prefetch plan, its streamed bytes over the H2D rate (target "
           ">= 0.8). Predicted: the "
           "plan's decode step for that batch and mode (the same policy with that workload). At batch 8 the "
           "sequences route alike (" + ("distinct prompts, but a random model's routers pick mostly the same experts "
                                        "for any token: " if "prompts" in run else "copies of one prompt: ") +
           "a step reads little more than what one sequence's does); the plan predicts 8 independent tokens' "
           "routing, so its batch-8 figures of plans with experts in host memory do not compare (measured / "
           "predicted left out there).", "",
           "| plan | batch | path | mode | steps/s | x loop | eager x min(all-GPU eager, floor) | the same, bf16 "
           "all-GPU | x floor | predicted steps/s | measured / predicted | tokens = loop's |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in decode:
        eager, bf16 = eager_ratios(decode, r)
        floor = r["steps_per_s"] / r["floor_steps_per_s"] if r["floor_steps_per_s"] else None
        pred = r["predicted_steps_per_s"]
        alike = r["batch"] > 1 and r["uva_bytes"] + r["prefetch_bytes"] > 0 and r["strategy"] != "prefetch"
        out.append(f"| {r['strategy']} | {r['batch']} | {r['path']} | {r['mode']} | {r['steps_per_s']:.1f} | "
                   f"{r['ratio_to_loop']:.3f} | {fmt(eager)} | {fmt(bf16)} | {fmt(floor)} | {fmt(pred, '.1f')} | "
                   f"{fmt(r['steps_per_s'] / pred if pred and not alike else None)} | {r['same_tokens_as_loop']} |")
    return out + [""]
