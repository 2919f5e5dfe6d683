"""The layer graph: stack detection from names, execution order, tied embeddings, `stacks:`."""
from __future__ import annotations

import networkx as nx
import pytest

from headeronly import toy, write_policy
from planner.decide.build import build
from planner.errors import PolicyError
from planner.inputs.policy import load_policy
from planner.layers.graph import build_graph, execution_order, natural_key
from synthetic import llama, write_header_only


def layer_names(names, stacks=None) -> list[str]:
    return [l.name for l in build_graph(names, stacks).layers]


def test_llama_order_is_numeric_and_embed_stacks_norm_head():
    names = [n for n, _, _ in llama(layers=12, hidden=8, intermediate=16, heads=2, kv_heads=1, vocab=32)]
    g = build_graph(sorted(names))  # index order is alphabetical: 1, 10, 11, 2, ...
    assert [l.name for l in g.layers] == (
        ["model.embed_tokens"] + [f"model.layers.{i}" for i in range(12)] + ["model.norm", "lm_head"])
    assert [l.kind.value for l in g.layers] == ["embed"] + ["layer"] * 12 + ["module", "head"]
    assert g.stacks == ("model.layers",)
    assert g.tied_embeddings is False
    assert [l.index for l in g.stack_layers()] == list(range(12))
    layer9 = g.layers[10]
    assert layer9.params == tuple(f"model.layers.9.{p}" for p in (
        "input_layernorm.weight", "mlp.down_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "post_attention_layernorm.weight", "self_attn.k_proj.weight", "self_attn.o_proj.weight",
        "self_attn.q_proj.weight", "self_attn.v_proj.weight"))
    assert layer9.local("model.layers.9.mlp.up_proj.weight") == "mlp.up_proj.weight"
    # The DiGraph is a single chain in that order.
    assert list(nx.topological_sort(g.graph)) == [l.name for l in g.layers]
    assert g.graph.number_of_edges() == len(g.layers) - 1
    assert execution_order(g, ["lm_head", "model.layers.10", "model.layers.9", "model.embed_tokens"]) == [
        "model.embed_tokens", "model.layers.9", "model.layers.10", "lm_head"]


def test_natural_key():
    assert sorted(["a.10.b", "a.9.b", "a.1.b", "a.100"], key=natural_key) == ["a.1.b", "a.9.b", "a.10.b", "a.100"]
    assert sorted(["experts.10.w", "experts.2.w"], key=natural_key) == ["experts.2.w", "experts.10.w"]


def test_gpt2_layout_with_tied_embeddings():
    names = ["transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight",
             "transformer.ln_f.bias"]
    names += [f"transformer.h.{i}.{p}" for i in (1, 0, 10, 2) for p in ("attn.c_attn.weight", "mlp.c_fc.weight")]
    g = build_graph(names)
    assert [l.name for l in g.layers] == [
        "transformer.wpe", "transformer.wte", "transformer.h.0", "transformer.h.1", "transformer.h.2",
        "transformer.h.10", "transformer.ln_f"]
    assert g.stacks == ("transformer.h",) and g.tied_embeddings is True
    assert g.layers[-1].params == ("transformer.ln_f.bias", "transformer.ln_f.weight")


def test_tied_llama_has_no_lm_head():
    names = [n for n, _, _ in llama(layers=2, hidden=8, intermediate=16, heads=2, kv_heads=1, vocab=32, tied=True)]
    assert build_graph(names).tied_embeddings is True


def test_meta_layout_blocks_and_output_head():
    names = ["tok_embeddings.weight", "norm.weight", "output.weight"]
    names += [f"layers.{i}.attention.wq.weight" for i in range(3)]
    g = build_graph(names)
    assert [(l.name, l.kind.value) for l in g.layers] == [
        ("tok_embeddings", "embed"), ("layers.0", "layer"), ("layers.1", "layer"), ("layers.2", "layer"),
        ("norm", "module"), ("output", "head")]
    assert g.tied_embeddings is False  # `output` is the head

    names = ["patch_embed.proj.weight", "blocks.0.attn.qkv.weight", "blocks.1.attn.qkv.weight",
             "norm.weight", "head.weight"]
    assert layer_names(names) == ["patch_embed.proj", "blocks.0", "blocks.1", "norm", "head"]


def test_vlm_vision_stack_runs_before_the_language_stack():
    names = ["language_model.lm_head.weight", "language_model.model.embed_tokens.weight",
             "language_model.model.norm.weight", "multi_modal_projector.linear_1.weight",
             "vision_tower.vision_model.embeddings.patch_embedding.weight",
             "vision_tower.vision_model.post_layernorm.weight"]
    names += [f"language_model.model.layers.{i}.mlp.w" for i in range(3)]
    names += [f"vision_tower.vision_model.encoder.layers.{i}.self_attn.q_proj.weight" for i in range(2)]
    g = build_graph(names)
    assert g.stacks == ("vision_tower.vision_model.encoder.layers", "language_model.model.layers")
    assert [l.name for l in g.layers] == [
        "language_model.model.embed_tokens",
        "vision_tower.vision_model.embeddings.patch_embedding",
        "vision_tower.vision_model.encoder.layers.0",
        "vision_tower.vision_model.encoder.layers.1",
        "language_model.model.layers.0",
        "language_model.model.layers.1",
        "language_model.model.layers.2",
        "language_model.model.norm",
        "multi_modal_projector.linear_1",
        "vision_tower.vision_model.post_layernorm",
        "language_model.lm_head",
    ]
    assert g.tied_embeddings is False


def test_moe_experts_stay_inside_their_layer():
    names = [f"model.layers.{i}.mlp.experts.{e}.w" for i in range(2) for e in (0, 1, 10, 2)]
    g = build_graph(names)
    assert [l.name for l in g.layers] == ["model.layers.0", "model.layers.1"]
    assert g.layers[0].params == tuple(f"model.layers.0.mlp.experts.{e}.w" for e in (0, 1, 2, 10))


def test_a_single_numbered_module_is_not_a_stack():
    g = build_graph(["model.norms.0.weight", "model.layers.0.w", "model.layers.1.w"])
    assert g.stacks == ("model.layers",)
    assert [l.name for l in g.layers] == ["model.layers.0", "model.layers.1", "model.norms.0"]


def test_stacks_key_overrides_detection():
    names = ["model.norms.0.weight", "model.norms.1.weight", "model.layers.0.w", "model.layers.1.w"]
    assert build_graph(names).stacks == ("model.norms", "model.layers")
    g = build_graph(names, ["model.layers"])
    assert g.stacks == ("model.layers",)
    assert [(l.name, l.kind.value) for l in g.layers] == [
        ("model.layers.0", "layer"), ("model.layers.1", "layer"),
        ("model.norms.0", "module"), ("model.norms.1", "module")]


def test_stacks_key_naming_nothing_is_a_located_error(tmp_path):
    write_header_only(tmp_path / "ckpt", toy(2), single=True)
    path = write_policy(tmp_path, "stacks: [model.layers, model.layer, blocks]\n")
    with pytest.raises(PolicyError) as e:
        build(load_policy(path), tmp_path)
    assert e.value.headline == "stacks: no numbered layers live under these prefixes"
    assert e.value.problems == [
        f"{path}:3:24: stacks[1]: 'model.layer': did you mean 'model.layers'?",
        f"{path}:3:37: stacks[2]: 'blocks' (detected: model.layers)",
    ]


def test_stacks_key_in_a_built_plan(tmp_path):
    tensors = toy(3) + [("model.norms.0.weight", "U8", (1,)), ("model.norms.1.weight", "U8", (1,))]
    write_header_only(tmp_path / "ckpt", tensors, single=True)
    plan = build(load_policy(write_policy(tmp_path, "stacks: [model.layers]\n")), tmp_path)
    assert plan.stacks == ("model.layers",)
    assert [l.name for l in plan.layers] == [
        "model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2",
        "model.norm", "model.norms.0", "model.norms.1", "lm_head"]
