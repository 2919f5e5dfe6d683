"""Quantized checkpoints on CUDA (marked `gpu`): the Triton FP8 dequantization reads pinned memory in place and
equals the torch arithmetic bitwise, and the MXFP4 one builds the torch arithmetic's bits with no temporaries; FP8
and MXFP4 loads equal the dequantized reference under every placement, eagerly, compiled without graph breaks, and
in a replayed CUDA graph; gpt-oss decodes through the front door replayed as eagerly. FP8 at decode (a few rows)
and MXFP4 experts at one token run gemv.py's fused products, which sum in another order than the reference's GEMM:
within its rounding."""
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
import tiny_models  # noqa: E402
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



@pytest.mark.parametrize("transposed", [False, True])
def test_mxfp4_kernel_is_the_torch_arithmetic_bitwise_and_allocates_only_its_output(transposed):
    """Every byte (two codes) under every scale but E8M0's NaN (255), subnormal and infinite results included,
    bit for bit (signed zeros too); the kernel's only allocation is the tensor it returns (working.py counts
    that)."""
    every = torch.arange(256, dtype=torch.uint8).view(16, 16)  # a row of 16 groups: every byte once
    blocks = torch.stack([every.expand(255, 16, 16), every.flip(0).expand(255, 16, 16)]).contiguous()
    scales = torch.stack([torch.arange(255).view(255, 1).expand(255, 16),
                          (torch.arange(255).view(255, 1) + torch.arange(16)) % 255]).to(torch.uint8).contiguous()
    want = dequant._mxfp4(blocks, scales, torch.bfloat16)  # the torch arithmetic, on the CPU
    want = want.transpose(-2, -1).contiguous() if transposed else want
    blocks, scales = blocks.cuda(), scales.cuda()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    got = dequant._dequant_mxfp4(blocks, scales, torch.bfloat16, transposed)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before == -(-got.nbytes // 512) * 512  # the allocator's blocks
    assert got.shape == want.shape and got.is_contiguous()
    assert torch.equal(got.cpu().view(torch.int16), want.view(torch.int16))

def test_gather_dequant_equals_gather_then_dequantize_and_skips_padding():
    """One launch for two FP8 parameters of unlike shapes (partial blocks), experts read in place through the
    zero-copy view or from resident rows (data and scales each by their own slots), and one for a parameter all in
    HBM: the valid slots bitwise gather.py's rows dequantized by dequant.py; padding slots unwritten."""
    from runtime.execute.gather import _gather_reference
    from runtime.place import fp8_gather
    e, arenas = 10, []

    def pinned(t):
        arenas.append(PinnedArena(t.numel() * t.element_size(), cuda=True))
        typed(arenas[-1].host_view(0, arenas[-1].nbytes), t.dtype, t.shape).copy_(t)
        return typed(arenas[-1].device_view(0, arenas[-1].nbytes), t.dtype, t.shape)
    sources, wants = {}, {}
    order = torch.tensor([7, 2, 1, 3, 0, 9, 5], device="cuda")  # each of the four sources' mixes, then padding
    valid = torch.tensor([1, 1, 1, 1, 1, 0, 0], dtype=torch.int32, device="cuda")
    for name, (rows, cols), ids in (("gate_up_proj", (300, 200), [2, 3]), ("down_proj", (96, 260), [0, 7])):
        data = (torch.randn(e, rows, cols) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        scale = torch.rand(e, -(-rows // 128), -(-cols // 128)) * 3
        slot = torch.full((e,), -1, dtype=torch.int32)
        slot[ids] = torch.arange(2, dtype=torch.int32)
        sslot = slot.roll(1)  # the scales' resident rows in another order: read by their own slots
        resident = (data[ids].float() * -1).to(torch.float8_e4m3fn).cuda()  # marked: HBM rows show by value
        sids = [int(i) for i in (sslot >= 0).nonzero().flatten()]
        sresident = scale[sids][sslot[sids].argsort()].cuda() + 1
        sources[name] = fp8_gather.Source(pinned(data), resident, slot.cuda(), pinned(scale), sresident,
                                          sslot.cuda(), (128, 128), torch.bfloat16)
        wants[name] = dequant._fp8_reference(
            _gather_reference(sources[name].data, resident, slot.cuda(), order, valid),
            _gather_reference(sources[name].scale, sresident, sslot.cuda(), order, valid), 128, 128, torch.bfloat16)
    s = sources["gate_up_proj"]  # a parameter all in HBM: no rows, no slots, every expert read where it lies
    sources["in_hbm"] = fp8_gather.Source(s.data.clone(), None, None, s.scale.clone(), None, None, (128, 128),
                                          torch.bfloat16)
    everyone = torch.full((e,), -1, dtype=torch.int32, device="cuda")
    wants["in_hbm"] = dequant._fp8_reference(_gather_reference(s.data, s.resident[:0], everyone, order, valid),
                                             _gather_reference(s.scale, s.scale_resident[:0], everyone, order, valid),
                                             128, 128, torch.bfloat16)
    assert fp8_gather.applies(sources["down_proj"].data, (128, 128))
    got = fp8_gather.gather_dequant(sources, order, valid)
    for name, want in wants.items():
        assert got[name].shape == want.shape and torch.equal(got[name][:5], want[:5]), name
    sentinel = torch.full((7, 96, 260), 7.0, dtype=torch.bfloat16, device="cuda")  # padding: not written
    s = sources["down_proj"]
    fp8_gather._kernel[(7, 3 * 3, 1)](order, valid, sentinel, s.data, s.resident, s.slot, s.scale, s.scale_resident,
                                      s.scale_slot, 96, 260, *s.scale.shape[1:], *[None] * 7, 0, 0, 0, 0, COUNT=1,
                                      B0=128, B1=128, BR=32, BC=128, SLOTS=True)
    assert torch.equal(sentinel[:5], wants["down_proj"][:5]) and bool((sentinel[5:] == 7).all())
    del sources, got
    for a in arenas:
        a.release()


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
            if tokens == 1:  # FP8 and MXFP4 fused at decode: each product within a bf16 unit (gemv.py),
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
            if name == "fp8":  # two sequences: the experts gathered and dequantized in one launch (fp8_gather.py)
                two = torch.randint(0, 256, (2, 1), device="cuda")
                explained = torch._dynamo.explain(model)(two)
                assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
                torch._dynamo.reset()
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


def test_gpt_oss_decodes_through_the_front_door_replayed_as_eager(tmp_path, checkpoints):
    """`handle.generate` replays gpt-oss's decode steps (its eager attention's mask made capturable, its sliding
    layers counted on the device: runtime/execute/tokens.py) with the eager steps' tokens, bf16 and MXFP4 (one
    sequence: its experts through gemv.py's fused kernel; two: dequantized), one prompt length (no mask) and two
    (padded), while the sliding window (128) holds the cache; past a window (8), rolled from the device count, for
    prompts of one length, one sequence and two; prompts of two lengths past it are refused, saying to generate
    eagerly, which then runs."""
    wide = save_model(tiny_models.gpt_oss_config(sliding_window=128), tmp_path / "wide")
    for name, checkpoint in (("wide", wide), ("mx", checkpoints["mxfp4"][0])):
        model, handle = from_pretrained(make_plan(tmp_path, checkpoint, POLICIES["uva"], name=name), progress=False)
        try:
            for prompts in ([[5, 17, 99, 3], [8, 8, 200, 31]], [[5, 17, 99, 3, 41], [9, 250]], [[5, 17, 99, 3]]):
                got = handle.generate(prompts, 40)
                assert got.mode == "graph" and got.decode_steps == 39
                assert got.tokens == handle.generate(prompts, 40, eager=True).tokens, (name, prompts)
        finally:
            handle.remove(restore=False)
    narrow = save_model(tiny_models.gpt_oss_config(), tmp_path / "narrow")  # a window of 8
    model, handle = from_pretrained(make_plan(tmp_path, narrow, POLICIES["uva"], name="narrow"), progress=False)
    try:
        for prompts in ([[5, 17, 99, 3]], [[5, 17, 99, 3], [8, 8, 200, 31]]):
            got = handle.generate(prompts, 40)
            assert got.mode == "graph" and got.decode_steps == 39
            assert got.tokens == handle.generate(prompts, 40, eager=True).tokens, prompts
        with pytest.raises(ValueError, match=r"GptOssForCausalLM: its sliding-window attention keeps 8 tokens.*"
                                             r"holds 128.*several lengths.*generate eagerly"):
            handle.generate([[5, 17, 99, 3, 41], [9, 250]], 12)
        assert handle.generate([[5, 17, 99, 3, 41], [9, 250]], 12, eager=True).decode_steps == 11
    finally:
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
