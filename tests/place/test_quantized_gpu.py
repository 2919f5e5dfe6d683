"""Quantized checkpoints on CUDA (marked `gpu`): the Triton FP8 dequantization reads pinned memory in place and
equals the torch arithmetic bitwise; FP8 and MXFP4 loads equal the dequantized reference under every placement,
eagerly, compiled without graph breaks, and in a replayed CUDA graph. FP8 at decode (a few rows) runs
fp8_gemv.py's fused products, which sum in another order than the reference's GEMM: within its rounding."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch._inductor.config as inductor_config  # noqa: E402

from quantized_models import reference_dir, write_fp8, write_mxfp4  # noqa: E402
from runtime.execute import experts  # noqa: E402
from runtime.hf import from_pretrained  # noqa: E402
from runtime.place import dequant
from runtime.place.arena import PinnedArena, typed  # noqa: E402
from test_quantized import POLICIES, gpt_oss_config  # noqa: E402
from tiny_models import make_plan, qwen3_moe_config, reference, save_model  # noqa: E402

pytestmark = pytest.mark.gpu
SPLIT = "rules:\n  - {match: [experts.0, experts.1], place: gpu}\nbackend: uva\nuva: {offload_gib: 100}"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    fp8 = write_fp8(save_model(qwen3_moe_config(hidden_size=192, moe_intermediate_size=128, head_dim=32,
                                                num_hidden_layers=2), root / "moe"), root / "fp8")
    mx = write_mxfp4(save_model(gpt_oss_config(), root / "gpt-oss"), root / "mxfp4")
    return {"fp8": (fp8, reference_dir(fp8, root / "fp8-ref")), "mxfp4": (mx, reference_dir(mx, root / "mx-ref"))}


def test_fp8_kernel_reads_pinned_memory_and_equals_the_torch_arithmetic():
    assert dequant.triton is not None
    shape = (3, 300, 200)  # partial blocks in both dims
    arena = PinnedArena(3 * 300 * 200, cuda=True)
    host = typed(arena.host_view(0, arena.nbytes), torch.float8_e4m3fn, shape)
    host.copy_((torch.randn(shape) * 100).clamp(-448, 448).to(torch.float8_e4m3fn))  # no NaN (E4M3 > 448)
    view = typed(arena.device_view(0, arena.nbytes), torch.float8_e4m3fn, shape)
    for b0, b1 in ((128, 128), (64, 32)):
        scale = torch.rand(3, -(-300 // b0), -(-200 // b1)) * 3
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            got = dequant.dequant_fp8(view, scale.cuda(), b0, b1, dtype)
            want = dequant._fp8_reference(host, scale, b0, b1, dtype)
            assert got.is_cuda and torch.equal(got.cpu(), want), (b0, b1, dtype)
            # the matrices `valid` keeps are the same values; the others the kernel does not write
            sentinel = torch.full(shape, 7.0, dtype=dtype, device="cuda")
            kept = dequant._launch_fp8(sentinel, view, scale.cuda(), b0, b1,
                                       torch.tensor([1, 0, 1], dtype=torch.int32, device="cuda"))
            assert torch.equal(kept[0::2].cpu(), want[0::2]) and bool((kept[1] == 7).all()), (b0, b1, dtype)
    del view
    arena.release()


@pytest.mark.parametrize("name,policy", [("fp8", "gpu"), ("fp8", "uva"), ("fp8", "prefetch"), ("fp8", "mixed"),
                                         ("fp8", "split"), ("mxfp4", "uva"), ("mxfp4", "prefetch")])
def test_quantized_loads_on_cuda_equal_the_dequantized_reference(tmp_path, checkpoints, name, policy):
    quantized, ref = checkpoints[name]
    from planner.inputs.checkpoint import open_checkpoint
    body = SPLIT if policy == "split" else POLICIES[policy].replace(
        "BUDGET", str(open_checkpoint(quantized).total_bytes * 0.8 / 2**30))  # as test_quantized.py's
    model, handle = from_pretrained(make_plan(tmp_path, quantized, body), progress=False)
    expected = reference(ref, "cuda")
    k = model.config.num_experts_per_tok
    try:
        for batch, tokens in ((1, 1), (2, 1), (2, 9)):  # one token: its experts fused too (experts.py)
            expected.set_experts_implementation(experts.arithmetic(batch * tokens * k))
            torch.manual_seed(3)
            ids = torch.randint(0, 256, (batch, tokens), device="cuda")
            with torch.no_grad():
                got, want = model(ids).logits, expected(ids).logits
            if name == "fp8" and tokens == 1:  # fused at decode: each product within a bf16 unit (fp8_gemv.py),
                assert (got - want).abs().max() <= 2**-6 * want.abs().max()  # a few units of the largest logit
                assert (got.argmax(-1) == want.argmax(-1)).all()
            else:
                assert torch.equal(got, want), tokens
    finally:
        handle.remove(restore=False)


@pytest.mark.parametrize("name", ["fp8", "mxfp4"])
def test_compiled_and_graph_replay_equal_eager(tmp_path, checkpoints, name):
    """Graph replay for FP8 (Qwen3-MoE) only: gpt-oss builds its sliding-window mask from a CPU tensor in a forward
    without a static cache, which a capture refuses (transformers' masking_utils, not offplan)."""
    quantized, _ = checkpoints[name]
    model, handle = from_pretrained(make_plan(tmp_path, quantized, POLICIES["uva"]), progress=False)
    torch.manual_seed(1)
    x = torch.randint(0, 256, (1, 1), device="cuda")
    try:
        with torch.no_grad():
            eager = model(x).logits.clone()
            explained = torch._dynamo.explain(model)(x)
            assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
            torch._dynamo.reset()
            with inductor_config.patch(emulate_precision_casts=True):
                compiled = torch.compile(model)
                for _ in range(2):
                    assert torch.equal(compiled(x).logits, eager)
            torch._dynamo.reset()
            if name == "mxfp4":
                return
            graph, out = handle.capture(lambda: model(x).logits)
            for _ in range(3):
                graph.replay()
                assert torch.equal(out, eager)
    finally:
        torch._dynamo.reset()
        handle.remove(restore=False)


def test_quantized_benchmark_runs_on_cuda(tmp_path):
    """benchmarks/quantized.py on its tiny model on CUDA, eager and graph replay: FP8 tokens equal bf16's."""
    import json

    from decode_bench import load_benchmark
    code = load_benchmark("quantized").main(["--model", "tiny", "--layers", "2", "--new-tokens", "4", "--device",
                                             "cuda", "--dir", str(tmp_path / "work"), "--out", str(tmp_path / "out")])
    rows = [json.loads(line) for line in (tmp_path / "out" / "quantized-tiny.jsonl").read_text().splitlines()]
    decodes = [r for r in rows if r["kind"] == "decode"]
    assert code == 0 and {r["mode"] for r in decodes} == {"eager", "graph"} and len(decodes) == 8
    assert all(r["ratio_to_floor"] for r in decodes if r["strategy"] == "experts-host")
