"""benchmarks/peers.py on CUDA (marked `gpu`): offplan's rows through the runtime's generation, replayed from CUDA
graphs, and llama.cpp's beside them when a peers/build.sh build is at build/llama.cpp (the benchmark's own way onto
the GPU machine: carry .peers and run build.sh there; 4 minutes on 16 cores). Without one, llama.cpp's rows are
skipped, saying why, as the benchmark does."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from decode_bench import ROOT  # noqa: E402
from test_peers import offplan_rows, run_peers  # noqa: E402

pytestmark = pytest.mark.gpu
BUILD = ROOT / "build" / "llama.cpp" / "bin"


def test_peers_measures_offplan_on_cuda_and_llama_cpp_beside_it_when_built(tmp_path):
    built = (BUILD / "llama-bench").is_file() and (BUILD / "llama-batched-bench").is_file()
    records = run_peers(tmp_path, "--device", "cuda", *(["--llama-cpp", str(BUILD)] if built else []))
    rows = offplan_rows(records)
    run = records[0]
    assert run["kind"] == "run" and run["device"] == torch.cuda.get_device_name()
    if not built:
        assert [r["what"] for r in records if r["kind"] == "skipped"][0] == "llama.cpp rows"
        return
    assert "CUDA" in run["llama_cpp"]["backends"]
    assert all(r["llama_cpp"] > 0 and r["ratio"] == r["offplan"] / r["llama_cpp"] for r in rows.values())
    equal = [r for r in rows.values() if r["what"].startswith("equal GPU memory")]
    assert [r["n_cpu_moe"] for r in equal] == [1] and equal[0]["gpu_bytes"] > 0
