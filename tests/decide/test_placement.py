"""Placement as a pure function over plain data: whole placement dicts and layer lists.

The toy model (headeronly.toy): embedding 4 MiB; per layer `mlp.down_proj.weight`
2 MiB then `self_attn.o_proj.weight` 1 MiB (natural order); final norm 1 MiB;
head 4 MiB. With L layers the total is 9 + 3L MiB.
"""
from __future__ import annotations

import dataclasses

import pytest

from headeronly import GPU, PREFETCH, UVA, MiB, mib, placed, plan_of, policy, toy
from planner.decide.placement import resolve_backend
from planner.errors import BudgetError, PolicyError
from planner.inputs.hardware import H100
from planner.plan import Buffer, LayerBytes, Layout, PrefillStaging, StagedLayer, Transfer

DOWN, O = "mlp.down_proj.weight", "self_attn.o_proj.weight"


def layer_params(*layers: int, of=(DOWN, O)) -> list[str]:
    return [f"model.layers.{i}.{p}" for i in layers for p in of]


def bytes_only(layers) -> tuple:
    """The layers with the cost model's predictions zeroed (tests/decide/test_cost.py checks those)."""
    return tuple(dataclasses.replace(l, h2d=0, us=0, why=None) for l in layers)


def expect(tensors, **placements) -> dict:
    """Every tensor on the GPU except the listed names (kind -> names)."""
    out = {n: GPU for n, _, _ in tensors}
    for kind, names in placements.items():
        for n in names:
            out[n] = {"uva": UVA, "prefetch": PREFETCH}[kind]
    return out


# ---------------------------------------------------------------- uva

def test_uva_walks_params_in_order_and_overshoots_by_the_last_one():
    t = toy(4)
    d, _ = plan_of(t, policy(offload_gib=mib(4)))
    # down 2 -> 2 < 4, o_proj 1 -> 3 < 4, layer 1 down 2 -> 5: stop (5 MiB > 4 MiB, as vLLM)
    assert d.params == expect(t, uva=layer_params(0) + ["model.layers.1.mlp.down_proj.weight"])
    assert d.backend.value == "uva"
    assert list(d.params) == (["model.embed_tokens.weight"] + layer_params(0, 1, 2, 3)
                              + ["model.norm.weight", "lm_head.weight"])
    assert bytes_only(d.layers) == (
        LayerBytes("model.embed_tokens", gpu=4 * MiB),
        LayerBytes("model.layers.0", uva=3 * MiB),
        LayerBytes("model.layers.1", gpu=1 * MiB, uva=2 * MiB),
        LayerBytes("model.layers.2", gpu=3 * MiB),
        LayerBytes("model.layers.3", gpu=3 * MiB),
        LayerBytes("model.norm", gpu=1 * MiB),
        LayerBytes("lm_head", gpu=4 * MiB),
    )
    assert d.prefetch is None
    # both uva layers are staged at prefill: 2 slots of the larger (3 MiB), more than the 5 MiB moved
    assert d.prefill == PrefillStaging(H100.stage_above_tokens, 2, 3 * MiB, (StagedLayer("model.layers.0", "model.layers.0", 3 * MiB),
                                                         StagedLayer("model.layers.1", "model.layers.1", 2 * MiB)))
    assert d.summary.gpu_footprint_bytes == 16 * MiB + 6 * MiB
    assert d.notes == ("backend uva (auto: uva.offload_gib is set): 5.0 MiB on uva from 2 layers",
                       "warning: the plan saves little GPU memory: none: it takes 1.0 MiB more than keeping every "
                       "weight on the GPU would; the prefill staging buffers take 6.0 MiB (2 slots x 3.0 MiB for 2 uva layers); offload more layers to "
                       "uva, or set `uva: {stage_prefill: false}` to read them in place at prefill")


def test_uva_exact_amount_stops_at_it():
    t = toy(4)
    d, _ = plan_of(t, policy(offload_gib=mib(3)))
    assert placed(d, UVA) == layer_params(0)


def test_uva_offloads_only_stack_params_even_when_asked_for_more():
    t = toy(2)
    d, _ = plan_of(t, policy(offload_gib=100))
    assert d.params == expect(t, uva=layer_params(0, 1))


def test_uva_params_filter():
    t = toy(4)
    d, _ = plan_of(t, policy(offload_gib=mib(3), uva_params=["mlp"]))
    assert d.params == expect(t, uva=layer_params(0, 1, of=[DOWN]))


def test_uva_budget_driven_offloads_in_order_until_it_fits():
    t = toy(4)  # 21 MiB
    d, _ = plan_of(t, policy(budget_gib=mib(17), stage_prefill=False))
    assert d.params == expect(t, uva=layer_params(0) + layer_params(1, of=[DOWN]))
    assert d.notes == ("backend uva (auto: budget_gib is set): 5.0 MiB on uva from 2 layers",)
    assert d.prefill is None
    d, _ = plan_of(t, policy(budget_gib=mib(18), stage_prefill=False))
    assert placed(d, UVA) == layer_params(0)


def test_the_uva_walk_to_a_budget_pays_for_the_staging_slots():
    """Staged at prefill, uva layers take 2 slots of the largest: the first two layers moved free
    nothing (3 MiB moved, a 3 MiB slot added each), every later one its 3 MiB."""
    t = toy(4)  # 21 MiB; after k whole layers: 21 - 3k + 3 min(k, 2)
    d, _ = plan_of(t, policy(budget_gib=mib(17)))
    assert d.params == expect(t, uva=layer_params(0, 1, 2) + layer_params(3, of=[DOWN]))  # 21 - 11 + 6 = 16
    assert (d.summary.gpu_footprint_bytes, d.summary.stage_buffer_bytes) == (16 * MiB, 6 * MiB)
    assert [(l.layer, l.bytes) for l in d.prefill.layers] == [
        ("model.layers.0", 3 * MiB), ("model.layers.1", 3 * MiB), ("model.layers.2", 3 * MiB),
        ("model.layers.3", 2 * MiB)]
    assert d.notes == (
        "backend uva (auto: budget_gib is set): 11.0 MiB on uva from 4 layers",
        "warning: the plan saves little GPU memory: 5.0 MiB (45% of the 11.0 MiB offloaded); the prefill staging "
        "buffers take 6.0 MiB (2 slots x 3.0 MiB for 4 uva layers); offload more layers to uva, or set "
        "`uva: {stage_prefill: false}` to read them in place at prefill")
    d, _ = plan_of(t, policy(budget_gib=mib(18)))
    assert placed(d, UVA) == layer_params(0, 1, 2)  # 21 - 9 + 6


def test_uva_amount_with_a_budget_is_a_check():
    t = toy(4)
    d, _ = plan_of(t, policy(offload_gib=mib(3), budget_gib=mib(18), stage_prefill=False))
    assert placed(d, UVA) == layer_params(0)
    with pytest.raises(BudgetError) as e:
        plan_of(t, policy(offload_gib=mib(3), budget_gib=mib(17), stage_prefill=False))
    assert str(e.value) == (
        "test.policy.yaml: the plan needs 18.0 MiB (18,874,368 bytes) of GPU memory but budget_gib "
        "0.0166015625 is 17,825,792 bytes; the smallest budget that fits this policy is "
        "budget_gib: 0.017578125 (18.0 MiB).\n"
        "  Pinned to the GPU outside the layer stacks: model.embed_tokens 4.0 MiB, lm_head 4.0 MiB, "
        "model.norm 1.0 MiB.\n"
        "  uva.offload_gib: 0.0029296875 offloads too little: raise it, or remove it and let "
        "budget_gib decide how much to offload.")
    # staged at prefill, uva layers take 2 slots of 3 MiB: 9 MiB offloaded need 21 - 9 + 6 = 18 MiB
    d, _ = plan_of(t, policy(offload_gib=mib(9), budget_gib=mib(18)))
    assert placed(d, UVA) == layer_params(0, 1, 2) and d.summary.gpu_footprint_bytes == 18 * MiB
    with pytest.raises(BudgetError) as e:
        plan_of(t, policy(offload_gib=mib(9), budget_gib=mib(17)))
    assert str(e.value).startswith(
        "test.policy.yaml: the plan needs 18.0 MiB (18,874,368 bytes) of GPU memory but budget_gib "
        "0.0166015625 is 17,825,792 bytes; the smallest budget that fits this policy is "
        "budget_gib: 0.017578125 (18.0 MiB).\n")
    assert str(e.value).endswith(
        "budget_gib decide how much to offload.\n"
        "  6.0 MiB of it are the prefill staging buffers: `uva: {stage_prefill: false}` drops them (uva tensors "
        "are then read in place at prefill too, slower past a few hundred tokens).")


def test_no_fit_names_the_smallest_budget_and_what_is_pinned():
    t = toy(4)  # 9 MiB outside the stacks can never move
    with pytest.raises(BudgetError) as e:
        plan_of(t, policy(budget_gib=mib(8), stage_prefill=False))
    assert str(e.value) == (
        "test.policy.yaml: the plan needs 9.0 MiB (9,437,184 bytes) of GPU memory but budget_gib "
        "0.0078125 is 8,388,608 bytes; the smallest budget that fits this policy is "
        "budget_gib: 0.008789063 (9.0 MiB).\n"
        "  Pinned to the GPU outside the layer stacks: model.embed_tokens 4.0 MiB, lm_head 4.0 MiB, "
        "model.norm 1.0 MiB.\n"
        "  No choice of offloaded layers fits. Move more to host memory with a rule (for example "
        "`rules: [{match: [embed_tokens], place: uva}]`), or raise budget_gib.")
    d, _ = plan_of(t, policy(budget_gib=0.008789063, stage_prefill=False))  # the suggestion is exactly 9 MiB
    assert placed(d, UVA) == layer_params(0, 1, 2, 3)
    # with the staging slots (2 x 3 MiB) the smallest is 15 MiB, and the error says what they take
    with pytest.raises(BudgetError) as e:
        plan_of(t, policy(budget_gib=mib(8)))
    assert str(e.value).startswith("test.policy.yaml: the plan needs 15.0 MiB (15,728,640 bytes) of GPU memory")
    assert str(e.value).endswith("\n  6.0 MiB of it are the prefill staging buffers: `uva: {stage_prefill: "
                                 "false}` drops them (uva tensors are then read in place at prefill too, slower "
                                 "past a few hundred tokens).")
    d, _ = plan_of(t, policy(budget_gib=0.014648438))
    assert placed(d, UVA) == layer_params(0, 1, 2, 3)


# ---------------------------------------------------------------- nothing to offload / auto

@pytest.mark.parametrize("kw", [
    {"budget_gib": mib(21)},
    {"budget_gib": mib(40), "offload_gib": mib(4)},
    {"budget_gib": mib(40), "group_size": 2},
    {"budget_gib": mib(40), "backend": "prefetch"},
])
def test_whole_checkpoint_fits_the_budget_nothing_is_offloaded(kw):
    t = toy(4)
    d, _ = plan_of(t, policy(**kw))
    assert d.params == expect(t)
    assert d.backend.value == "none" and d.prefetch is None
    assert d.notes == (f"the whole checkpoint (21.0 MiB) fits budget_gib {kw['budget_gib']}: "
                       "nothing is offloaded (offloading would only cost speed)",)


def test_no_settings_keep_everything_on_the_gpu():
    t = toy(3)
    d, _ = plan_of(t, policy())
    assert d.params == expect(t) and d.backend.value == "none"
    assert d.notes == ("nothing is offloaded: backend auto has no offload amount or budget (set "
                       "uva.offload_gib, prefetch.group_size or budget_gib)",)


@pytest.mark.parametrize("kw, want", [
    ({}, ("none", "no offload amount or budget is set")),
    ({"group_size": 4, "offload_gib": 1}, ("prefetch", "prefetch.group_size is set")),
    ({"offload_gib": 1, "budget_gib": 3}, ("uva", "uva.offload_gib is set")),
    ({"budget_gib": 3}, ("uva", "budget_gib is set")),
    ({"backend": "uva", "group_size": 4}, ("uva", None)),
    ({"backend": "prefetch"}, ("prefetch", None)),
    ({"backend": "mixed", "budget_gib": 3}, ("mixed", None)),
])
def test_auto_backend_resolution(kw, want):
    backend, why = resolve_backend(policy(**kw))
    assert (backend.value, why) == want


def test_tied_embeddings_note():
    d, _ = plan_of(toy(2, tied=True), policy())
    assert d.notes[-1] == "tied embeddings: the checkpoint has no lm_head tensor; the head reuses the embedding"


# ---------------------------------------------------------------- rules

def test_rules_first_match_wins_and_place_anything():
    t = toy(4)
    d, _ = plan_of(t, policy(offload_gib=mib(4), rules=[
        (["embed_tokens"], "uva"),
        (["layers.0", "lm_head"], "gpu"),
        (["re:layers\\.[12]\\.mlp"], "uva"),
        (["mlp"], "gpu"),
    ]))
    # Rules fix embed, layer 0, lm_head, layers 1-2 mlp (uva) and layer 3 mlp (gpu); the uva walk
    # then takes the free params in order: o_proj of layers 1, 2, 3 (3 MiB < 4 MiB, all of them).
    assert d.params == expect(t, uva=["model.embed_tokens.weight", *layer_params(1, 2, of=[DOWN]),
                                      *layer_params(1, 2, 3, of=[O])])


def test_a_rule_for_every_tensor_leaves_the_backend_nothing_to_offload():
    with pytest.raises(PolicyError) as e:
        plan_of(toy(2), policy(offload_gib=100, rules=[(["re:."], "gpu")]))
    assert str(e.value) == ("test.policy.yaml: backend uva has nothing to offload: rules place every tensor "
                            "of the layer stacks (e.g. model.layers.0.mlp.down_proj.weight); change the rules")


def test_rules_can_prefetch_outside_the_stacks():
    t = toy(2)
    d, _ = plan_of(t, policy(rules=[(["lm_head", "embed_tokens"], "prefetch")], step=1))
    assert d.params == expect(t, prefetch=["model.embed_tokens.weight", "lm_head.weight"])
    # Both layers are one 4 MiB U8 `weight`: one layout serves both, hooked at their own modules.
    assert d.prefetch.layouts == (Layout(4 * MiB, (Buffer("weight", "U8", (4 * MiB,), 0, 4 * MiB),)),)
    assert d.prefetch.schedule == (Transfer("model.embed_tokens", "model.embed_tokens", 0, 0, "lm_head"),
                                   Transfer("lm_head", "lm_head", 0, 0, "model.embed_tokens"))


# ---------------------------------------------------------------- prefetch
