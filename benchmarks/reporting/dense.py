"""The dense decode section (decode-*.jsonl, benchmarks/decode.py; uva-align.jsonl, docs/uva-align/uva_align.py):
steps/s per strategy against the limit, load figures, UVA bandwidth by where pinned memory starts, and the plot.

The limit at batch b for a plan offloading B bytes is 1 / max(B / H2D floor of
the same run, the best all-GPU step time at b measured for that model).
"""
from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from .records import RESULTS, fmt

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
    """The arena alignment measurement (docs/uva-align/uva_align.py): median over its rounds."""
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
            "keeps tensors 256 bytes apart (runtime/place/arena.py); the `uva-64b` rows of the decode tables load the "
            "same plan into an arena started 64 bytes past a page, as before, in the same run.", ""]
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
