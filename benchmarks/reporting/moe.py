"""The MoE section (moe-*.jsonl, benchmarks/moe.py): every expert in pinned memory against the floor and the
all-GPU experts implementations, at batch 1 (8 and 48 layers) and batch 8 and 32 (48 layers)."""
from __future__ import annotations

from pathlib import Path

from .moe_routing import kernel_tables, predict_tables, skew_tables
from .records import RESULTS, read_rows, run_header


def moe_tables() -> list[str]:
    """benchmarks/moe.py's records: all-GPU per experts implementation, every expert in pinned memory against
    the floor, and (with --skew) per-expert budget placement against whole layers."""
    uniform, path = read_rows(RESULTS / "moe-qwen3-30b-a3b.jsonl"), RESULTS / "moe-qwen3-30b-a3b.jsonl"
    if not uniform:
        return []
    decoded = [r for r in uniform if r["kind"] == "decode"]
    batches = sorted({r["batch"] for r in decoded})
    floors = {r["batch"]: r for r in uniform if r["kind"] == "floor"}
    out = ["## Qwen3-30B-A3B (MoE): experts in pinned memory", "",
           "Qwen3-30B-A3B's shape (128 experts, top-8), 8 of its 48 layers, random bf16; greedy decode of 32 tokens "
           "after 16-token prompts. `graph`: one decode step with a static KV cache captured in a CUDA graph and "
           "replayed; `eager`: HF `generate`. The all-GPU models run transformers' own experts implementations "
           "(`batched_mm`, `grouped_mm`, and `eager`, its default Python loop over experts, which cannot be "
           "captured). The floor is the bytes of the unique experts routing touches per step (counted on the same "
           "prompts) over the UVA read bandwidth measured in the run.", "",
           "- " + run_header(path, uniform), ""]
    out += ["| batch | unique experts per layer per step | floor steps/s |", "|---|---|---|"]
    out += [f"| {b} | {floors[b]['unique_experts_per_layer']:.1f} | {floors[b]['floor_steps_per_s']:.1f} |"
            for b in batches if b in floors]
    out += ["", "Steps/s; for experts in pinned memory, (x floor, x the fastest all-GPU path in the same mode):", "",
            "| experts | implementation | mode | " + " | ".join(f"b={b}" for b in batches) + " |",
            "|---|---|---|" + "---|" * len(batches)]
    keys = list(dict.fromkeys((r["name"], r["implementation"], r["mode"]) for r in decoded))
    for name, impl, mode in keys:
        cells = []
        for b in batches:
            r = next((x for x in decoded if (x["name"], x["implementation"], x["mode"], x["batch"]) ==
                      (name, impl, mode, b)), None)
            if r is None:
                cells.append("-")
            elif r["offloaded"]:
                cells.append(f"{r['steps_per_s']:.2f} ({r['ratio_to_floor']:.2f}, {r['ratio_to_best_gpu']:.2f})")
            else:
                cells.append(f"{r['steps_per_s']:.1f}")
        where = "pinned memory" if name.startswith("experts-host") else "GPU"
        label = impl + (" (transformers' default loop)" if impl == "eager" else "")
        out.append(f"| {where} | {label} | {mode} | " + " | ".join(cells) + " |")
    same = all(r["same_tokens"] for r in decoded if r["implementation"] != "eager")
    out += ["", "Offplan's experts implementation reproduces `batched_mm`'s arithmetic up to 16 (token, expert) "
            "pairs and `grouped_mm`'s above (runtime/execute/experts.py); "
            "its tokens are compared with that all-GPU model's "
            f"in the same mode. Tokens equal in every run: **{'yes' if same else 'NO'}**."]
    repeat_path = RESULTS / "moe-qwen3-30b-a3b-repeat.jsonl"
    repeat = [r for r in read_rows(repeat_path) if r["kind"] == "decode" and r["name"] == "experts-host-offplan"]
    if repeat:
        out += ["", f"The same measurement in an earlier run (`{repeat_path.name}`, graph replay only), offplan's "
                "experts implementation with every expert in pinned memory: " + ", ".join(
                    f"b={r['batch']} {r['steps_per_s']:.2f} steps/s ({r['ratio_to_floor']:.2f} x floor)"
                    for r in repeat) + ". Between runs the ratio to the floor moved by up to 0.10."]
    return out + [""] + wide_tables() + b1_tables() + kernel_tables() + predict_tables() + skew_tables()


def wide_tables() -> list[str]:
    """moe.py at batch 8 and 32 with all 48 layers, graph replay: every expert on host against the floor."""
    path = RESULTS / "moe-qwen3-30b-a3b-b8-b32-48layers.jsonl"
    rows = read_rows(path)
    decoded = [r for r in rows if r["kind"] == "decode"]
    if not decoded:
        return []
    batches = sorted({r["batch"] for r in decoded})
    floors = {r["batch"]: r for r in rows if r["kind"] == "floor"}
    out = ["### All 48 layers at batch 8 and 32", "",
           "- " + run_header(path, rows), "",
           "The same measurement with the real layer count (61 GB), graph replay, `grouped_mm` only: at these batches "
           "transformers' `batched_mm` copies a weight per (token, expert) pair at prefill, 24 GiB at batch 32, which "
           "does not fit beside the model. Each cell: steps/s (x floor, for experts in pinned memory).", "",
           "| experts | load | " + " | ".join(f"b={b}" for b in batches) + " |", "|---|---|" + "---|" * len(batches),
           "| floor: unique experts per layer per step | | " + " | ".join(
               f"{floors[b]['unique_experts_per_layer']:.1f}: {floors[b]['floor_steps_per_s']:.2f} steps/s"
               for b in batches) + " |"]
    for name in dict.fromkeys(r["name"] for r in decoded):
        cells = []
        for b in batches:
            r = next((x for x in decoded if (x["name"], x["batch"]) == (name, b)), None)
            cells.append("-" if r is None else f"{r['steps_per_s']:.2f} ({r['ratio_to_floor']:.3f} x floor)"
                         if r["offloaded"] else f"{r['steps_per_s']:.1f}")
        where = "pinned memory, offplan" if name.startswith("experts-host") else "GPU, " + name.split("-", 1)[1]
        load = "transformers alone" if name.startswith("transformers-") else "plan applied"
        out.append(f"| {where} | {load} | " + " | ".join(cells) + " |")
    same = all(r["same_tokens"] for r in decoded)
    return out + ["", f"Tokens equal to transformers alone with `grouped_mm` in every row: **{'yes' if same else 'NO'}**.",
                  ""]


B1_RUNS = {  # the batch-1 tables: their runs, each a moe.py run of its own (floor and baselines measured in it)
    "8 of its 48 layers": (["moe-qwen3-30b-a3b-b1.jsonl"], ""),
    "all 48 layers": (
        ["moe-qwen3-30b-a3b-b1-48layers-graph.jsonl", "moe-qwen3-30b-a3b-b1-48layers-compiled-graph.jsonl"],
        "The real layer count, which the H100 machine's disk holds (61 GB). The time between steps, from the last "
        "layer's gathers through the head to the first layer's router, when no expert can be read yet "
        "(runtime/execute/lookahead.py, Limits), is the same at any layer count: 3-4% of an 8-layer step, under 1% of "
        "this one."),
}


def b1_tables() -> list[str]:
    """moe.py at batch 1 in graph and compiled-graph modes: transformers alone, the plan applied, experts on host;
    one table per layer count (B1_RUNS)."""
    out = ["## Qwen3-30B-A3B (MoE) at batch 1: the plan applied, and compiled CUDA graphs", "",
           "`graph`: one decode step captured in a CUDA graph and replayed, as above; `compiled-graph`: the same with "
           "the model under `torch.compile` first (Inductor fuses the layers' small kernels; vLLM serves this way "
           "by default). `transformers alone`: `from_pretrained` onto the GPU, nothing of offplan's; `plan "
           "applied`: offplan's runtime applying a plan that offloads nothing. Each cell: steps/s (x transformers "
           "alone with the same implementation, for the plan applied; x floor, for experts in pinned memory); "
           "x the fastest all-GPU path in the same mode. Each ratio is against the floor and the baselines of its "
           "own run. Experts in pinned memory are read with the runtime's experts lookahead "
           "(runtime/execute/lookahead.py: "
           "the next layer's 2 guessed experts read ahead while the GPU computes), and with it switched off in the "
           "same run (`lookahead off`, `--lookahead-ab`). Older runs on this page predate the lookahead.", ""]
    shown = False
    for title, (names, note) in B1_RUNS.items():
        table = _b1_table(title, [RESULTS / n for n in names])
        out += table + ([note, ""] if table and note else [])
        shown = shown or bool(table)
    return out if shown else []


def _b1_table(title: str, paths: list[Path]) -> list[str]:
    runs = [(path, read_rows(path)) for path in paths]
    runs = [(path, rows) for path, rows in runs if rows]
    decoded = [r for _, rows in runs for r in rows if r["kind"] == "decode" and r["batch"] == 1]
    if not decoded:
        return []
    alone = {(r["implementation"], r["mode"]): r["steps_per_s"] for r in decoded
             if r["name"].startswith("transformers-")}
    out = [f"### {title}", ""] + ["- " + run_header(path, rows) for path, rows in runs]
    out += ["", "| load | experts | implementation | graph | compiled-graph |", "|---|---|---|---|---|"]
    keys = list(dict.fromkeys((r["name"], r["implementation"]) for r in decoded))
    for name, impl in keys:
        cells = []
        for mode in ("graph", "compiled-graph"):
            r = next((x for x in decoded if (x["name"], x["implementation"], x["mode"]) == (name, impl, mode)), None)
            if r is None:
                cells.append("-")
                continue
            first = (f"{r['ratio_to_floor']:.3f} x floor" if r["offloaded"] else
                     "" if name.startswith("transformers-") else
                     f"{r['steps_per_s'] / alone[(impl, mode)]:.3f} x alone")
            cells.append(f"{r['steps_per_s']:.1f} ({first + ', ' if first else ''}"
                         f"{r['ratio_to_best_gpu']:.2f} x best)")
        load = "transformers alone" if name.startswith("transformers-") else "plan applied"
        where = "pinned memory" if name.startswith("experts-host") else "GPU"
        where += ", lookahead off" if name.endswith("-no-lookahead") else ""
        out.append(f"| {load} | {where} | {impl} | " + " | ".join(cells) + " |")
    same = all(r["same_tokens"] for r in decoded)
    floors = []
    for path, rows in runs:
        f = next(r for r in rows if r["kind"] == "floor" and r["batch"] == 1)
        modes = [m for m in ("graph", "compiled-graph") if any(r.get("mode") == m for r in rows)]
        layers = f" x {f['layers']} layers" if "layers" in f else ""
        floors.append(f"{f['floor_steps_per_s']:.1f} steps/s in the {' and '.join(modes)} run "
                      f"({f['unique_experts_per_layer']:.0f} experts{layers}, {f['bytes_per_step'] / 1e6:.0f} MB, at "
                      f"its UVA rate, {f['uva_read_gbps']} GB/s)")
    out += ["", f"Floor at batch 1: {'; '.join(floors)}. Tokens equal to transformers alone with the same "
            f"implementation, in the same mode, in every row: **{'yes' if same else 'NO'}**."]
    return out + _rescaled(runs) + [""]


def _rescaled(runs: list[tuple[Path, list[dict]]]) -> list[str]:
    """Where a table's runs calibrated different UVA rates: each offloaded row's ratio at the fastest run's rate."""
    rate = {path: next(r for r in rows if r["kind"] == "hardware")["uva_read_gbps"] for path, rows in runs}
    top = max(rate.values())
    slower = [(path, r) for path, rows in runs if rate[path] < top for r in rows
              if r["kind"] == "decode" and r["batch"] == 1 and r["offloaded"]]
    if not slower:
        return []
    return [f"The runs calibrated UVA at {', '.join(f'{g} GB/s' for g in rate.values())}; at {top} GB/s the floor "
            "ratios would read: " + ", ".join(
                f"{r['mode']}{' (lookahead off)' if r['name'].endswith('-no-lookahead') else ''} "
                f"{r['ratio_to_floor'] * rate[path] / top:.3f}" for path, r in slower) + "."]
