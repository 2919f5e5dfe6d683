"""The raw records the benchmarks write (benchmarks/results/*.jsonl), read back for the report."""
from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent  # benchmarks/
RESULTS = HERE / "results"


def read_rows(path: Path) -> list[dict]:
    """Every record of a JSONL file; none when the benchmark that writes it was not run."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def run_header(path: Path, rows: list[dict]) -> str:
    """One line naming a run: its checkpoint, device, torch, and the bandwidths calibrated in it."""
    ck = next(r for r in rows if r["kind"] == "checkpoint")
    hw = next(r for r in rows if r["kind"] == "hardware")
    return (f"`{path.name}`: {ck['tensors']} tensors, {ck['bytes'] / 1e9:.1f} GB on {ck['device']}, torch "
            f"{ck['torch']}; calibrated in the same run: UVA GEMV {hw['uva_read_gbps']} GB/s, H2D copy "
            f"{hw['h2d_copy_gbps']} GB/s")


def fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)
