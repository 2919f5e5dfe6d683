"""Tensor parallelism on checkpoint names (layers/shards.py): which tensors split along which dim, whose outputs
the GPUs sum or gather, what forbids a split, one GPU's view of the checkpoint and the collectives a step makes.
Plain data: header entries and config facts, no files."""
from __future__ import annotations

from headeronly import infos
from planner.inputs.config import ModelFacts
from planner.layers.graph import build_graph
from planner.layers.shards import Split, collectives, find_split, local_tensors, template
from synthetic import deepseek_v3, llama, qwen3_moe

LLAMA = dict(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=256)
MOE = dict(layers=2, hidden=64, experts=4, moe_intermediate=32, heads=4, kv_heads=2, head_dim=16, vocab=128)
KNOWN = "deepseek_v3, glm4_moe, llama, mistral, mixtral, qwen2, qwen3, qwen3_moe"


def facts(model_type="llama", heads=4, kv_heads=2, hidden=64, tied=False) -> ModelFacts:
    return ModelFacts(model_type=model_type, heads=heads, kv_heads=kv_heads, hidden=hidden, tied=tied)


def mixtral() -> list:
    """Mixtral's checkpoint names, made from Qwen3-MoE's: `block_sparse_moe.experts.N.w1/w2/w3` (gate, down,
    up) and `block_sparse_moe.gate`, no q/k norms."""
    renamed = (("mlp.", "block_sparse_moe."), ("gate_proj", "w1"), ("down_proj", "w2"), ("up_proj", "w3"))
    out = []
    for name, dtype, shape in qwen3_moe(**MOE):
        for old, new in renamed:
            name = name.replace(old, new)
        out += [] if name.endswith(("q_norm.weight", "k_norm.weight")) else [(name, dtype, shape)]
    return out


ATTN = "model.layers.*.self_attn"


def test_template_replaces_every_number_between_dots():
    assert template("model.layers.3.mlp.experts.17.up_proj.weight") == "model.layers.*.mlp.experts.*.up_proj.weight"
    assert template("lm_head.weight") == "lm_head.weight"


def test_llama_splits_attention_and_the_mlp_and_gathers_the_head():
    split, problems = find_split(infos(llama(**LLAMA)), facts(), 2)
    assert problems == []
    assert split == Split(2, {f"{ATTN}.q_proj.weight": 0, f"{ATTN}.k_proj.weight": 0, f"{ATTN}.v_proj.weight": 0,
                              f"{ATTN}.o_proj.weight": 1, "model.layers.*.mlp.gate_proj.weight": 0,
                              "model.layers.*.mlp.up_proj.weight": 0, "model.layers.*.mlp.down_proj.weight": 1,
                              "lm_head.weight": 0},
                          (f"{ATTN}.o_proj", "model.layers.*.mlp.down_proj"), ("lm_head",))
    assert list(split.dims) == [f"{ATTN}.q_proj.weight", f"{ATTN}.k_proj.weight", f"{ATTN}.v_proj.weight",
                                f"{ATTN}.o_proj.weight", "model.layers.*.mlp.gate_proj.weight",
                                "model.layers.*.mlp.up_proj.weight", "model.layers.*.mlp.down_proj.weight",
                                "lm_head.weight"]  # checkpoint order
    assert split.dim_of("model.layers.1.self_attn.o_proj.weight") == 1
    assert split.dim_of("model.layers.1.input_layernorm.weight") is None


def test_qwen3_moe_splits_every_expert_and_sums_the_experts_module_once():
    split, problems = find_split(infos(qwen3_moe(**MOE)), facts("qwen3_moe"), 2)
    experts = "model.layers.*.mlp.experts"
    assert problems == []
    assert split == Split(2, {f"{ATTN}.q_proj.weight": 0, f"{ATTN}.k_proj.weight": 0, f"{ATTN}.v_proj.weight": 0,
                              f"{ATTN}.o_proj.weight": 1, f"{experts}.*.gate_proj.weight": 0,
                              f"{experts}.*.up_proj.weight": 0, f"{experts}.*.down_proj.weight": 1,
                              "lm_head.weight": 0},
                          (f"{ATTN}.o_proj", experts), ("lm_head",))  # q_norm, k_norm and the router stay whole


def test_deepseek_v3_splits_its_mlps_and_experts_and_leaves_its_attention_whole():
    """transformers' plan for deepseek_v3 splits no MLA projection: attention stays whole on every GPU, so its
    head counts need not divide (3 heads over 2 GPUs); the FP8 scales split with their weights, the MTP layer's
    experts as the others'."""
    tensors = deepseek_v3(layers=2, dense_layers=1, hidden=256, intermediate=512, experts=4, moe_intermediate=256,
                          heads=3, q_lora=128, kv_lora=128, nope=32, rope=16, v_head=32, vocab=256)
    ds = ModelFacts(model_type="deepseek_v3", heads=3, kv_heads=3, hidden=256, fp8_block=(128, 128))
    split, problems = find_split(infos(tensors), ds, 2)
    assert problems == []
    mlp = "model.layers.*.mlp"
    dims = {f"{mlp}.gate_proj.weight": 0, f"{mlp}.up_proj.weight": 0, f"{mlp}.down_proj.weight": 1,
            f"{mlp}.experts.*.gate_proj.weight": 0, f"{mlp}.experts.*.up_proj.weight": 0,
            f"{mlp}.experts.*.down_proj.weight": 1, f"{mlp}.shared_experts.gate_proj.weight": 0,
            f"{mlp}.shared_experts.up_proj.weight": 0, f"{mlp}.shared_experts.down_proj.weight": 1}
    with_scales = {t: d for w, dim in dims.items() for t, d in ((w, dim), (w + "_scale_inv", dim))}
    assert split == Split(2, {**with_scales, "lm_head.weight": 0},
                          (f"{mlp}.down_proj", f"{mlp}.experts", f"{mlp}.shared_experts.down_proj"), ("lm_head",))


def test_glm4_moe_splits_attention_with_its_biases_and_the_shared_experts():
    """GLM-4.5: Qwen3-MoE's layer with q, k and v biases and a shared expert; the biases split with their weights,
    the shared expert's down is summed as the routed experts' are."""
    tensors = list(qwen3_moe(**MOE))
    for i in range(MOE["layers"]):
        p = f"model.layers.{i}"
        tensors += [(f"{p}.self_attn.{x}_proj.bias", "BF16", (64 if x == "q" else 32,)) for x in "qkv"]
        tensors += [(f"{p}.mlp.shared_experts.{x}_proj.weight", "BF16", (32, 64)) for x in ("gate", "up")]
        tensors += [(f"{p}.mlp.shared_experts.down_proj.weight", "BF16", (64, 32))]
    split, problems = find_split(infos(tensors), facts("glm4_moe"), 2)
    assert problems == []
    shared = "model.layers.*.mlp.shared_experts"
    assert {t: d for t, d in split.dims.items() if ".bias" in t or "shared" in t} == {
        f"{ATTN}.q_proj.bias": 0, f"{ATTN}.k_proj.bias": 0, f"{ATTN}.v_proj.bias": 0,
        f"{shared}.gate_proj.weight": 0, f"{shared}.up_proj.weight": 0, f"{shared}.down_proj.weight": 1}
    assert split.reduce == (f"{ATTN}.o_proj", "model.layers.*.mlp.experts", f"{shared}.down_proj")
    assert find_split(infos(tensors), facts("glm4_moe", heads=3), 2)[1] == [
        "config.json: num_attention_heads is 3, which 2 GPUs cannot share evenly: use a GPU count that divides it"]


def test_mixtral_names_its_experts_w1_w2_w3():
    split, problems = find_split(infos(mixtral()), facts("mixtral"), 2)
    experts = "model.layers.*.block_sparse_moe.experts"
    assert problems == []
    assert split == Split(2, {f"{ATTN}.q_proj.weight": 0, f"{ATTN}.k_proj.weight": 0, f"{ATTN}.v_proj.weight": 0,
                              f"{ATTN}.o_proj.weight": 1, f"{experts}.*.w1.weight": 0, f"{experts}.*.w2.weight": 1,
                              f"{experts}.*.w3.weight": 0, "lm_head.weight": 0},
                          (f"{ATTN}.o_proj", experts), ("lm_head",))


def test_a_tied_head_is_not_split_and_nothing_is_gathered():
    split, problems = find_split(infos(llama(**LLAMA, tied=True)), facts(tied=True), 2)
    assert (problems, split.gather) == ([], ())
    assert "lm_head.weight" not in split.dims and "model.embed_tokens.weight" not in split.dims
    # a checkpoint that stores the head although config.json ties it: the head reuses the embedding, whole
    split, _ = find_split(infos(llama(**LLAMA)), facts(tied=True), 2)
    assert (split.gather, "lm_head.weight" in split.dims) == ((), False)


def test_colwise_biases_split_with_their_weights():
    tensors = llama(**LLAMA) + [("model.layers.0.self_attn.q_proj.bias", "BF16", (64,)),
                                ("model.layers.0.mlp.up_proj.bias", "BF16", (128,))]
    split, problems = find_split(infos(tensors), facts(), 2)
    assert problems == []
    assert (split.dims[f"{ATTN}.q_proj.bias"], split.dims["model.layers.*.mlp.up_proj.bias"]) == (0, 0)


def test_a_checkpoint_with_nothing_to_split_is_refused():
    renamed = [(n.replace("self_attn", "attn").replace("lm_head", "head"), d, s) for n, d, s in llama(**LLAMA)]
    renamed = [t for t in renamed if ".mlp." not in t[0]]
    assert find_split(infos(renamed), facts(), 2) == (Split(2, {}, (), ()), [
        "no tensor is named as transformers' plan for llama names what it splits "
        "(`model.layers.N.self_attn.q_proj.weight`, ...): nothing to split; plan it on one GPU"])


def test_an_unknown_model_type_is_one_problem():
    assert find_split(infos(llama(**LLAMA)), facts("gpt2"), 2) == (Split(2, {}, (), ()), [
        f"config.json: model_type 'gpt2': offplan knows transformers' tensor-parallel plan of {KNOWN} only; plan "
        "this model on one GPU (`gpus: 1`)"])
    assert find_split(infos(llama(**LLAMA)), ModelFacts(), 2)[1] == [
        "config.json: no model_type (or no config.json beside the checkpoint), so no tensor-parallel plan applies: "
        f"offplan knows transformers' tensor-parallel plan of {KNOWN} only; plan this model on one GPU (`gpus: 1`)"]


def test_heads_and_dims_the_gpus_cannot_share_evenly():
    # 6 heads of 8 and 3 key/value heads: 4 GPUs could split q, k and v (48, 24 and 24 rows) evenly, but not
    # whole heads, which only config.json tells; 2 GPUs share the heads but not the key/value heads
    tensors = llama(layers=1, hidden=48, intermediate=100, heads=6, kv_heads=3, vocab=90)
    _, problems = find_split(infos(tensors), facts(heads=6, kv_heads=3, hidden=48), 4)
    assert problems == [
        "config.json: num_attention_heads is 6, which 4 GPUs cannot share evenly: use a GPU count that divides it",
        "config.json: num_key_value_heads is 3, which 4 GPUs cannot share evenly: use a GPU count that divides it",
        "lm_head.weight: its dim 0 (90) does not divide by 4 GPUs: use a GPU count that divides it"]
    assert find_split(infos(tensors), ModelFacts(model_type="llama"), 2)[1] == [
        f"config.json: no {key}: each GPU takes a whole share of the heads, and offplan cannot tell them without it"
        for key in ("num_attention_heads", "num_key_value_heads")]
    _, problems = find_split(infos(tensors), facts(heads=6, kv_heads=3, hidden=48), 2)
    assert problems == [
        "config.json: num_key_value_heads is 3, which 2 GPUs cannot share evenly: use a GPU count that divides it"]
    # a dim that does not divide: reported once per kind of tensor, not once per layer
    _, problems = find_split(infos(llama(**{**LLAMA, "intermediate": 129})), facts(), 2)
    assert problems == [f"model.layers.0.mlp.{p}.weight: its dim {d} (129) does not divide by 2 GPUs: use a GPU "
                        "count that divides it" for p, d in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1))]
    # layers of a kind that differ: the first divides, a later one does not, and that one is named
    wide = infos(llama(**LLAMA))
    odd = infos(llama(**{**LLAMA, "intermediate": 129}))
    mixed = {**wide, **{n: odd[n] for n in odd if n.startswith("model.layers.1.mlp.")}}
    _, problems = find_split(mixed, facts(), 2)
    assert problems == [f"model.layers.1.mlp.{p}.weight: its dim {d} (129) does not divide by 2 GPUs: use a GPU "
                        "count that divides it" for p, d in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1))]


def test_what_tensor_parallelism_does_not_support():
    rowwise_bias = llama(**LLAMA) + [(f"model.layers.{i}.self_attn.o_proj.bias", "BF16", (64,)) for i in range(2)]
    assert find_split(infos(rowwise_bias), facts(), 2)[1] == [
        "model.layers.0.self_attn.o_proj.bias: a rowwise projection's bias would be added once per GPU; "
        "tensor-parallel plans of such models are not supported: plan it on one GPU"]
    prefused = [t for t in qwen3_moe(**MOE) if ".experts." not in t[0]] + [
        ("model.layers.0.mlp.experts.gate_up_proj", "BF16", (4, 64, 64)),
        ("model.layers.0.mlp.experts.down_proj", "BF16", (4, 64, 32))]
    assert find_split(infos(prefused), facts("qwen3_moe"), 2)[1] == [
        f"model.layers.0.mlp.experts.{p}: experts stored already fused (one tensor of every expert); tensor "
        "parallelism needs them stored one tensor each: plan it on one GPU" for p in ("gate_up_proj", "down_proj")]
    mxfp4 = llama(**LLAMA) + [("model.layers.0.mlp.experts.down_proj_blocks", "U8", (4, 64, 2, 16)),
                              ("model.layers.0.mlp.experts.down_proj_scales", "U8", (4, 64, 2))]
    assert find_split(infos(mxfp4), facts(), 2)[1] == [
        f"model.layers.0.mlp.experts.down_proj_{p}: an MXFP4 tensor; tensor-parallel plans of MXFP4 checkpoints "
        "are not supported (block-scaled FP8 ones are): plan it on one GPU" for p in ("blocks", "scales")]


def fp8(tensors: list, block: int) -> list:
    """`tensors` with every projection F8_E4M3 and its block scales after it (as tests/quantized_models.py)."""
    out = []
    for name, dtype, shape in tensors:
        if not name.endswith("_proj.weight"):
            out.append((name, dtype, shape))
            continue
        out += [(name, "F8_E4M3", shape), (name + "_scale_inv", "F32", tuple(-(-d // block) for d in shape))]
    return out


def fp8_facts(block: int) -> ModelFacts:
    return ModelFacts(model_type="qwen3_moe", heads=4, kv_heads=2, hidden=64, fp8_block=(block, block))


def test_fp8_scales_split_with_their_weights_in_whole_blocks():
    tensors = infos(fp8(qwen3_moe(**{**MOE, "moe_intermediate": 64}), 16))
    split, problems = find_split(tensors, fp8_facts(16), 2)
    assert problems == []
    assert {t: d for t, d in split.dims.items() if t.startswith(ATTN)} == {
        f"{ATTN}.{p}_proj.{w}": d for p, d in (("q", 0), ("k", 0), ("v", 0), ("o", 1))
        for w in ("weight", "weight_scale_inv")}
    assert split.reduce == (f"{ATTN}.o_proj", "model.layers.*.mlp.experts")
    local = local_tensors(tensors, split.dims, 2)
    down = "model.layers.0.mlp.experts.3.down_proj.weight"
    assert (local[down].shape, local[down + "_scale_inv"].shape) == ((64, 32), (4, 2))  # [H, I/2], its blocks
    assert local[down + "_scale_inv"].nbytes == 4 * 2 * 4
    # the k and v projections' 32 rows do not hold 2 shares of whole 32-row blocks; each kind named once
    _, problems = find_split(tensors, fp8_facts(32), 2)
    assert problems == [
        f"model.layers.0.self_attn.{p}_proj.weight: F8_E4M3, its dim 0 (32) does not divide into 2 shares of whole "
        "32-element scale blocks (config.json's weight_block_size): use a GPU count whose shares hold whole "
        "blocks, or plan it on one GPU" for p in ("k", "v")]


def test_local_tensors_are_one_gpus_share_along_the_split_dim():
    tensors = infos(llama(**LLAMA))
    split, _ = find_split(tensors, facts(), 2)
    local = local_tensors(tensors, split.dims, 2)
    assert list(local) == list(tensors)
    assert {n: (t.shape, t.nbytes) for n, t in local.items() if not n.startswith("model.layers.1.")} == {
        "model.embed_tokens.weight": ((256, 64), 32768),
        "model.layers.0.input_layernorm.weight": ((64,), 128),
        "model.layers.0.self_attn.q_proj.weight": ((32, 64), 4096),
        "model.layers.0.self_attn.k_proj.weight": ((16, 64), 2048),
        "model.layers.0.self_attn.v_proj.weight": ((16, 64), 2048),
        "model.layers.0.self_attn.o_proj.weight": ((64, 32), 4096),
        "model.layers.0.post_attention_layernorm.weight": ((64,), 128),
        "model.layers.0.mlp.gate_proj.weight": ((64, 64), 8192),
        "model.layers.0.mlp.up_proj.weight": ((64, 64), 8192),
        "model.layers.0.mlp.down_proj.weight": ((64, 64), 8192),
        "model.norm.weight": ((64,), 128),
        "lm_head.weight": ((128, 64), 16384)}
    whole = [n for n in tensors if template(n) not in split.dims]
    assert all(local[n] is tensors[n] for n in whole)  # untouched: the same records
    down = "model.layers.1.mlp.down_proj.weight"  # its name, dtype, shard and offset: the whole tensor's, in its file
    assert local[down] == tensors[down]._replace(shape=(64, 64), nbytes=8192)
    assert local_tensors(tensors, split.dims, 1) == tensors


def test_collectives_per_layer_count_each_summed_module_once_and_the_heads_gather():
    tensors = infos(qwen3_moe(**MOE))
    split, _ = find_split(tensors, facts("qwen3_moe"), 2)
    local = local_tensors(tensors, split.dims, 2)
    got = collectives(build_graph(local).layers, split, local, hidden=64)
    # per layer: o_proj and the experts module (4 experts, one all-reduce) sum 64 bf16 activations per token each;
    # the head gathers its 128 logits per token
    assert got == {"model.layers.0": (2, 2 * 64 * 2), "model.layers.1": (2, 2 * 64 * 2), "lm_head": (1, 128 * 2)}
    assert collectives(build_graph(tensors).layers, Split(1, {}, (), ()), tensors, 64) == {}
