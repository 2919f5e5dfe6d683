"""Experts stored already fused (planner/inputs/prefused.py): GPT-OSS and Llama 4 shapes, on plain data and header-only
checkpoints. One tensor holds a parameter of every expert along its first dimension; a decode step reads the
rows of the experts routing picks, and the tensor is placed whole."""
from __future__ import annotations

import dataclasses
import json

import pytest

from headeronly import GPU, UVA, infos, policy
from offplan.cli import main
from planner.decide.build import build_file
from planner.decide.cost import CostModel
from planner.decide.placement import decide
from planner.decide.staging import stageable
from planner.errors import PolicyError
from planner.inputs.config import read_config
from planner.inputs.hardware import H100
from planner.inputs.patterns import compile_pattern
from planner.inputs.policy import Rule, Workload
from planner.inputs.prefused import prefused_key
from planner.inputs.routing import LayerHits, RoutingProfile
from planner.layers.expert_names import units
from planner.layers.graph import build_graph
from planner.layers.groups import FusedGroups, is_expert
from planner.plan import LayerBytes, Role, Runs
from synthetic import gpt_oss, llama4_text, write_header_only

GPT_OSS_120B = {"num_hidden_layers": 36, "num_local_experts": 128, "num_experts_per_tok": 4}
EXPERT_PARAMS = ("down_proj_bias", "down_proj_blocks", "down_proj_scales", "gate_up_proj_bias", "gate_up_proj_blocks",
                 "gate_up_proj_scales")  # natural order


def tiny_gpt_oss(**kw):
    """2 layers of 8 experts, MXFP4: 54 KiB of experts a layer (gate_up blocks 32 KiB, down blocks 16 KiB)."""
    return gpt_oss(**{**dict(layers=2, hidden=64, intermediate=64, experts=8, heads=4, kv_heads=2, head_dim=16,
                             vocab=256), **kw})


def experts_of(layer: int, *params: str) -> list[str]:
    return [f"model.layers.{layer}.mlp.experts.{p}" for p in params or EXPERT_PARAMS]


def groups_of(tensors, experts=None) -> FusedGroups:
    t = infos(tensors)
    names = [n for l in build_graph(t).stack_layers() for n in l.params]
    return FusedGroups.find(names, {n: t[n].shape for n in names}, experts)


def dbrx_like(layers=4, experts=4, ffn=64, hidden=32):
    """DBRX's layout: `ffn.experts.mlp.w1` [E x I, H], flat, under an experts module without expert numbers."""
    out = []
    for i in range(layers):
        p = f"transformer.blocks.{i}.ffn"
        out += [(f"{p}.router.layer.weight", "BF16", (experts, hidden))]
        out += [(f"{p}.experts.mlp.{w}", "BF16", (experts * ffn, hidden)) for w in ("v1", "w1", "w2")]
    return out


# ---------------------------------------------------------------- names and shapes

def test_names_alone_make_a_tensor_of_an_experts_module_a_member():
    assert prefused_key("model.layers.3.mlp.experts.gate_up_proj_blocks") == ("model.layers.3.mlp.experts",
                                                                             "gate_up_proj_blocks")
    assert prefused_key("language_model.model.layers.1.feed_forward.experts.down_proj") == (
        "language_model.model.layers.1.feed_forward.experts", "down_proj")
    assert prefused_key("m.experts.gate_up_proj.scale") == ("m.experts", "gate_up_proj.scale")  # a suffix
    for name in ("model.layers.3.mlp.experts.7.up_proj.weight", "model.layers.3.mlp.shared_experts.up_proj.weight",
                 "model.layers.3.mlp.router.weight", "experts.gate_up_proj"):
        assert prefused_key(name) is None, name
    assert is_expert("model.layers.3.mlp.experts.down_proj") and is_expert("m.experts.7.up_proj.weight")
    # never staged at prefill: the runtime tells experts from a plan's names alone, as here
    layers = build_graph([n for n, _, _ in tiny_gpt_oss()]).layers
    assert not any(is_expert(n) for n in stageable(layers))
    # each pre-fused tensor is a unit of its own in a slot image (per-expert units are unchanged)
    assert units(experts_of(0, "gate_up_proj_blocks", "gate_up_proj_scales")) == [
        ("model.layers.0.mlp.experts.gate_up_proj_blocks",), ("model.layers.0.mlp.experts.gate_up_proj_scales",)]


def test_the_first_dimension_counts_the_experts():
    g = groups_of(tiny_gpt_oss())
    group = "model.layers.0.mlp.experts"
    assert g.members[group] == tuple(experts_of(0))
    assert g.rows_of == {n: 8 for i in (0, 1) for n in experts_of(i)}
    assert (g.experts(group), g.not_experts) == (8, {})
    name = experts_of(0, "down_proj_blocks")[0]
    assert g.routed(name) and g.param(name) == g.expert(name) == (name,)  # placed whole: its own unit
    assert g.group(name) == tuple(experts_of(0))  # prefetch streams the module whole
    assert groups_of(tiny_gpt_oss(), experts=8).rows_of == g.rows_of  # config.json agrees
    # from a plan's names alone: members, rows unknown
    names_only = FusedGroups.find(n for n, _, _ in tiny_gpt_oss())
    assert names_only.group_of == g.group_of and names_only.rows_of == {} and not names_only.routed(name)


def test_tensors_whose_first_dimension_is_not_the_experts_are_read_whole():
    g = groups_of(dbrx_like())  # no config: 2-D [E x I, H] is no stack of matrices
    w1 = "transformer.blocks.0.ffn.experts.mlp.w1"
    assert g.rows_of == {} and g.experts("transformer.blocks.0.ffn.experts") == 0
    assert g.not_experts[w1] == ("none of transformer.blocks.0.ffn.experts's tensors is a stack of matrices (3-D or "
                                 "more) and config.json gives no expert count")
    g = groups_of(dbrx_like(), experts=4)
    assert g.not_experts[w1] == "its first dimension is 256, not the 4 experts of config.json"
    # config.json's count is checked against every pre-fused tensor
    g = groups_of(tiny_gpt_oss(), experts=16)
    assert g.rows_of == {} and set(g.not_experts) == {n for i in (0, 1) for n in experts_of(i)}
    assert g.not_experts[experts_of(0, "down_proj_bias")[0]] == "its first dimension is 8, not the 16 experts of " \
                                                                "config.json"


def test_read_config_counts_experts(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GPT_OSS_120B))
    assert read_config(tmp_path).experts == 128
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"num_local_experts": 16}, "num_experts": 8}))
    assert read_config(tmp_path).experts == 16  # Llama 4: the text model's
    (tmp_path / "config.json").write_text(json.dumps({"n_routed_experts": 256}))
    assert read_config(tmp_path).experts == 256


# ---------------------------------------------------------------- the cost model

def model_for(tensors, batch=1, top_k=2, routing=None, roles=None, tokens=512):
    t = infos(tensors)
    g = build_graph(t)
    return CostModel(g, t, H100, batch, groups_of(tensors), top_k, roles, routing, prompt_tokens=tokens)


@pytest.mark.parametrize("batch", [1, 2, 8])
def test_a_step_reads_the_touched_experts_rows(batch):
    m = model_for(tiny_gpt_oss(), batch=batch)
    touched = 1 - (1 - 2 / 8) ** batch  # E (1 - (1 - k/E)^b) of the E rows
    for n in experts_of(0) + experts_of(1):
        assert (m.role[n], m.frac[n]) == (Role.EXPERT, touched)
        assert n in m.gathered
    assert m.frac["model.layers.0.mlp.router.weight"] == 1.0
    assert model_for(tiny_gpt_oss(), top_k=None).frac[experts_of(0)[0]] == 1.0  # routing unknown: all of it


def test_a_routing_profile_weighs_each_row():
    hits = {"model.layers.0.mlp.experts": LayerHits(8, (8, 8, 0, 0, 0, 0, 0, 0), (4, 4, 0, 0, 0, 0, 0, 0)),
            "model.layers.1.mlp.experts": LayerHits(8, (2,) * 8, (1,) * 8)}
    profile = RoutingProfile("c", "sha256:" + "0" * 64, "x", 1, 9, 2, 4, 8, hits)
    m = model_for(tiny_gpt_oss(), batch=2, routing=profile, tokens=3)
    # layer 0 sends every token to experts 0 and 1: 2 rows of 8 per step; layer 1 spreads them: 1 - 0.75^2
    assert m.frac[experts_of(0)[0]] == 0.25 and m.frac[experts_of(1)[0]] == 1 - 0.75 ** 2
    # the prefill: layer 0 reads rows 0 and 1 and computes a quarter of its rows' work; layer 1, each row
    # computes a quarter of the 3 tokens and is read with chance 1 - 0.75^3
    blocks = experts_of(0, "gate_up_proj_blocks")[0]
    assert (m.pre_frac[blocks], m.flops[blocks]) == (0.25, 2 * 3 * 8 * 128 * 2 * 16 * 0.25)
    assert m.pre_frac[experts_of(1)[0]] == 1 - 0.75 ** 3


def test_rules_override_the_role_and_role_expert_needs_experts_per_row():
    dense = {n: Role.DENSE for n in experts_of(0)}
    m = model_for(tiny_gpt_oss(), roles=dense)
    assert (m.role[experts_of(0)[0]], m.frac[experts_of(0)[0]]) == (Role.DENSE, 1.0)
    assert m.frac[experts_of(1)[0]] == 0.25
    t = infos(dbrx_like())
    pol = dataclasses.replace(policy(), rules=(Rule((compile_pattern("ffn.experts"),), None, Role.EXPERT),))
    with pytest.raises(PolicyError) as e:
        decide(build_graph(t), t, pol, H100, 4, num_experts=4)
    assert e.value.headline == "test.policy.yaml: role: expert on tensors that are not stacked experts"
    assert e.value.problems[0] == (
        "rules[0] (role: expert) selects transformer.blocks.0.ffn.experts.mlp.v1, a tensor of an experts module "
        "that holds no expert per row: its first dimension is 256, not the 4 experts of config.json; so the cost "
        "model cannot tell which of it a step reads and reads it whole: leave it out of the rule's match")
    d = decide(build_graph(t), t, policy(), H100, 4, num_experts=4)  # without the rule: read whole, and noted
    assert d.notes[1] == (
        "read whole by the cost model, though in an experts module: tensors with no expert number whose rows are "
        "not the experts: transformer.blocks.N.ffn.experts.mlp.v1 (4 tensors): its first dimension is 256, not the "
        "4 experts of config.json; transformer.blocks.N.ffn.experts.mlp.w1 (4 tensors): its first dimension is "
        "256, not the 4 experts of config.json; transformer.blocks.N.ffn.experts.mlp.w2 (4 tensors): its first "
        "dimension is 256, not the 4 experts of config.json")


# ---------------------------------------------------------------- placement

def test_mixed_moves_pre_fused_experts_whole_and_first():
    """The embedding's rows, then layer 0's expert parameters (a quarter read per step), one whole tensor at
    a time in natural order, until the plan fits; the gate_up blocks take their scales along (quantized.py)."""
    tensors = tiny_gpt_oss()
    t = infos(tensors)
    total = sum(i.nbytes for i in t.values())  # 228,784 bytes
    # the experts' working memory, in the footprint: MXFP4 experts dequantize the touched ones, on the GPU too, so
    # it is the same wherever they lie (planner/decide/working.py): the all-GPU plan's
    working = decide(build_graph(t), t, policy(), H100, 2, num_experts=8).summary.working_peak_bytes
    assert working > 0
    pol = dataclasses.replace(policy("mixed", budget_gib=(total - 85_000 + working) / 2**30), workload=Workload(1))
    d = decide(build_graph(t), t, pol, H100, 2, num_experts=8)
    assert d.summary.working_peak_bytes == working
    uva = ["model.embed_tokens.weight"] + experts_of(0)
    assert d.params == {n: UVA if n in uva else GPU for n, _, _ in tensors}
    assert [dataclasses.replace(l, us=0) for l in d.layers] == [
        LayerBytes("model.embed_tokens", uva=32768, h2d=128, why="embedding -> uva (0.4% read per step)"),
        LayerBytes("model.layers.0", gpu=26264, uva=55296, h2d=55296 // 4, why="expert -> uva (25.0% read per step)"),
        LayerBytes("model.layers.1", gpu=81560), LayerBytes("model.norm", gpu=128), LayerBytes("lm_head", gpu=32768)]
    assert d.summary.predicted_h2d_bytes_per_step == 128 + 13824
    assert d.prefill is None  # quantized experts are never staged: each touched one is gathered once


def test_the_uva_walk_moves_a_pre_fused_parameter_whole_and_prefetch_streams_the_module_whole():
    t = infos(tiny_gpt_oss())
    d = decide(build_graph(t), t, policy(offload_gib=18_000 / 2**30), H100, 2)
    # natural order: the layer norm (128 B), then each expert parameter whole, until 18,000 bytes are moved
    assert [n for n, p in d.params.items() if p is UVA] == (["model.layers.0.input_layernorm.weight"]
                                                            + experts_of(0, "down_proj_bias", "down_proj_blocks",
                                                                         "down_proj_scales"))
    d = decide(build_graph(t), t, policy(group_size=2), H100, 2)  # layer 1 streams, each tensor its own unit
    experts = [(b.name, b.offset, b.bytes) for b in d.prefetch.layouts[0].buffers if "experts" in b.name]
    assert experts == [("mlp.experts.down_proj_bias", 256, 1024), ("mlp.experts.down_proj_blocks", 1280, 16384),
                       ("mlp.experts.down_proj_scales", 17664, 1024), ("mlp.experts.gate_up_proj_bias", 18688, 2048),
                       ("mlp.experts.gate_up_proj_blocks", 20736, 32768),
                       ("mlp.experts.gate_up_proj_scales", 53504, 2048)]
    with pytest.raises(PolicyError) as e:
        decide(build_graph(t), t, policy(group_size=2, prefetch_params=["gate_up_proj_blocks"]), H100, 2)
    assert e.value.problems == [  # one line for the section, the first group named
        "prefetch.params selects 1 of the 6 tensors of fused group model.layers.0.mlp.experts (e.g. "
        "model.layers.0.mlp.experts.gate_up_proj_blocks) (and 1 more group alike); prefetch streams a group whole, "
        "since its fused parameters are views of one slot: select all of them (for example with the pattern "
        "`experts`), or place experts on uva"]


def test_a_rule_cannot_pick_experts_of_a_pre_fused_tensor(tmp_path):
    write_header_only(tmp_path / "ckpt", tiny_gpt_oss(), single=True)
    path = tmp_path / "x.policy.yaml"
    path.write_text("format_version: 1\ncheckpoint: ./ckpt\nrules:\n  - match: [experts.3]\n    place: uva\n")
    with pytest.raises(PolicyError) as e:
        build_file(path)
    assert e.value.problems == [
        f"{path}:4:13: rules[0].match[0]: 'experts.3' matches no tensor of the checkpoint: this checkpoint stores "
        "its experts already fused, one tensor holding a parameter of every expert "
        "(model.layers.0.mlp.experts.gate_up_proj_blocks), and the plan places a checkpoint tensor whole, so a rule "
        "cannot pick some of its experts; match the parameter (`experts.gate_up_proj_blocks`) or the module "
        "(`experts`)"]


def test_show_names_pre_fused_experts_as_a_fused_group(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write_header_only(tmp_path / "ckpt", tiny_gpt_oss(), single=True)
    (tmp_path / "x.policy.yaml").write_text("format_version: 1\ncheckpoint: ./ckpt\n"
                                            f"uva: {{offload_gib: {18_000 / 2**30!r}, stage_prefill: false}}\n")
    assert main(["build", "x.policy.yaml"]) == 0
    capsys.readouterr()
    assert main(["show", "x.plan.yaml", "--tensors", "--json"]) == 0
    units = [(u["name"], u["placement"], u["tensors"], u["bytes"]) for u in json.loads(capsys.readouterr().out)["units"]
             if "experts" in u["name"]]
    assert units == [
        ("model.layers.0.mlp.experts [down_proj_bias, down_proj_blocks, down_proj_scales]", "uva", 3, 18432),
        ("model.layers.0.mlp.experts [gate_up_proj_bias, gate_up_proj_blocks, gate_up_proj_scales]", "gpu", 3, 36864),
        ("model.layers.1.mlp.experts", "gpu", 6, 55296)]


# ---------------------------------------------------------------- real shapes

def expert_uva_plan(tmp_path, tensors, config):
    """Every tensor of the experts modules on uva by a rule; returns the plan."""
    write_header_only(tmp_path / "ckpt", tensors)
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    (tmp_path / "x.policy.yaml").write_text("format_version: 1\ncheckpoint: ./ckpt\n"
                                            "rules: [{match: [experts], place: uva}]\n")
    return build_file(tmp_path / "x.policy.yaml")[0]


@pytest.mark.parametrize("mxfp4, layer_bytes", [
    # blocks: 128 x 5760 x 90 x 16 and 128 x 2880 x 90 x 16; scales: a 16th of those; biases 128 x (5760 + 2880) x 2
    (True, 1_061_683_200 + 66_355_200 + 530_841_600 + 33_177_600 + 1_474_560 + 737_280),  # 1.58 GiB a layer
    # gate_up 128 x 2880 x 5760 x 2, down 128 x 2880 x 2880 x 2, biases as above
    (False, 4_246_732_800 + 2_123_366_400 + 1_474_560 + 737_280),  # 5.93 GiB a layer
])
def test_gpt_oss_120b_reads_4_of_128_experts_a_step(tmp_path, mxfp4, layer_bytes):
    """Top-4 of 128 at batch 1: a 32nd of each layer's expert bytes, where the whole used to be counted."""
    plan = expert_uva_plan(tmp_path, gpt_oss(mxfp4=mxfp4), GPT_OSS_120B)
    assert plan.summary.uva_bytes == 36 * layer_bytes
    assert plan.summary.predicted_h2d_bytes_per_step == 36 * layer_bytes // 32
    layers = [l for l in plan.layers if l.name.startswith("model.layers.")]
    assert {(l.uva, l.h2d) for l in layers} == {(layer_bytes, layer_bytes // 32)} and len(layers) == 36
    if mxfp4:
        assert plan.prefill is None  # nothing but experts on uva, quantized: never staged
    else:  # bf16: a prompt of 512 tokens touches every expert, streamed through a ring of the most, 1 GiB
        assert (plan.prefill.slots, plan.prefill.ring_bytes, len(plan.prefill.layers)) == (0, 2**30, 36)
    assert plan.notes == ("rules place 56.80 GiB on uva (216 tensors)" if mxfp4 else
                          "rules place 213.65 GiB on uva (144 tensors)",
                          "backend auto offloads nothing beyond the rules: no offload amount or budget is set",
                          "routing assumed uniform: no workload.routing profile (record one with `plan profile`)")


def test_llama4_maverick_reads_1_of_128_experts_a_step(tmp_path):
    """Every other layer is MoE (24 of 48), top-1 of 128: gate_up 128 x 5120 x 16384 x 2 and down
    128 x 8192 x 5120 x 2 bytes, a 128th of them a step; the shared expert is not routed."""
    config = {"text_config": {"num_hidden_layers": 48, "num_local_experts": 128, "num_experts_per_tok": 1}}
    plan = expert_uva_plan(tmp_path, llama4_text(), config)
    layer_bytes = 21_474_836_480 + 10_737_418_240
    rows = {l.name: (l.uva, l.h2d) for l in plan.layers if l.uva}
    assert rows == {f"language_model.model.layers.{i}": (layer_bytes, layer_bytes // 128) for i in range(1, 48, 2)}
    assert plan.summary.predicted_h2d_bytes_per_step == 24 * layer_bytes // 128
    assert [l.runs for l in plan.layers] == [Runs.STEP] * len(plan.layers)
