"""benchmarks/decode.py on the CPU: every offplan strategy decodes the all-GPU model's greedy tokens."""
from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from decode_bench import run_decode  # noqa: E402


def test_decode_benchmark_runs_on_the_cpu(tmp_path):
    code, records = run_decode(tmp_path, "--device", "cpu", "--batches", "1", "2",
                               "--strategies", "uva", "uva-64b", "prefetch", "mixed")
    assert code == 0
    assert {(r["name"], r["batch"]) for r in records} == {
        (name, b) for name in ("gpu", "uva-0.5", "uva-64b-0.5", "prefetch-0.5", "mixed-0.5", "gpu-end") for b in (1, 2)}
    assert all(r["same_tokens"] and r["steps_per_s"] > 0 for r in records)
