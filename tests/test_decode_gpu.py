"""benchmarks/decode.py on CUDA (marked `gpu`): every strategy, eager and graph replay, same tokens as all-GPU."""
from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from decode_bench import run_decode  # noqa: E402
from planner.hardware import H100, dumps_hardware  # noqa: E402

pytestmark = pytest.mark.gpu


def test_decode_benchmark_runs_every_strategy_on_cuda(tmp_path):
    profile = tmp_path / "h100.yaml"
    profile.write_text(dumps_hardware(H100))  # calibration has a test of its own
    code, records = run_decode(tmp_path, "--device", "cuda", "--batches", "1", "4", "--accelerate-batches", "1",
                               "--modes", "eager", "graph", "--hardware", str(profile),
                               "--strategies", "accelerate", "uva", "uva-64b", "prefetch", "mixed")
    assert code == 0
    eager = {(r["name"], r["batch"]) for r in records if r.get("mode", "eager") == "eager"}
    graph = {r["name"] for r in records if r.get("mode") == "graph"}
    assert eager == {(n, b) for n in ("gpu", "uva-0.5", "uva-64b-0.5", "prefetch-0.5", "mixed-0.5", "gpu-end")
                     for b in (1, 4)} | {("accelerate-0.5", 1)}
    assert graph == {"gpu", "uva-0.5", "uva-64b-0.5", "prefetch-0.5", "mixed-0.5", "gpu-end"}
    assert all(r["same_tokens"] for r in records), [r["name"] for r in records if not r["same_tokens"]]
