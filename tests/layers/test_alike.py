"""Layers alike (planner/layers/alike.py) and the fast name classification (expert_names.py) give exactly what
the per-name definitions give: the patterns of expert_names.py and prefused.py, `FusedGroups.find`,
`Names.select`, `is_expert`."""
from __future__ import annotations

import pytest

from headeronly import infos
from planner.inputs.patterns import Names, compile_pattern
from planner.layers.alike import select
from planner.layers.expert_names import match, matches
from planner.layers.graph import build_graph
from planner.layers.groups import FusedGroups, is_expert
from synthetic import deepseek_v3, gpt_oss, llama4_text, qwen2_vl

ODD = ["m.experts.3.up_proj.weight", "m.experts.3.up_proj", "m.experts.gate_up_proj", "m.experts.3", "m.experts.3.",
       "m.experts.", "m.experts.3x", "a.experts.b.experts.3.w", "a.experts.3.w.experts.x", "x.experts.03.a.b.c",
       "e.experts.1.w\n", "n", "", ".experts.0.w", "experts.0.w", "model.experts.4.w1.weight", "m.experts..x"]


def names_of(tensors) -> list[str]:
    return [n for n, _, _ in tensors]


CHECKPOINTS = {
    "deepseek": names_of(deepseek_v3(layers=5, dense_layers=2, hidden=64, intermediate=128, experts=6,
                                     moe_intermediate=32, heads=2, q_lora=32, kv_lora=16, nope=16, rope=8,
                                     v_head=16, vocab=64)),
    "gpt-oss": names_of(gpt_oss(layers=2, hidden=64, intermediate=64, experts=4, heads=2, kv_heads=1, head_dim=16,
                                vocab=64)),
    "llama4": names_of(llama4_text(layers=4, hidden=64, intermediate=32, intermediate_mlp=64, experts=4, heads=2,
                                   kv_heads=1, head_dim=16, vocab=64)),
    "qwen2-vl": names_of(qwen2_vl(layers=2, hidden=64, intermediate=128, heads=2, kv_heads=1, vocab=64, depth=2,
                                  vision=32, vision_mlp=64)),
    # a stack named `experts`, a tensor named as its layer, empty segments
    "odd": ["model.experts.0.w1.weight", "model.experts.1.w1.weight", "model.experts.2.w1.weight",
            "model.experts.3.w1.weight", "scale", "a..b", "head.experts.gate_up_proj", "head.experts.0.w"],
}


def test_matches_is_the_patterns_name_by_name():
    names = ODD + [n for ns in CHECKPOINTS.values() for n in ns]
    assert matches(names) == [match(n) for n in names]
    assert matches(ODD[:10]) == [match(n) for n in ODD[:10]]  # without a newline anywhere: the fast path


@pytest.mark.parametrize("model", CHECKPOINTS)
def test_layers_alike_find_what_the_names_say(model):
    names = CHECKPOINTS[model]
    graph = build_graph(names)
    stack = graph.stack_layers()
    tensors = infos((n, "BF16", (4, 4, 4)) for n in names)
    found = FusedGroups.find([n for l in stack for n in l.params], {n: (4, 4, 4) for n in names}, 4)
    alike = FusedGroups.of_layers(stack, tensors, 4)
    assert (alike.members, alike.group_of, alike.index_of, alike.rows_of, alike.not_experts) == (
        found.members, found.group_of, found.index_of, found.rows_of, found.not_experts)
    assert (alike.param_of, alike.expert_of) == (found.param_of, found.expert_of)
    for layer in graph.layers:
        assert layer.expert_tensors == {n for n in layer.params if is_expert(n)}


@pytest.mark.parametrize("model", CHECKPOINTS)
def test_patterns_select_per_template_what_they_select_name_by_name(model):
    names = CHECKPOINTS[model]
    graph = build_graph(names)
    index = Names(n for l in graph.layers for n in l.params)
    for texts in (["experts"], ["embed_tokens", "lm_head"], ["layers"], ["0"], ["mlp.experts", "experts"],
                  ["re:experts\\.1"], ["weight"], ["q_proj", "blocks"], ["merger"], ["w1", "b"], ["scale"],
                  ["model"], ["experts.0"], [""]):
        patterns = [compile_pattern(t) for t in texts]
        assert select(graph.layers, patterns, index) == index.select(patterns), texts


def test_layer_numbers_and_order_do_not_depend_on_how_the_names_come():
    """_layer_runs gives a layer's hit to the names that start as it did (a run as long as the stack's last, where that
    holds); build_graph sorts layers alike once: neither depends on the index's order (shuffled here), and both
    give the patterns' per-name answers."""
    import random

    from planner.layers.graph import _NUMBERED, _layer_runs
    names = [n for ns in CHECKPOINTS.values() for n in ns] + ["a.1.b\n.2.c", "x.12.y", "x.12", ".5.q", "x.1.2.z"]
    shuffled = random.Random(0).sample(names, len(names))
    odd = ["s.1.a", "s.1.b", "s.2.a", "t", "s.2.b", "s.3.a", "s.3.b", "s.3.c", "s.4.a", "s.4.b", "s.4.c", "s.4.d"]
    for order in (names, shuffled, odd):
        runs = _layer_runs(order)
        assert [i for _, i, j in runs for i in range(i, j)] == list(range(len(order)))
        assert [hit for hit, i, j in runs for _ in range(i, j)] == [m.groups("") for m in map(_NUMBERED.match, order)]
        assert not any(order[j].startswith(f"{hit[0]}.{hit[1]}.") for hit, _, j in runs if hit[1] and j < len(order))
    for model, ns in CHECKPOINTS.items():
        mixed = random.Random(1).sample(ns, len(ns))
        assert [(l.name, l.params) for l in build_graph(mixed).layers] == \
               [(l.name, l.params) for l in build_graph(ns).layers], model


@pytest.mark.parametrize("model", CHECKPOINTS)
def test_a_selection_per_layer_is_the_set_of_names(model):
    """selection.py: each layer's picks are the set's, in the layer's order; a group it says none splits, none
    does (groups.py `split_units`); the patterns here include some that select part of a group."""
    from planner.layers.groups import split_units
    from planner.layers.selection import Selection
    names = CHECKPOINTS[model]
    graph = build_graph(names)
    groups = FusedGroups.of_layers(graph.stack_layers(), infos((n, "BF16", (4, 4, 4)) for n in names), 4)
    index = Names(n for l in graph.layers for n in l.params)
    for texts in (["experts"], ["layers"], ["0"], ["weight"], ["w1", "b"], ["down_proj", "experts"], ["1"],
                  ["mlp"], ["re:experts\\.1"], ["experts.0"], ["gate_up_proj"], [""]):
        patterns = [compile_pattern(t) for t in texts]
        picked = Selection(graph.layers, patterns, index)
        want = index.select(patterns)
        assert set(picked) == want and len(picked) == len(want), texts
        for layer in graph.layers:
            assert picked.of(layer) == [n for n in layer.params if n in want], (texts, layer.name)
        if picked.splits_no_group(groups):
            assert split_units(groups, want, "x", True) == split_units(groups, want, "x", False) == [], texts
