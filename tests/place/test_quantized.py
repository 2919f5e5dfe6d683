"""Quantized checkpoints (FP8 block-scaled, MXFP4) kept quantized: planned as units, loaded exactly, on the CPU."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from planner.errors import ModelMismatchError, OffplanError, PolicyError  # noqa: E402
from planner.inputs.checkpoint import open_checkpoint  # noqa: E402
from planner.inputs.quantized import partners  # noqa: E402
from planner.plan import Placement  # noqa: E402
from planner.planfile import load_plan  # noqa: E402
from quantized_models import fp8_dequantize, fp8_quantize, reference_dir, write_fp8, write_mxfp4  # noqa: E402
from runtime.hf import build_meta_model, from_pretrained  # noqa: E402
from tiny_models import llama_config, logits, make_plan, qwen3_moe_config, reference, save_model  # noqa: E402

POLICIES = {
    "gpu": "",
    "uva": "backend: uva\nuva: {offload_gib: 100}",
    "prefetch": "prefetch: {group_size: 2, num_in_group: 1, step: 1}",
    # 80% of the checkpoint and a one-token prompt: room for the experts' working memory (planner/decide/working.py:
    # FP8 and MXFP4 experts dequantize theirs), where mixed still puts experts on uva
    "mixed": "backend: mixed\nbudget_gib: BUDGET\nprefetch: {step: 1}\nworkload: {prompt_tokens: 1}",
}


def gpt_oss_config():
    return transformers.GptOssConfig(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=128, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (quantized checkpoint, its dequantized bf16 reference). hidden 192: partial 128-blocks."""
    root = tmp_path_factory.mktemp("quantized")
    made = {}
    for name, config, write in (
            ("fp8-moe", qwen3_moe_config(hidden_size=192, moe_intermediate_size=128, head_dim=32,
                                         num_hidden_layers=2), write_fp8),
            ("fp8-llama", llama_config(hidden_size=192, intermediate_size=256, num_hidden_layers=2), write_fp8),
            ("mxfp4-gpt-oss", gpt_oss_config(), write_mxfp4)):
        quantized = write(save_model(config, root / f"{name}-bf16"), root / name)
        made[name] = (quantized, reference_dir(quantized, root / f"{name}-ref"))
    return made


@pytest.fixture(scope="module")
def expected(checkpoints):
    return {name: logits(reference(ref)) for name, (_, ref) in checkpoints.items()}


def test_the_writers_follow_the_published_layouts(checkpoints):
    ckpt = open_checkpoint(checkpoints["fp8-moe"][0])
    w = ckpt.tensors["model.layers.0.self_attn.q_proj.weight"]
    s = ckpt.tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    assert (w.dtype, w.shape, s.dtype, s.shape) == ("F8_E4M3", (128, 192), "F32", (1, 2))
    assert ckpt.tensors["model.layers.0.mlp.experts.3.down_proj.weight_scale_inv"].shape == (2, 1)
    mx = open_checkpoint(checkpoints["mxfp4-gpt-oss"][0])
    assert mx.tensors["model.layers.0.mlp.experts.gate_up_proj_blocks"].shape == (4, 64, 2, 16)  # [E, 2I, H/32, 16]
    assert mx.tensors["model.layers.0.mlp.experts.gate_up_proj_scales"].shape == (4, 64, 2)
    q, scale = fp8_quantize(torch.full((130, 3), 448.0 * 2))  # one full block row and a partial one
    assert scale.shape == (2, 1) and torch.equal(fp8_dequantize(q, scale), torch.full((130, 3), 896.0).bfloat16())


@pytest.mark.parametrize("name", ["fp8-moe", "fp8-llama", "mxfp4-gpt-oss"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_quantized_loads_match_the_dequantized_reference(tmp_path, checkpoints, expected, name, policy):
    quantized, ref = checkpoints[name]
    body = POLICIES[policy].replace("BUDGET", str(open_checkpoint(quantized).total_bytes * 0.8 / 2**30))
    plan_path = make_plan(tmp_path, quantized, body)
    plan = load_plan(plan_path)
    pairs = partners(open_checkpoint(quantized).tensors)
    assert pairs and all(plan.params[w] is plan.params[s] for w, s in pairs.items())  # one unit
    if policy != "gpu":
        assert any(p is not Placement.GPU for p in plan.params.values())
    model, handle = from_pretrained(plan_path, progress=False)
    stored = {n: t.dtype for n, t in model.state_dict().items()}
    if name.startswith("fp8"):
        assert stored["model.layers.0.self_attn.q_proj.weight"] == torch.float8_e4m3fn
        assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16  # read dequantized
    else:
        assert stored["model.layers.0.mlp.experts.gate_up_proj_blocks"] == torch.uint8
    stats = handle.stats()
    offloaded = sum(open_checkpoint(quantized).tensors[n].nbytes for n, p in plan.params.items() if p is not
                    Placement.GPU)
    assert stats.uva_bytes + stats.prefetch_bytes == offloaded  # quantized bytes, not bf16
    assert torch.equal(logits(model), expected[name])
    ref_model = reference(ref)
    ids = torch.tensor([[5, 9, 2, 7]])
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kw), ref_model.generate(ids, **kw))
    handle.remove()
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert torch.equal(logits(model), expected[name])  # plain dequantized tensors again


def test_experts_split_between_gpu_and_host(tmp_path, checkpoints, expected):
    quantized, _ = checkpoints["fp8-moe"]
    plan_path = make_plan(tmp_path, quantized, "rules:\n  - {match: [experts.0, experts.1], place: gpu}\n"
                                               "backend: uva\nuva: {offload_gib: 100}")
    plan = load_plan(plan_path)
    assert plan.params["model.layers.0.mlp.experts.0.up_proj.weight_scale_inv"] is Placement.GPU
    assert plan.params["model.layers.0.mlp.experts.2.up_proj.weight_scale_inv"] is Placement.UVA
    model, handle = from_pretrained(plan_path, progress=False)
    experts = model.model.layers[0].mlp.experts
    assert experts.offplan_rows_gate_up_proj.shape[0] == 2 and experts.offplan_rows_gate_up_proj_scale_inv.shape[0] == 2
    assert torch.equal(logits(model), expected["fp8-moe"])
    handle.remove()


@pytest.mark.parametrize("policy, gathered", [("gpu", False), ("uva", True)])
def test_one_tokens_mxfp4_experts_reach_the_fused_product_in_place_or_gathered(tmp_path, checkpoints, monkeypatch,
                                                                                policy, gathered):
    """experts.py hands one token's MXFP4 experts to gemv.py's `mxfp4_pairs` (a Triton kernel on CUDA; here made to
    apply on the CPU, its product computed in float64 from dequant.py's values): the whole stored parameter and each
    pair's expert where the model holds it all, the rows gathered in pair order (no ids) where it is pinned; two
    sequences dequantize instead. The logits are the dequantized reference's within bf16 rounding."""
    from runtime.place import gemv
    from runtime.place.dequant import dequant_mxfp4
    calls = []

    def pairs(x, blocks, scales, ids):
        calls.append((tuple(blocks.shape), ids is None))
        if ids is not None:
            blocks, scales = blocks.index_select(0, ids), scales.index_select(0, ids)
        w = dequant_mxfp4(blocks, scales, torch.bfloat16, False).double()  # [P, out, in]
        return torch.bmm(w, x.double().unsqueeze(-1)).squeeze(-1).to(x.dtype)
    monkeypatch.setattr(gemv, "mxfp4_applies", lambda x, blocks, dtype: dtype == x.dtype == torch.bfloat16)
    monkeypatch.setattr(gemv, "mxfp4_pairs", pairs)
    quantized, ref = checkpoints["mxfp4-gpt-oss"]
    model, handle = from_pretrained(make_plan(tmp_path, quantized, POLICIES[policy]), progress=False)
    ref_model = reference(ref)
    try:
        with torch.no_grad():
            for ids in (torch.tensor([[5]]), torch.tensor([[5, 9]])):
                got, want = model(ids).logits, ref_model(ids).logits
                assert (got - want).abs().max() <= 2**-6 * want.abs().max()
                assert torch.equal(got.argmax(-1), want.argmax(-1))
    finally:
        handle.remove()
    k, layers = ref_model.config.num_experts_per_tok, ref_model.config.num_hidden_layers
    rows = k if gathered else 4  # the pair's experts gathered, or all 4 held
    expect = [(rows, 64, 2, 16), (rows, 64, 1, 16)]  # gate_up_proj [E, 2I, H/32, 16], down_proj [E, H, I/32, 16]
    assert calls == [(shape, gathered) for _ in range(layers) for shape in expect], calls  # one token's only


def test_a_rule_cannot_part_a_weight_from_its_scales(tmp_path, checkpoints):
    quantized, _ = checkpoints["fp8-llama"]
    with pytest.raises(PolicyError, match="apart from their scales") as e:
        make_plan(tmp_path, quantized, "rules:\n  - {match: ['re:q_proj\\.weight$'], place: uva}")
    assert "model.layers.0.self_attn.q_proj.weight and model.layers.0.self_attn.q_proj.weight_scale_inv" in str(e.value)


def test_fp8_without_block_scales_is_refused(tmp_path, checkpoints, capsys):
    """`plan build` refuses it with one error naming the tensor and what to use instead, writing no plan; the
    runtime's scan refuses it too (a plan built before the scales went missing is also stale)."""
    from offplan.cli import main
    from runtime.place.quant import scan
    quantized, _ = checkpoints["fp8-llama"]
    broken = tmp_path / "broken"
    from quantized_models import _rewrite
    _rewrite(quantized, broken, lambda n, t: {} if n.endswith("q_proj.weight_scale_inv") else {n: t}, None)
    policy = tmp_path / "p.policy.yaml"
    policy.write_text(f"format_version: 1\ncheckpoint: {broken}\n")
    assert main(["build", str(policy)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("error: ") == 1 and "Traceback" not in err
    assert "quantized tensors offplan cannot load" in err
    assert "model.layers.0.self_attn.q_proj.weight: F8_E4M3 without model.layers.0.self_attn.q_proj.weight_scale_inv" \
        in err and "use the model's block-scaled FP8 release, or its bf16 one" in err
    assert not (tmp_path / "p.plan.yaml").exists()
    with pytest.raises(ModelMismatchError, match="q_proj.weight: F8_E4M3 without .*only block-scaled FP8"):
        scan(open_checkpoint(broken))


def test_fp8_with_per_tensor_scales_is_refused_at_build(tmp_path, checkpoints, capsys):
    """Scales stored under the block scales' name but one per tensor: the runtime would fail at load, so `plan
    build` refuses them, naming the tensor, its scales' shape and the one its 128 x 128 blocks need."""
    from offplan.cli import main
    from quantized_models import _rewrite
    quantized, _ = checkpoints["fp8-llama"]
    per_tensor = _rewrite(quantized, tmp_path / "per-tensor",
                          lambda n, t: {n: t.amax().reshape(())} if n.endswith("_scale_inv") else {n: t}, None)
    policy = tmp_path / "p.policy.yaml"
    policy.write_text(f"format_version: 1\ncheckpoint: {per_tensor}\n")
    assert main(["build", str(policy)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("error: ") == 1 and "Traceback" not in err
    assert ("model.layers.0.mlp.down_proj.weight: F8_E4M3 [192, 256] with scales "
            "model.layers.0.mlp.down_proj.weight_scale_inv [], which are not its 128 x 128 block scales (those "
            "would be [2, 2];") in err and "use the model's block-scaled FP8 release, or its bf16 one" in err
    assert not (tmp_path / "p.plan.yaml").exists()


def test_apply_refuses_a_quantized_checkpoint(tmp_path, checkpoints):
    import runtime
    quantized, ref = checkpoints["fp8-llama"]
    plan = make_plan(tmp_path, quantized, "")
    model = reference(ref)
    with pytest.raises(OffplanError, match="apply\\(\\) cannot quantize"):
        runtime.apply(model, plan)


def test_a_failed_load_leaves_the_meta_model_plain(tmp_path, checkpoints):
    import runtime
    quantized, _ = checkpoints["fp8-moe"]
    plan = make_plan(tmp_path, quantized, "prefetch: {group_size: 2, num_in_group: 1, step: 1}")
    model = build_meta_model(quantized)
    before = {n: (t.dtype, t.shape) for n, t in model.state_dict().items()}
    config = json.loads((quantized / "config.json").read_text())
    model.model.layers[1].mlp.experts.down_proj = torch.nn.Parameter(  # a model that does not fit the plan
        torch.empty(4, 192, 64, dtype=torch.bfloat16, device="meta"))
    with pytest.raises(ModelMismatchError):
        runtime.load(model, plan, progress=False)
    after = {n: (t.dtype, t.shape) for n, t in model.state_dict().items()}
    assert after == {**before, "model.layers.1.mlp.experts.down_proj": (torch.bfloat16, torch.Size([4, 192, 64]))}
    assert config["quantization_config"]["weight_block_size"] == [128, 128]


def test_quantized_benchmark_runs_on_the_cpu(tmp_path):
    """benchmarks/quantized.py end to end on its tiny model: FP8 tokens equal the dequantized bf16 model's."""
    from decode_bench import load_benchmark
    bench = load_benchmark("quantized")
    code = bench.main(["--model", "tiny", "--layers", "2", "--new-tokens", "3", "--device", "cpu",
                       "--dir", str(tmp_path / "work"), "--out", str(tmp_path / "out")])
    rows = [json.loads(line) for line in (tmp_path / "out" / "quantized-tiny.jsonl").read_text().splitlines()]
    decodes = [r for r in rows if r["kind"] == "decode"]
    assert code == 0 and len(decodes) == 4
    assert all(r["same_tokens_as_bf16"] for r in decodes if r["checkpoint"] == "fp8")
    host = {r["checkpoint"]: r["host_bytes"] for r in decodes if r["strategy"] == "experts-host"}
    assert 0.5 < host["fp8"] / host["bf16"] < 0.52  # FP8 bytes and their scales over the link, not bf16
