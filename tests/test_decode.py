"""benchmarks/decode.py on the CPU: every offplan strategy decodes the all-GPU model's greedy tokens."""
from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import decode_bench  # noqa: E402
from decode_bench import run_decode  # noqa: E402


def test_decode_benchmark_runs_on_the_cpu(tmp_path):
    code, records = run_decode(tmp_path, "--device", "cpu", "--batches", "1", "2",
                               "--strategies", "uva", "uva-64b", "prefetch", "mixed")
    assert code == 0
    assert {(r["name"], r["batch"]) for r in records} == {
        (name, b) for name in ("gpu", "uva-0.5", "uva-64b-0.5", "prefetch-0.5", "mixed-0.5", "gpu-end") for b in (1, 2)}
    assert all(r["same_tokens"] and r["steps_per_s"] > 0 for r in records)


def test_moe_benchmark_runs_on_the_cpu(tmp_path):
    import importlib.util
    import json
    import sys
    root = decode_bench.ROOT / "benchmarks"
    sys.path.insert(0, str(root))  # moe.py imports its sibling decode.py, as `python benchmarks/moe.py` does
    try:
        spec = importlib.util.spec_from_file_location("moe_bench_main", root / "moe.py")
        moe = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(moe)
        code = moe.main(["--model", "tiny", "--layers", "2", "--device", "cpu", "--batches", "1", "2",
                         "--new-tokens", "2", "--modes", "eager", "--dir", str(tmp_path / "work"),
                         "--out", str(tmp_path / "out"), "--skew", "0.7", "--resident", "0.5", "--budget-batches", "1"])
    finally:
        sys.path.remove(str(root))
    assert code == 0
    rows = [json.loads(l) for l in (tmp_path / "out" / "moe-tiny-skew0.7.jsonl").read_text().splitlines()]
    # skewed routing: the profile (other prompts than the timed ones) says so, and the budget plans keep
    # the same bytes resident, per expert or per layer, with the same tokens as the all-GPU model
    profile = next(r for r in rows if r["kind"] == "profile")
    assert profile["layers"] == 2 and profile["top_quarter_share"] > 0.25 + 0.1
    budget = {r["name"]: r for r in rows if r["kind"] == "decode" and "resident_fraction" in r}
    assert set(budget) == {"budget-per-expert-0.5", "whole-layers-uva-0.5"}
    per_expert, whole = budget["budget-per-expert-0.5"], budget["whole-layers-uva-0.5"]
    assert per_expert["uva_bytes"] >= whole["uva_bytes"] > 0
    assert per_expert["predicted_h2d_bytes_per_step"]["1"] < whole["predicted_h2d_bytes_per_step"]["1"]
    assert per_expert["observed_h2d_bytes_per_step"] < whole["observed_h2d_bytes_per_step"]
    runs = {(r["name"], r["implementation"], r["batch"]) for r in rows if r["kind"] == "decode"}
    assert ("experts-host-offplan", "offplan", 2) in runs and ("gpu-grouped_mm", "grouped_mm", 1) in runs
    assert all(r["same_tokens"] for r in rows if r["kind"] == "decode" and r["implementation"] != "eager")
    assert {r["batch"] for r in rows if r["kind"] == "floor"} == {1, 2}
