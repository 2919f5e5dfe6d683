"""Turn benchmarks/results/*.jsonl into benchmarks/RESULTS.md and benchmarks/decode.png.

    python benchmarks/report.py            # needs matplotlib for the plot

Ratios are recomputed here from the raw records: the limit at batch b for a
plan offloading B bytes is 1 / max(B / H2D floor of the same run, the best
all-GPU step time at b measured for that model). The MoE section
(moe-*.jsonl, benchmarks/moe.py) and the prefill section (prefill-*.jsonl,
benchmarks/prefill.py) take their ratios from the records, each against the
floor and the fastest all-GPU path of the same run.
"""
from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from planner.files import write_atomic

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
STRATEGIES = ["accelerate", "uva-64b", "uva", "prefetch", "mixed"]
LABELS = {"uva-64b": "uva, arena base 64 B past a page (before alignment)"}
def load() -> dict[str, dict]:
    models: dict[str, dict] = defaultdict(lambda: {"runs": [], "decode": [], "gpu": defaultdict(float),
                                                   "static": [], "static_gpu": defaultdict(float)})
    for path in sorted(RESULTS.glob("decode-*.jsonl")):
        floor, model, info = None, None, {}
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if r["kind"] == "checkpoint":
                model, info = r["model"], r
            elif r["kind"] == "hardware":
                floor = r["h2d_copy_gbps"]
                models[model]["runs"].append({"file": path.name, "hardware": r, "checkpoint": info})
            elif r["kind"] == "decode":
                r["floor"] = floor
                r["file"] = path.name
                static = r.get("mode", "eager") != "eager"
                models[model]["static" if static else "decode"].append(r)
                if r["strategy"] == "gpu":
                    g = models[model]["static_gpu" if static else "gpu"]
                    key = r["mode"] if static else r["batch"]
                    g[key] = max(g[key], r["steps_per_s"])
    for m in models.values():
        for r in m["decode"] + m["static"]:
            best = m["static_gpu"].get(r["mode"]) if "mode" in r and r["mode"] != "eager" else m["gpu"].get(r["batch"])
            r["limit"] = 1 / max(r["offloaded_bytes"] / (r["floor"] * 1e9), 1 / best if best else 0)
            r["ratio"] = r["steps_per_s"] / r["limit"]
    return models


def pick(m, strategy, fraction, batch, name=None):
    for r in m["decode"]:
        if r["strategy"] == strategy and r["fraction"] == fraction and r["batch"] == batch and \
                (name is None or r["name"] == name):
            return r
    return None


def fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def model_tables(name: str, m: dict) -> list[str]:
    out = [f"## {name}", ""]
    for run in m["runs"]:
        hw, ck = run["hardware"], run["checkpoint"]
        out.append(f"- `{run['file']}`: {ck.get('tensors')} tensors, {ck.get('bytes', 0) / 1e9:.1f} GB on "
                   f"{hw['name']}, torch {ck.get('torch')}; calibrated in the same run: H2D copy "
                   f"{hw['h2d_copy_gbps']} GB/s, UVA GEMV {hw['uva_read_gbps']} GB/s, HBM GEMV "
                   f"{hw['hbm_read_gbps']} GB/s, CPU {hw['layer_overhead_us']} us/layer + "
                   f"{hw.get('step_overhead_us', 0)} us/step")
    batches = sorted(m["gpu"])
    out += ["", "Decode steps per second (one new token per sequence per step), and the ratio to the limit:", "",
            "| strategy | offloaded | " + " | ".join(f"b={b} steps/s (x limit)" for b in batches) + " |",
            "|---|---|" + "---|" * len(batches)]
    out.append("| all on GPU (best of the runs) | 0 | " + " | ".join(f"{m['gpu'][b]:.2f}" for b in batches) + " |")
    spread = []
    for b in batches:
        runs = [r["steps_per_s"] for r in m["decode"] if r["strategy"] == "gpu" and r["batch"] == b]
        if len(runs) > 1 and min(runs) < 0.8 * max(runs):
            spread.append(f"{' and '.join(f'{x:.1f}' for x in runs)} at b={b}")
    if spread:
        out += ["", f"All-GPU ran first and last in each run and measured {'; '.join(spread)} steps/s; the table "
                "takes the faster. The slow one is the first decode of the process; why was not established."]
    fractions = sorted({r["fraction"] for r in m["decode"] if r["strategy"] != "gpu"}, key=str)
    for f in fractions:
        for s in STRATEGIES:
            rows = [pick(m, s, f, b) for b in batches]
            if not any(rows):
                continue
            label = "mixed, every expert off the GPU" if f == 1.0 else f"{LABELS.get(s, s)} {int(f * 100)}% of layers"
            off = next(r for r in rows if r)["offloaded_bytes"] / 1e9
            out.append(f"| {label} | {off:.2f} GB | " + " | ".join(
                "-" if r is None else f"{r['steps_per_s']:.2f} ({r['ratio']:.2f})" for r in rows) + " |")
    out += ["", f"Predicted against measured step time (ms), batch {' / '.join(map(str, batches))}:", "",
            "| plan | " + " | ".join(f"b={b} predicted / measured (error)" for b in batches) + " |",
            "|---|" + "---|" * len(batches)]
    for f in fractions:
        for s in ("uva-64b", "uva", "prefetch", "mixed"):
            rows = [pick(m, s, f, b) for b in batches]
            if not any(rows):
                continue
            label = "mixed, every expert off" if f == 1.0 else f"{s} {int(f * 100)}%"
            out.append(f"| {label} | " + " | ".join(
                "-" if r is None else f"{r['predicted_step_ms']:.1f} / {r['measured_step_ms']:.1f} "
                f"({(r['predicted_step_ms'] / r['measured_step_ms'] - 1) * 100:+.0f}%)" for r in rows) + " |")
    out += ["", "Loading (checkpoint on local disk, page cache warm):", "",
            "| plan | load GB/s | peak GPU during load | plan's GPU footprint | pinned host | pinned / offloaded |",
            "|---|---|---|---|---|---|"]
    seen = set()
    for r in m["decode"]:
        if r["name"] in seen or r["batch"] != batches[0]:
            continue
        seen.add(r["name"])
        off = (r["uva_bytes"] or 0) + (r["prefetch_bytes"] or 0)
        out.append(f"| {r['name']} | {fmt(r['load_gb_per_s'], '.1f')} | "
                   f"{fmt(r['peak_gpu_bytes_during_load'] / 2**30 if r['peak_gpu_bytes_during_load'] else None)} GiB | "
                   f"{fmt(r['gpu_footprint_bytes'] / 2**30 if r['gpu_footprint_bytes'] else None)} GiB | "
                   f"{fmt(r['pinned_host_bytes'] / 2**30 if r['pinned_host_bytes'] is not None else None)} GiB | "
                   f"{fmt(r['pinned_host_bytes'] / off if off and r['pinned_host_bytes'] else None, '.4f')} |")
    if m["static"]:
        out += ["", "Batch 1 with a static KV cache, without Python overhead (CUDA graph replay of one decode step, "
                "or torch.compile): steps/s (x limit):", "",
                "| plan | mode | steps/s | x limit | tokens equal all-GPU's (same mode) |", "|---|---|---|---|---|"]
        for r in m["static"]:
            out.append(f"| {r['name']} | {r['mode']} | {r['steps_per_s']:.2f} | {r['ratio']:.2f} | "
                       f"{'yes' if r['same_tokens'] else 'no'} |")
        out += ["", "The compiled runs use Inductor's defaults. Its fusions differ where the offload ops split the "
                "graph at layer boundaries, so bf16 rounding, and then greedy tokens, can differ from the compiled "
                "all-GPU model; with `torch._inductor.config.emulate_precision_casts = True` compiled offloaded "
                "logits equal eager ones bitwise (tests/test_compile*.py). Graph replays run the eager kernels: "
                "their tokens are equal."]
    same = all(r["same_tokens"] for r in m["decode"])
    out += ["", f"Greedy tokens equal to all-GPU's in every run: **{'yes' if same else 'NO'}**.", ""]
    return out


def align_table() -> list[str]:
    """The arena alignment measurement (benchmarks/uva_align.py): median over its rounds."""
    path = RESULTS / "uva-align.jsonl"
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines()]
    device = records[0]
    runs: dict[str, list[dict]] = defaultdict(list)
    for r in records[1:]:
        runs[r["variant"]].append(r)
    keys = [k for k in records[1] if k.startswith("gemv_b")] + ["h2d"]
    rounds = max(len(v) for v in runs.values())
    out = ["## Arena alignment: UVA reads against where the pinned memory starts", "",
           f"`{path.name}`: {device['device']}, torch {device['torch']}; {device['bytes'] / 1e9:.2f} GB of bf16 "
           f"weights ([14336, 4096] x 8) read by GEMVs through a zero-copy view, and copied to the GPU in one piece; "
           f"GB/s, median of {rounds} rounds (each the median of 20 repeats).", "",
           "| host memory behind the view | start mod 4096 | " + " | ".join(
               [f"UVA GEMV b={k[6:]}" for k in keys[:-1]] + ["H2D copy"]) + " |",
           "|---|---|" + "---|" * len(keys)]
    for name, rs in runs.items():
        bases = ", ".join(str(b) for b in sorted({r["base_mod_4096"] for r in rs}))
        out.append(f"| {name} | {bases} | " + " | ".join(
            f"{statistics.median(r[k] for r in rs):.1f}" for k in keys) + " |")
    out += ["", "A tensor that starts 64 bytes past a 256-byte boundary is read about 16% slower in place; any "
            "256-byte-aligned start reads as fast as `cudaHostAlloc` memory. The arena now starts on a page and "
            "keeps tensors 256 bytes apart (runtime/arena.py); the `uva-64b` rows of the decode tables load the "
            "same plan into an arena started 64 bytes past a page, as before, in the same run.", ""]
    return out


def _moe_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _moe_header(path: Path, rows: list[dict]) -> str:
    ck = next(r for r in rows if r["kind"] == "checkpoint")
    hw = next(r for r in rows if r["kind"] == "hardware")
    return (f"`{path.name}`: {ck['tensors']} tensors, {ck['bytes'] / 1e9:.1f} GB on {ck['device']}, torch "
            f"{ck['torch']}; calibrated in the same run: UVA GEMV {hw['uva_read_gbps']} GB/s, H2D copy "
            f"{hw['h2d_copy_gbps']} GB/s")


def moe_tables() -> list[str]:
    """benchmarks/moe.py's records: all-GPU per experts implementation, every expert in pinned memory against
    the floor, and (with --skew) per-expert budget placement against whole layers."""
    uniform, path = _moe_rows(RESULTS / "moe-qwen3-30b-a3b.jsonl"), RESULTS / "moe-qwen3-30b-a3b.jsonl"
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
           "- " + _moe_header(path, uniform), ""]
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
            "pairs and `grouped_mm`'s above (runtime/experts.py); its tokens are compared with that all-GPU model's "
            f"in the same mode. Tokens equal in every run: **{'yes' if same else 'NO'}**."]
    repeat_path = RESULTS / "moe-qwen3-30b-a3b-repeat.jsonl"
    repeat = [r for r in _moe_rows(repeat_path) if r["kind"] == "decode" and r["name"] == "experts-host-offplan"]
    if repeat:
        out += ["", f"The same measurement in an earlier run (`{repeat_path.name}`, graph replay only), offplan's "
                "experts implementation with every expert in pinned memory: " + ", ".join(
                    f"b={r['batch']} {r['steps_per_s']:.2f} steps/s ({r['ratio_to_floor']:.2f} x floor)"
                    for r in repeat) + ". Between runs the ratio to the floor moved by up to 0.10."]
    return out + [""] + wide_tables() + b1_tables() + kernel_tables() + predict_tables() + skew_tables()


def wide_tables() -> list[str]:
    """moe.py at batch 8 and 32 with all 48 layers, graph replay: every expert on host against the floor."""
    path = RESULTS / "moe-qwen3-30b-a3b-b8-b32-48layers.jsonl"
    rows = _moe_rows(path)
    decoded = [r for r in rows if r["kind"] == "decode"]
    if not decoded:
        return []
    batches = sorted({r["batch"] for r in decoded})
    floors = {r["batch"]: r for r in rows if r["kind"] == "floor"}
    out = ["### All 48 layers at batch 8 and 32", "",
           "- " + _moe_header(path, rows), "",
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
        "(runtime/lookahead.py, Limits), is the same at any layer count: 3-4% of an 8-layer step, under 1% of "
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
           "own run. Experts in pinned memory are read with the runtime's experts lookahead (runtime/lookahead.py: "
           "the next layer's 2 guessed experts read ahead while the GPU computes), and with it switched off in the "
           "same run (`lookahead off`, `--lookahead-ab`). Older runs on this page predate the lookahead.", ""]
    shown = False
    for title, (names, note) in B1_RUNS.items():
        table = _b1_table(title, [RESULTS / n for n in names])
        out += table + ([note, ""] if table and note else [])
        shown = shown or bool(table)
    return out if shown else []


def _b1_table(title: str, paths: list[Path]) -> list[str]:
    runs = [(path, _moe_rows(path)) for path in paths]
    runs = [(path, rows) for path, rows in runs if rows]
    decoded = [r for _, rows in runs for r in rows if r["kind"] == "decode" and r["batch"] == 1]
    if not decoded:
        return []
    alone = {(r["implementation"], r["mode"]): r["steps_per_s"] for r in decoded
             if r["name"].startswith("transformers-")}
    out = [f"### {title}", ""] + ["- " + _moe_header(path, rows) for path, rows in runs]
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


def kernel_tables() -> list[str]:
    """moe_kernels.py: GPU time per kernel of one graph-replayed batch-1 decode step, per placement."""
    path = RESULTS / "moe-kernels-qwen3-30b-a3b.jsonl"
    rows = _moe_rows(path)
    steps = [r for r in rows if r["kind"] == "step"]
    if not steps:
        return []
    gather = {r["name"]: r["us"] for r in rows if r["kind"] == "kernel" and r["kernel"] == "_gather_kernel"}
    out = ["### Where a batch-1 step's time goes", "",
           f"`{path.name}` (`python benchmarks/moe_kernels.py --layers 8 --skew 0.7 --resident 0.25 0.5 "
           "--compiled`): one decode step replayed 50 times under `torch.profiler`; every kernel's GPU time summed. "
           "The gather is offplan's experts gather (runtime/experts.py), which reads host experts through the "
           "zero-copy view; gaps: the step's time less its kernels' (the GPU idle between a graph's kernels). The "
           "replayed step repeats one token, so the budget plans' bytes are those of that token's experts.", "",
           "| placement | step us | kernels | kernel us | gather us | other kernels us | gaps us | pinned MB per step "
           "| gather GB/s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in steps:
        g = gather.get(r["name"], 0.0)
        rate = f"{r['host_bytes_per_step'] / g / 1e3:.1f}" if g and r["name"].startswith("experts-host") else "-"
        out.append(f"| {r['name']} | {r['step_us']:.0f} | {r['kernels']} | {r['kernel_us']:.0f} | {g:.0f} | "
                   f"{r['kernel_us'] - g:.0f} | {r['gap_us']:.0f} | {r['host_bytes_per_step'] / 1e6:.0f} | {rate} |")
    host = next((r for r in steps if r["name"] == "experts-host-offplan"), None)
    comp = next((r for r in steps if r["name"] == "experts-host-offplan-compiled"), None)
    if host and comp:
        out += ["", f"With every expert in pinned memory the gather reads at the UVA rate: the link is saturated "
                f"while it runs. The rest, {host['step_us'] - gather['experts-host-offplan']:.0f} us a step "
                f"({comp['step_us'] - gather['experts-host-offplan-compiled']:.0f} us compiled), is attention, "
                "routing, the experts' GEMVs over the staged rows and the head, and it cannot overlap the gather: "
                "a layer's experts are known only after its router runs, and the next layer needs their output. "
                "That is what kept batch 1 under 0.95x the floor (the floor counts only the link). This profile "
                "was taken before the runtime read guessed experts ahead in that time (runtime/lookahead.py; its "
                "gain: the batch-1 table above)."]
    return out + [""]


def predict_tables() -> list[str]:
    """moe_predict.py: how often the next layer's router, applied to this layer's experts input, names experts
    that the next layer's router then picks."""
    runs = {p.name: _moe_rows(p) for p in sorted(RESULTS.glob("moe-predict-qwen3-30b-a3b*.jsonl"))}
    if not runs:
        return []
    first = next(iter(runs.values()))[0]
    out = ["### Predicting the next layer's experts", "",
           "`python benchmarks/moe_predict.py --layers 8` (and `--skew 0.7`): greedy decode of "
           f"{first['decode_steps']} steps, all on the GPU; for each of the {first['layers'] - 1} pairs of "
           "consecutive MoE layers, the next layer's router applied to this layer's experts input (pre-gating) "
           f"names its top S experts; the share of them among the {first['top_k']} the next layer's router then "
           "picks. Random weights, not a trained model.", "",
           "| routing | " + " | ".join(f"top {r['predicted']}" for r in next(iter(runs.values()))) + " |",
           "|---|" + "---|" * len(next(iter(runs.values())))]
    for name, rows in runs.items():
        label = "uniform (random weights)" if rows[0]["skew"] is None else f"RouterSkew {rows[0]['skew']:g}"
        out.append(f"| {label} | " + " | ".join(f"{r['precision']:.1%}" for r in rows) + " |")
    out += ["", "At batch 1 the link idles for about 250 us a layer (\"Where a batch-1 step's time goes\"), time "
            "enough for one or two experts of this shape (9.4 MB each). The runtime reads the top 2 guessed "
            "experts of the next layer ahead in that time (runtime/lookahead.py): on a side stream, once the "
            "layer's gather is done, by one kernel of 8 programs (51 GB/s, the SMs left to the compute stream), "
            "rank by rank until the next layer's gather needs the link, which then takes the guessed experts' "
            "completed blocks from HBM. An earlier trial with a gather of a full grid on the side stream held the "
            "SMs and slowed the compute stream's small kernels tenfold; one that always read two whole experts "
            "outlasted the idle time.", ""]
    return out


def skew_tables() -> list[str]:
    """moe-qwen3-30b-a3b-skew*.jsonl: the run with the random model's own routing first, then with --spread."""
    paths = sorted(RESULTS.glob("moe-qwen3-30b-a3b-skew*.jsonl"), key=lambda p: ("spread" in p.name, p.name))
    return [line for p in paths for line in _skew_table(p)]


def _skew_table(path: Path) -> list[str]:
    rows = _moe_rows(path)
    if not rows:
        return []
    skew = next(r for r in rows if r["kind"] == "skew")
    spread = next((r for r in rows if r["kind"] == "spread"), None)
    prof = next(r for r in rows if r["kind"] == "profile")
    budget = [r for r in rows if r["kind"] == "decode" and "resident_fraction" in r]
    gpu = {r["batch"]: r for r in rows if r["kind"] == "prediction"}
    title = "" if spread is None else f", each token routed apart (`--spread {spread['strength']:g}`)"
    out = [f"## Qwen3-30B-A3B (MoE), skewed routing{title}: per-expert placement under a GPU budget", "",
           f"Random weights route almost uniformly; real routers do not. Here every router sees a fixed bias "
           f"(benchmarks/moe.py `RouterSkew`, strength {skew['strength']}): expert logits move by "
           f"-{skew['strength']} sigma ln(rank), ranks in a random order per layer. It is synthetic. Strength 0.7 "
           "was picked in a simulation over Gaussian logits (44% of the experts take 90% of the hits) to match "
           "published counts for Qwen3-30B-A3B (llama.cpp imatrix counts: 58 of 128 experts, 45%, on a narrow "
           "workload, 65 on a diverse one). On this model the routing profile, "
           f"recorded on other prompts than the timed ones ({prof['decode_tokens']} decode tokens), gives 90% of "
           f"the decode hits to {prof['experts_for_90pct']:.0f} of 128 experts (the simulation: 56), "
           f"{prof['top_quarter_share']:.0%} to the top quarter, {prof['top_half_share']:.0%} to the top half."
           + ("" if spread is None else
              " The routers also see moe.py's `RouterSpread`: a random model's hidden states collapse with depth, "
              "so each of its sequences routes to a few experts of its own; spread, each token is routed apart, "
              "as a trained router does, and the timed prompts route as the profile's did. The spread widens the "
              "logits about 2.2x (noise of twice the input's RMS), so the bias needs about that much more "
              "strength for the same skew."), "",
           "- " + _moe_header(path, rows), "",
           "Each budget holds the dense weights and the given share of the expert bytes. Per expert: `backend: "
           "mixed` with the profile in `workload.routing`, which keeps the most-hit experts of every layer on the GPU. "
           "Whole layers: every expert of the first layers on uva, the rest on the GPU, the same bytes resident "
           "(the best whole-layer plan here: reading a layer's touched experts in place moves fewer bytes than "
           "copying the layer). Both plans predict graph replay (`workload.cuda_graphs: true`); graph replay "
           "measured; link MB/step observed = the bytes of host experts routing touched per step on the timed "
           "prompts.", "",
           "Predicted: the plan's own prediction (planner/cost.py, with the hardware calibrated in the run, GPU "
           "time per layer included); predicted / measured: 1.00 is exact, above 1 optimistic. At observed bytes: "
           "the same prediction with the link bytes the timed prompts actually read (the observed bytes over the "
           "run's UVA rate in place of the predicted ones): what is left of the miss is the model's arithmetic, "
           "not the routing.", "",
           "| experts resident | batch | placement | steps/s | x whole layers | predicted steps/s | predicted / "
           "measured | link MB/step: observed / predicted | predicted at observed bytes / measured | tokens equal |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    uva = next(r for r in rows if r["kind"] == "hardware")["uva_read_gbps"] * 1e3  # bytes per us
    by = {(r["name"].rsplit("-", 1)[0], r["resident_fraction"], r["batch"]): r for r in budget}
    worst, ratios = 0.0, []
    for (name, fraction, b), r in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        whole = by.get(("whole-layers-uva", fraction, b))
        mb = r["predicted_h2d_bytes_per_step"].get(str(b))
        guess, got = r["predicted_steps_per_s"], r["steps_per_s"]
        at_observed = 1e6 / (1e6 / guess + (r["observed_h2d_bytes_per_step"] - mb) / uva)
        worst = max(worst, abs(at_observed / got - 1))
        ratios.append(guess / got)
        out.append(f"| {fraction:.0%} | {b} | {name} | {got:.1f} | {got / whole['steps_per_s']:.2f} | "
                   f"{guess:.1f} | {guess / got:.2f} | {r['observed_h2d_bytes_per_step'] / 1e6:.0f} / "
                   f"{mb / 1e6:.0f} | {at_observed / got:.2f} | {'yes' if r['same_tokens'] else 'NO'} |")
    if gpu:
        out += ["", "For the all-GPU plan the model predicts " + ", ".join(
                    f"{g['predicted_steps_per_s']:.0f} steps/s at b={b} where {g['best_gpu_implementation']} "
                    f"measured {g['best_gpu_steps_per_s']:.0f} "
                    f"({g['predicted_steps_per_s'] / g['best_gpu_steps_per_s']:.2f})" for b, g in sorted(gpu.items())) +
                ". Its GPU time per layer is calibrated at batch 1 (`plan calibrate`: graph-replayed tiny models), "
                "so larger batches, whose kernels take longer, are predicted optimistic. "
                + (f"Predicted / measured spans {min(ratios):.2f} to {max(ratios):.2f} over the budget rows; at the "
                   f"observed bytes, within {worst:.0%} in every row." if spread is not None else
                   "Its link bytes hold for whole layers. Per expert, the timed prompts (one sequence at b=1, eight "
                   "at b=8, greedy decodes of random tokens) hit more of the experts the profile ranked low than the "
                   "profile's own prompts did, up to 2x the predicted bytes at 50% resident, where they are tens of "
                   f"MB; at the observed bytes the prediction is within {worst:.0%} of the measurement in every "
                   "row.")]
    host = [r for r in rows if r["kind"] == "decode" and r["name"] == "experts-host-offplan"]
    if host:
        out += ["", "Every expert in pinned memory, in the same run (the floor from the unique experts the skewed "
                "routing touches): " + ", ".join(f"b={r['batch']} {r['steps_per_s']:.1f} steps/s "
                                                 f"({r['ratio_to_floor']:.2f} x floor)" for r in host) + "."]
    return out + [""]


PREFILL_LABELS = {"gpu": "all on GPU", "uva": "uva, staged for prefill", "uva-in-place": "uva, read in place",
                  "uva-gathered": "uva, staged, experts gathered", "prefetch": "prefetch", "mixed": "mixed",
                  "experts-host": "every routed expert on uva, staged",
                  "experts-host-gathered": "every routed expert on uva, gathered"}


def prefill_tables() -> list[str]:
    """prefill-*.jsonl (benchmarks/prefill.py): time to first token against the link floor and the prefetch plan,
    and decode at batch 1 beside it, all from one run per model."""
    out = []
    for path in sorted(RESULTS.glob("prefill-*.jsonl")):
        rows = _moe_rows(path)
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
        touched = " ".join(f"{r['tokens']}: {r['link_bytes'] / r['offloaded_bytes']:.0%}," for r in experts).rstrip(",")
        out += [f"## {ck['model']}: prefill (time to first token) with half the decoder layers offloaded{routing}", "",
                f"`{path.name}`: {ck['bytes'] / 1e9:.1f} GB on {ck['device']}, torch {ck['torch']}; calibrated in "
                f"the same run: H2D copy {hw['h2d_copy_gbps']} GB/s, UVA {hw['uva_read_gbps']} GB/s, GEMMs "
                f"{hw.get('matmul_tflops', '?')} TFLOP/s, uva layers staged above {hw.get('stage_above_tokens', '?')} "
                "tokens. One prompt, a fresh cache, the logits of the last position (generate's prefill); median of "
                "3 after a warm-up. Floor = max(link bytes / H2D copy, all-GPU prefill), the link bytes being the "
                "offloaded ones, a routed expert on uva only if the prompt routes a token to it"
                + (", an embedding on uva by the rows of the prompt's tokens. Each cell: ms, x floor, x the prefetch "
                   "plan. `=`: logits bitwise equal to all-GPU's. `staged`: routed experts on uva streamed through "
                   "the expert ring ahead of their layer at prefill (`uva: {stage_experts: true}`; runtime/ring.py, "
                   "at most 1 GiB allocated per prefill, not in the footprint)" if ring else
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
    runs = [_moe_rows(p) for p in sorted(RESULTS.glob("staging-ab-*.jsonl"))]
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


def quantized_tables() -> list[str]:
    """quantized-*.jsonl (benchmarks/quantized.py): FP8 kept quantized against the same model in bf16."""
    out = []
    for path in sorted(RESULTS.glob("quantized-*.jsonl")):
        rows = _moe_rows(path)
        sizes = {r["name"]: r["bytes"] for r in rows if r["kind"] == "checkpoint"}
        hw = next((r for r in rows if r["kind"] == "hardware"), {})
        out += [f"## {path.stem.removeprefix('quantized-')}: FP8 experts in host memory against bf16", "",
                f"`{path.name}` (8 decoder layers): block-scaled FP8 ({sizes.get('fp8', 0) / 1e9:.1f} GB: every "
                "`*_proj.weight` F8_E4M3 with 128 x 128 scales, written as DeepSeek-V3 ships it) against the same "
                f"model dequantized on the host to bf16 ({sizes.get('bf16', 0) / 1e9:.1f} GB). FP8 stays FP8 in host "
                "memory and in HBM; a module reads it dequantized, routed experts only where touched "
                f"(runtime/quant.py). UVA {hw.get('uva_read_gbps', '?')} GB/s measured in the run. Batch 1, greedy, "
                "64 new tokens. Floor: the bytes of the 8 experts a token touches per layer (FP8: their bytes and "
                "scales) over the UVA bandwidth. Tokens: FP8 against the bf16 model in the same placement and mode. "
                "Compare the graph rows: eager `generate` is CPU-bound here, and the run's first decode (bf16, "
                "experts on host, eager) reads low, as the first decode of every process does in prefill.py's runs.",
                "", "| placement | checkpoint | mode | steps/s | x floor | x bf16 | same tokens |", "|---|---|---|---|---|---|---|"]
        for r in rows:
            if r["kind"] == "decode":
                out.append(f"| {r['strategy']} | {r['checkpoint']} | {r['mode']} | {r['steps_per_s']:.1f} | "
                           f"{fmt(r['ratio_to_floor'])} | {fmt(r['ratio_to_bf16'])} | "
                           f"{'-' if r['same_tokens_as_bf16'] is None else r['same_tokens_as_bf16']} |")
        out.append("")
    return out


def plot(models: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return False
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, (name, m) in zip(axes[0], sorted(models.items())):
        fractions = [0.25, 0.5, 0.75]
        gpu = m["gpu"].get(1)
        for s, style, color in zip(STRATEGIES, ["s:", "x:", "o-", "^-", "D-"], ["C0", "C4", "C1", "C2", "C3"]):
            pts = [(f, pick(m, s, f, 1)) for f in fractions]
            pts = [(f, r["steps_per_s"]) for f, r in pts if r]
            if pts:
                ax.plot([0] + [p[0] for p in pts], [gpu] + [p[1] for p in pts], style, color=color,
                        label=LABELS.get(s, s))
        every = pick(m, "mixed", 1.0, 1)
        if every:
            ax.plot([1.0], [every["steps_per_s"]], "*", color="C3", markersize=14,
                    label="mixed, every expert off the GPU")
        limit = []
        for f in fractions:
            r = pick(m, "prefetch", f, 1)
            if r:
                limit.append((f, r["limit"]))
        ax.plot([0] + [p[0] for p in limit], [gpu] + [p[1] for p in limit], "k--", label="limit (PCIe floor)")
        ax.axhline(gpu, color="grey", lw=0.8, label="all on GPU")
        ax.set_yscale("log")
        ax.set_xlabel("fraction of decoder layers offloaded (1.0: every expert)" if every else
                      "fraction of decoder layers offloaded")
        ax.set_ylabel("decode tokens/s per sequence, batch 1")
        ax.set_title(name)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> int:
    models = load()
    lines = ["# Decode benchmark results", "",
             "Produced by `benchmarks/decode.py` and `benchmarks/moe.py` on the project's H100 (PCIe Gen5) machine "
             "and summarised by "
             "`python benchmarks/report.py` from the raw records in `benchmarks/results/`. Commands:", "",
             "```sh",
             "python benchmarks/uva_align.py",
             "python benchmarks/decode.py --model llama-8b --fractions 0.5 --batches 1 8 --accelerate-batches 1 8 "
             "--strategies accelerate uva uva-64b prefetch mixed",
             "python benchmarks/moe.py --layers 8",
             "python benchmarks/moe.py --layers 8 --batches 1 --modes graph compiled-graph --baselines batched_mm "
             "grouped_mm --host-implementations offplan --lookahead-ab   # then: mv results/moe-qwen3-30b-a3b.jsonl "
             "results/moe-qwen3-30b-a3b-b1.jsonl",
             "for m in graph compiled-graph; do python benchmarks/moe.py --batches 1 --modes $m --baselines "
             "batched_mm grouped_mm --host-implementations offplan --lookahead-ab; mv results/moe-qwen3-30b-a3b.jsonl "
             "results/moe-qwen3-30b-a3b-b1-48layers-$m.jsonl; done   # all 48 layers: 61 GB of disk",
             "python benchmarks/moe.py --batches 8 32 --modes graph --baselines grouped_mm --transformers-baselines "
             "grouped_mm --host-implementations offplan   # then: mv results/moe-qwen3-30b-a3b.jsonl "
             "results/moe-qwen3-30b-a3b-b8-b32-48layers.jsonl",
             "python benchmarks/moe_kernels.py --layers 8 --skew 0.7 --resident 0.25 0.5 --compiled",
             "python benchmarks/moe_predict.py --layers 8; python benchmarks/moe_predict.py --layers 8 --skew 0.7",
             "python benchmarks/moe.py --layers 8 --modes graph --baselines batched_mm grouped_mm "
             "--transformers-baselines --host-implementations offplan --skew 0.7 --resident 0.25 0.5 "
             "--budget-batches 1 8",
             "python benchmarks/moe.py --layers 8 --modes graph --baselines batched_mm grouped_mm "
             "--transformers-baselines --host-implementations offplan --skew 0.7 --spread 2 --resident 0.25 0.5 "
             "--budget-batches 1 8   # and with --skew 1.6",
             "python benchmarks/decode.py --model llama-8b --strategies prefetch --modes graph",
             "python benchmarks/decode.py --model llama-8b --strategies prefetch --fractions 0.5 --modes compiled",
             "python benchmarks/prefill.py --model llama-8b",
             "python benchmarks/prefill.py --model qwen3-30b-a3b --layers 8",
             "python benchmarks/prefill.py --model qwen3-30b-a3b --layers 8 --spread 2",
             "python benchmarks/quantized.py --layers 8",
             "python benchmarks/report.py",
             "```", "",
             "Random bf16 weights in the real shapes. Dense tables: HF transformers eager decode (`generate`, "
             "greedy, 16-token prompts, 32 new tokens after a warm-up; prefill excluded); limit = 1 / max(offloaded "
             "bytes / H2D floor measured in the same run, best all-GPU step). "
             "A mixed plan may beat the limit computed from its offloaded bytes: UVA moves only the bytes a step "
             "touches (embedding rows, routed experts).", ""]
    lines += align_table()
    for name, m in sorted(models.items()):
        lines += model_tables(name, m)
    lines += moe_tables()
    lines += prefill_tables()
    lines += staging_ab()
    lines += quantized_tables()
    if plot(models, HERE / "decode.png"):
        lines += ["![decode tokens/s against the offloaded fraction](decode.png)", ""]
    write_atomic(HERE / "RESULTS.md", "\n".join(lines) + "\n", "results")
    print(f"wrote {HERE / 'RESULTS.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
