"""Runs benchmarks/decode.py's main() on the tiny model, for the CPU and GPU tests of the benchmark."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_decode(tmp_path: Path, *argv: str) -> tuple[int, list[dict]]:
    """(exit code, decode records) of `decode.py --model tiny ...` writing under tmp_path."""
    code = load_benchmark("decode").main(["--model", "tiny", "--layers", "4", "--dir", str(tmp_path / "work"),
                                          "--out", str(tmp_path / "out"), "--new-tokens", "3", "--fractions", "0.5",
                                          *argv])
    lines = (tmp_path / "out" / "decode-tiny.jsonl").read_text().splitlines()
    return code, [r for r in map(json.loads, lines) if r["kind"] == "decode"]


def load_benchmark(name: str):
    """benchmarks/NAME.py as a module, with benchmarks/ on sys.path for its imports of the harness and its siblings."""
    import sys
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(f"{name}_bench_main", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
