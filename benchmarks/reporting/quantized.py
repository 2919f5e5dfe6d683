"""The quantized section (quantized-*.jsonl, benchmarks/quantized.py): FP8 kept quantized against bf16."""
from __future__ import annotations

from .records import RESULTS, fmt, read_rows


def quantized_tables() -> list[str]:
    """quantized-*.jsonl (benchmarks/quantized.py): FP8 kept quantized against the same model in bf16."""
    out = []
    for path in sorted(RESULTS.glob("quantized-*.jsonl")):
        rows = read_rows(path)
        sizes = {r["name"]: r["bytes"] for r in rows if r["kind"] == "checkpoint"}
        hw = next((r for r in rows if r["kind"] == "hardware"), {})
        out += [f"## {path.stem.removeprefix('quantized-')}: FP8 experts in host memory against bf16", "",
                f"`{path.name}` (8 decoder layers): block-scaled FP8 ({sizes.get('fp8', 0) / 1e9:.1f} GB: every "
                "`*_proj.weight` F8_E4M3 with 128 x 128 scales, written as DeepSeek-V3 ships it) against the same "
                f"model dequantized on the host to bf16 ({sizes.get('bf16', 0) / 1e9:.1f} GB). FP8 stays FP8 in host "
                "memory and in HBM; a module reads it dequantized, routed experts only where touched "
                f"(runtime/place/quant.py). UVA {hw.get('uva_read_gbps', '?')} GB/s measured in the run. "
                "Batch 1, greedy, "
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
