"""benchmarks/peers/: llama.cpp side by side. The GGUF a benchmark checkpoint becomes holds the same weights under
llama.cpp's names (read back with gguf's own reader), Q8_0 is gguf's bit for bit, and stage.sh packs what a build
needs from an sdist laid out as llama-cpp-python's."""
from __future__ import annotations

import json
import subprocess
import sys
import tarfile

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
try:  # the GGUF tests need llama.cpp's gguf package (the test extra); the benchmark runs below, and
    import gguf  # test_peers_gpu.py, which imports them, do not: the GPU machine has no registry to install it
except ImportError:
    gguf = None
needs_gguf = pytest.mark.skipif(gguf is None, reason="llama.cpp's gguf package is not installed (the test extra)")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from decode_bench import ROOT, load_benchmark  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))
import to_gguf  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen3-MoE (2 layers, 8 experts, transformers' initialisation) as the benchmarks write it."""
    load_benchmark("front_door")  # benchmarks/ on the path
    from harness.checkpoints import make_checkpoint
    return make_checkpoint("tiny-128", 2, tmp_path_factory.mktemp("ckpt") / "ckpt", "cpu")


def weights(root):
    out = {}
    for f in sorted(root.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@needs_gguf
def test_q8_0_is_gguf_s_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 256, generator=g) * 3
    x[0, :32] = 0  # a block of zeros: scale 0
    x[1, :32] = torch.tensor([127.0] + [h - 15.5 for h in range(31)])  # scale 1: the others on .5
    x[2, :32] = -x[1, :32]  # rounding half away from zero, as ggml (not to even, as torch.round)
    ours = to_gguf.q8_0(x).numpy()
    theirs = gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert ours.shape == theirs.shape == (96, 256 // 32 * 34)
    assert (ours == theirs).all()


@needs_gguf
def test_bf16_gguf_holds_the_checkpoint_s_weights_under_llama_cpp_s_names(checkpoint, tmp_path):
    out = to_gguf.write_gguf(checkpoint, tmp_path / "m.gguf", "bf16")
    assert not list(tmp_path.glob("*.tmp"))
    reader = gguf.GGUFReader(out)
    fields = {k: f.contents() for k, f in reader.fields.items()}
    config = json.loads((checkpoint / "config.json").read_text())
    assert fields["general.architecture"] == "qwen3moe" and fields["tokenizer.ggml.model"] == "none"
    assert (fields["qwen3moe.block_count"], fields["qwen3moe.expert_count"], fields["qwen3moe.expert_used_count"],
            fields["qwen3moe.vocab_size"], fields["qwen3moe.expert_feed_forward_length"]) == (
        2, 8, 2, config["vocab_size"], config["moe_intermediate_size"])
    tensors = {t.name: t for t in reader.tensors}
    w = weights(checkpoint)
    assert len(tensors) == len(w) - 2 * 3 * 8 + 2 * 3  # each layer's 3 x 8 expert tensors stacked into 3
    as_bf16 = {n: torch.from_numpy(np.array(t.data)).view(torch.bfloat16) for n, t in tensors.items()
               if t.tensor_type == gguf.GGMLQuantizationType.BF16}
    as_f32 = {n: torch.from_numpy(np.array(t.data)) for n, t in tensors.items()
              if t.tensor_type == gguf.GGMLQuantizationType.F32}
    assert set(as_f32) == {"output_norm.weight"} | {f"blk.{i}.{n}.weight" for i in range(2) for n in (
        "attn_norm", "ffn_norm", "attn_q_norm", "attn_k_norm", "ffn_gate_inp")}
    pairs = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
             "blk.1.attn_q.weight": "model.layers.1.self_attn.q_proj.weight",
             "blk.0.attn_output.weight": "model.layers.0.self_attn.o_proj.weight",
             "blk.1.ffn_gate_inp.weight": "model.layers.1.mlp.gate.weight",
             "blk.0.attn_k_norm.weight": "model.layers.0.self_attn.k_norm.weight"}
    for ours, theirs in pairs.items():
        got = as_bf16.get(ours, as_f32.get(ours))
        assert torch.equal(got.reshape(w[theirs].shape), w[theirs].to(got.dtype)), ours
    for projection, short in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
        stacked = torch.stack([w[f"model.layers.1.mlp.experts.{e}.{projection}.weight"] for e in range(8)])
        got = as_bf16[f"blk.1.ffn_{short}_exps.weight"]
        assert list(tensors[f"blk.1.ffn_{short}_exps.weight"].shape) == list(reversed(stacked.shape))
        assert torch.equal(got.reshape(stacked.shape), stacked)


@needs_gguf
def test_q8_0_gguf_is_the_weights_within_a_half_step_of_each_block_s_f16_scale(checkpoint, tmp_path):
    reader = gguf.GGUFReader(to_gguf.write_gguf(checkpoint, tmp_path / "m.gguf", "q8_0"))
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_down_exps.weight")
    assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0
    w = weights(checkpoint)
    stacked = torch.stack([w[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] for e in range(8)]).float()
    back = torch.from_numpy(gguf.quants.dequantize(np.array(t.data), t.tensor_type)).reshape(stacked.shape)
    step = stacked.reshape(-1, 32).abs().amax(dim=1, keepdim=True) / 127
    # half a step of rounding, plus the scale's own rounding to F16 (2^-11 of it) times a value up to 127 steps
    assert ((back - stacked).reshape(-1, 32).abs() <= step * (0.5 + 127 * 2**-11)).all()


def test_another_architecture_is_refused_naming_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(SystemExit, match="model_type 'llama'.*qwen3_moe"):
        to_gguf.write_gguf(tmp_path, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()


def test_stage_packs_what_a_build_needs_and_names_the_commit(tmp_path):
    """An sdist laid out as llama-cpp-python's: the backends other than the CPU's and CUDA's, the server and its UI
    are left out; COMMIT names the commit the version's changelog entry gives."""
    root = tmp_path / "src" / "llama_cpp_python-9.9.9"
    src = root / "vendor" / "llama.cpp"
    for path in ("CMakeLists.txt", "ggml/src/ggml-cpu/a.c", "ggml/src/ggml-cuda/b.cu", "ggml/src/ggml-metal/c.m",
                 "ggml/src/ggml.c", "tools/llama-bench/llama-bench.cpp", "tools/server/server.cpp", "tools/ui/x.js",
                 "src/llama.cpp", "gguf-py/gguf/__init__.py", "docs/big.md"):
        (src / path).parent.mkdir(parents=True, exist_ok=True)
        (src / path).write_text("x")
    (root / "CHANGELOG.md").write_text("## [Unreleased]\n\n## [9.9.9]\n\n- feat: update llama.cpp to "
                                       "ggml-org/llama.cpp@abc1234\n\n## [9.9.8]\n\n- feat: llama.cpp@0000000\n")
    sdist = tmp_path / "llama_cpp_python-9.9.9.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(root, arcname=root.name)
    out = tmp_path / "staged"
    done = subprocess.run(["bash", str(ROOT / "benchmarks/peers/stage.sh"), str(sdist), str(out)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (out / "COMMIT").read_text() == "llama.cpp abc1234 (vendored by llama-cpp-python 9.9.9)\n"
    with tarfile.open(out / "llama.cpp.tar.xz") as tar:
        files = {m.name.removeprefix("./") for m in tar.getmembers() if m.isfile()}
    assert files == {"CMakeLists.txt", "ggml/src/ggml-cpu/a.c", "ggml/src/ggml-cuda/b.cu", "ggml/src/ggml.c",
                     "tools/llama-bench/llama-bench.cpp", "src/llama.cpp", "gguf-py/gguf/__init__.py"}


def test_stage_refuses_a_missing_sdist(tmp_path):
    done = subprocess.run(["bash", str(ROOT / "benchmarks/peers/stage.sh"), str(tmp_path / "nope.tar.gz"),
                           str(tmp_path / "out")], capture_output=True, text=True)
    assert done.returncode == 1 and "nope.tar.gz: no such sdist" in done.stderr
    assert not (tmp_path / "out").exists()


def run_peers(tmp_path, *args: str) -> list[dict]:
    peers = load_benchmark("peers")
    assert peers.main(["--model", "tiny", "--layers", "2", "--prompts", "64", "--new-tokens", "4", "--threads", "2",
                       "--dir", str(tmp_path / "work"), "--out", str(tmp_path / "out"), *args]) == 0
    return [json.loads(line) for line in (tmp_path / "out" / "peers-tiny.jsonl").read_text().splitlines()]


def offplan_rows(records: list[dict]) -> dict[tuple[str, int], dict]:
    """The rows by (what, n); each holds offplan's measured rate."""
    rows = {(r["what"], r["n"]): r for r in records if r["kind"] == "row"}
    assert all(r["offplan"] > 0 for r in rows.values()), rows
    return rows


SPLIT = "experts off the GPU, split by the plan between the host's cores and the link"


def test_without_llama_cpp_offplan_s_rows_are_measured_and_llama_cpp_s_skipped_saying_why(tmp_path):
    records = run_peers(tmp_path, "--device", "cpu")
    rows = offplan_rows(records)
    assert {(what.split(":")[0], n) for what, n in rows} == {
        ("experts off the GPU", 1), ("experts off the GPU", 8), ("experts off the GPU", 64),
        (SPLIT, 1), (SPLIT, 8), ("8 bits, experts off the GPU", 1), ("all on the GPU", 1)}
    assert all(r["cpu_bytes"] >= 0 for (what, _), r in rows.items() if what.startswith(SPLIT))
    assert all(r["llama_cpp"] is None and r["ratio"] is None and r["command"] is None for r in rows.values())
    assert all(r["mode"] == "eager" for (what, _), r in rows.items() if "decode" in what)  # on the CPU
    skipped = [r["why"] for r in records if r["kind"] == "skipped"]
    assert skipped == ["no llama.cpp build: give --llama-cpp DIR or --build",
                       "no GPU byte count from llama.cpp (no build, or no CUDA)"]
    assert not list((tmp_path / "work").rglob("*.gguf"))  # no llama.cpp, no GGUF


def test_equal_memory_counts_llama_cpp_s_model_and_compute_buffers_on_the_gpu(tmp_path):
    """gpu_bytes reads llama.cpp's log as it prints it: its GPU's model and compute buffers, each by kind, the
    largest where a buffer is logged again (the budget of the equal-memory plan is their sum); the KV cache and host
    buffers are left out."""
    peers = load_benchmark("peers")
    log = ("load_tensors:        CUDA0 model buffer size =  7801.65 MiB\n"
           "load_tensors:   CPU_Mapped model buffer size =  2264.25 MiB\n"
           "llama_kv_cache:      CUDA0 KV buffer size =    48.00 MiB\n"
           "sched_reserve:      CUDA0 compute buffer size =   304.75 MiB\n"
           "sched_reserve:  CUDA_Host compute buffer size =     5.01 MiB\n"
           "sched_reserve:      CUDA0 compute buffer size =   300.75 MiB\n")  # a second context: the same buffer
    tool = tmp_path / "llama-bench"
    tool.write_text(f"#!/bin/sh\nprintf '%s' '{log}' >&2\necho '{{\"avg_ts\": 1.0}}'\n")
    tool.chmod(0o755)
    llama = peers.LlamaCpp(tmp_path, 2, cuda=True)
    assert llama.gpu_bytes(tmp_path / "m.gguf", 2, 512) == {"model": round(7801.65 * 2**20),
                                                       "compute": round(304.75 * 2**20)}
    assert peers.LlamaCpp(tmp_path, 2, cuda=False).gpu_bytes(tmp_path / "m.gguf", 2, 512) is None


def test_rows_picks_the_groups_measured_and_label_names_the_record(tmp_path):
    peers = load_benchmark("peers")
    assert peers.main(["--model", "tiny", "--layers", "2", "--new-tokens", "4", "--device", "cpu", "--rows", "gpu",
                       "--label", "part", "--dir", str(tmp_path / "work"), "--out", str(tmp_path / "out")]) == 0
    records = [json.loads(line) for line in (tmp_path / "out" / "peers-tiny-part.jsonl").read_text().splitlines()]
    assert [(r["what"], r["n"], r["mode"]) for r in records if r["kind"] == "row"] == [
        ("all on the GPU: decode steps/s", 1, "eager")]
    assert not (tmp_path / "work" / "tiny-128-2layers" / "fp8").exists()  # the 8-bit rows' checkpoint: not written
