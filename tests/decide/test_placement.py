"""Placement as a pure function over plain data: whole placement dicts and layer lists.

The toy model (headeronly.toy): embedding 4 MiB; per layer `mlp.down_proj.weight`
2 MiB then `self_attn.o_proj.weight` 1 MiB (natural order); final norm 1 MiB;
head 4 MiB. With L layers the total is 9 + 3L MiB.
"""
from __future__ import annotations

import dataclasses
import re

import pytest

from headeronly import GPU, PREFETCH, UVA, MiB, infos, mib, offloaded_layers, placed, plan_of, policy, toy
from planner.decide.placement import resolve_backend
from planner.decide.placement_errors import smallest_budget_gib
from planner.decide.schedule import make_schedule, spread
from planner.errors import BudgetError, PolicyError
from planner.inputs.hardware import H100
from planner.layers.graph import build_graph
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
                       "warning: the plan saves little GPU memory: nothing of the 5.0 MiB offloaded; the prefill "
                       "staging buffers take 6.0 MiB (2 slots x 3.0 MiB for 2 uva layers); offload more layers to "
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

GROUP_8_2_OF_61 = [6, 7, 14, 15, 22, 23, 30, 31, 38, 39, 46, 47, 54, 55]


def test_prefetch_group_8_of_2_over_61_layers():
    t = toy(61)
    d, _ = plan_of(t, policy(group_size=8, num_in_group=2))
    assert offloaded_layers(d) == GROUP_8_2_OF_61
    assert d.params == expect(t, prefetch=layer_params(*GROUP_8_2_OF_61))
    p = d.prefetch
    assert (p.step, p.slots, p.slot_bytes, p.pool_bytes) == (1, 1, 3 * MiB, 3 * MiB)
    assert p.layouts == (Layout(3 * MiB, (Buffer(DOWN, "U8", (2 * MiB,), 0, 2 * MiB),
                                          Buffer(O, "U8", (1 * MiB,), 2 * MiB, 1 * MiB))),)
    names = [f"model.layers.{i}" for i in GROUP_8_2_OF_61]
    assert p.schedule == tuple(Transfer(n, n, 0, 0, names[k - 1]) for k, n in enumerate(names))


@pytest.mark.parametrize("group, k, layers, want", [
    (8, 1, 32, [7, 15, 23, 31]),
    (4, 4, 6, [0, 1, 2, 3, 4, 5]),
    (3, 1, 7, [2, 5]),
    (5, 2, 5, [3, 4]),
])
def test_prefetch_group_rule(group, k, layers, want):
    d, _ = plan_of(toy(layers), policy(group_size=group, num_in_group=k))
    assert offloaded_layers(d) == want


def dense_then_moe(layers=8, dense=2, experts=2):
    """DeepSeek-like: the first `dense` layers have an MLP, the others experts (1 MiB each)."""
    t = [("model.embed_tokens.weight", "U8", (4 * MiB,))]
    for i in range(layers):
        t.append((f"model.layers.{i}.self_attn.o_proj.weight", "U8", (1 * MiB,)))
        if i < dense:
            t.append((f"model.layers.{i}.mlp.down_proj.weight", "U8", (3 * MiB,)))
        else:
            t += [(f"model.layers.{i}.mlp.experts.{e}.w", "U8", (1 * MiB,)) for e in range(experts)]
    return t + [("model.norm.weight", "U8", (1 * MiB,)), ("lm_head.weight", "U8", (4 * MiB,))]


def test_prefetch_params_filter_skips_layers_without_a_match():
    t = dense_then_moe()
    d, _ = plan_of(t, policy(group_size=2, num_in_group=1, step=2, prefetch_params=["experts"]))
    # Odd layers are chosen; layer 1 is dense (no experts) and is skipped.
    assert d.params == expect(t, prefetch=[f"model.layers.{i}.mlp.experts.{e}.w" for i in (3, 5, 7) for e in (0, 1)])
    p = d.prefetch
    assert p.layouts == (Layout(2 * MiB, (Buffer("mlp.experts.0.w", "U8", (MiB,), 0, MiB),
                                          Buffer("mlp.experts.1.w", "U8", (MiB,), MiB, MiB))),)
    assert (p.step, p.slots, p.slot_bytes, p.pool_bytes) == (2, 2, 2 * MiB, 4 * MiB)
    assert p.schedule == (Transfer("model.layers.3", "model.layers.3", 0, 0, "model.layers.7"),
                          Transfer("model.layers.5", "model.layers.5", 0, 1, "model.layers.5"),
                          Transfer("model.layers.7", "model.layers.7", 0, 0, "model.layers.3"))


def test_each_layer_has_its_own_slot_image_every_tensor_256_byte_aligned():
    t = [("model.layers.0.w", "BF16", (4, 8)), ("model.layers.0.s", "F32", (2,)),
         ("model.layers.1.w", "BF16", (4, 8)), ("model.layers.1.s", "F32", (3,)),
         ("model.layers.2.w", "F16", (4, 8)), ("model.layers.2.s", "F32", (2,))]
    d, _ = plan_of(t, policy(group_size=1, step=2))
    p = d.prefetch
    assert p.layouts == (Layout(512, (Buffer("s", "F32", (2,), 0, 8), Buffer("w", "BF16", (4, 8), 256, 64))),
                         Layout(512, (Buffer("s", "F32", (3,), 0, 12), Buffer("w", "BF16", (4, 8), 256, 64))),
                         Layout(512, (Buffer("s", "F32", (2,), 0, 8), Buffer("w", "F16", (4, 8), 256, 64))))
    assert [t.layout for t in p.schedule] == [0, 1, 2]
    assert (p.slots, p.slot_bytes, p.pool_bytes) == (2, 512, 1024)


def test_a_slot_holds_the_largest_layer_not_the_union_of_all_layers_tensors():
    """DeepSeek-like: dense layers (o_proj 1 + down 3 MiB) and MoE layers (o_proj 1 + 2 experts of 1 MiB).
    vLLM's one buffer per name over all layers would make a slot 6 MiB; the largest layer is 4 MiB."""
    d, _ = plan_of(dense_then_moe(), policy(group_size=1, step=2))
    p = d.prefetch
    assert [l.bytes for l in p.layouts] == [4 * MiB, 3 * MiB]
    assert (p.slots, p.slot_bytes, p.pool_bytes) == (2, 4 * MiB, 8 * MiB)
    assert [t.layout for t in p.schedule] == [0, 0] + [1] * 6


def test_slots_never_exceed_the_prefetched_layers():
    d, _ = plan_of(toy(8), policy(group_size=4, num_in_group=1, step=5))
    assert offloaded_layers(d) == [3, 7]
    assert (d.prefetch.step, d.prefetch.slots, d.prefetch.pool_bytes) == (5, 2, 6 * MiB)


def simulate(schedule, slots: int, passes: int = 3) -> None:
    """Run forwards over the prefetched layers; fail if a layer finds a slot not holding its data,
    or if a copy overwrites a slot whose layer has not run yet in this pass."""
    order = [t.layer for t in schedule]
    slot_of = {t.layer: t.slot for t in schedule}
    starts = {}
    for t in schedule:
        starts.setdefault(t.after, []).append(t)
    content = {}
    for t in schedule[:slots]:  # the load-time copies
        content[t.slot] = t.layer
    assert sorted(content) == list(range(slots))
    for _ in range(passes):
        done = set()
        for layer in order:
            assert content[slot_of[layer]] == layer, f"{layer} would read another layer's weights"
            done.add(layer)
            for t in starts.get(layer, []):
                assert content[t.slot] in done, f"copy of {t.layer} overwrites {content[t.slot]} before it runs"
                content[t.slot] = t.layer


@pytest.mark.parametrize("count", [1, 2, 3, 5, 7, 8, 14])
@pytest.mark.parametrize("step", [1, 2, 3, 4, 8])
def test_schedule_slot_k_mod_s_after_the_previous_user_and_never_clobbers(count, step):
    t = toy(count)
    d, _ = plan_of(t, policy(group_size=1, step=step, stacks=["model.layers"]))  # 1 layer: no stack detected
    p = d.prefetch
    slots = min(step, count)
    assert (p.step, p.slots) == (step, slots)
    names = [f"model.layers.{i}" for i in range(count)]
    for k, tr in enumerate(p.schedule):
        assert (tr.layer, tr.slot) == (names[k], k % slots)
        users = [j for j in range(count) if j % slots == k % slots]
        assert tr.after == names[users[users.index(k) - 1]]  # previous user of the slot, cyclically
        if k >= slots:
            assert tr.after == names[k - slots]  # vLLM: `step` layers earlier
    simulate(p.schedule, slots)


def test_make_schedule_with_nothing_prefetched_is_none():
    t = infos(toy(2))
    g = build_graph(t)
    assert make_schedule(g, {n: GPU for n in t}, t, 2) is None


# ---------------------------------------------------------------- prefetch from a budget

def test_spread():
    assert spread(32, 4) == [7, 15, 23, 31]
    assert spread(8, 3) == [1, 4, 7]
    assert spread(5, 5) == [0, 1, 2, 3, 4]
    assert spread(7, 0) == []


def test_prefetch_budget_offloads_the_fewest_layers_spread_evenly():
    t = toy(8)  # 33 MiB; with n layers and step 1: 33 - 3n + 3 MiB
    d, _ = plan_of(t, policy(backend="prefetch", budget_gib=mib(27)))
    assert d.params == expect(t, prefetch=layer_params(1, 4, 7))
    # step 2: 33 - 3n + 6 for n >= 2: four layers
    d, _ = plan_of(t, policy(backend="prefetch", budget_gib=mib(27), step=2))
    assert offloaded_layers(d) == [1, 3, 5, 7]
    assert d.prefetch.pool_bytes == 6 * MiB


def test_prefetch_budget_zero_layers_when_rules_already_fit():
    t = toy(8)  # 33 MiB; the rules move 8 MiB, and the head is staged at prefill through a 4 MiB slot
    d, _ = plan_of(t, policy(backend="prefetch", budget_gib=mib(29),
                             rules=[(["embed_tokens", "lm_head"], "uva")]))
    assert d.params == expect(t, uva=["model.embed_tokens.weight", "lm_head.weight"])
    assert d.prefetch is None
    assert d.prefill == PrefillStaging(H100.stage_above_tokens, 1, 4 * MiB, (StagedLayer("lm_head", "lm_head", 4 * MiB),))


def test_prefetch_group_size_with_budget_is_a_check():
    t = toy(8)
    d, _ = plan_of(t, policy(group_size=4, num_in_group=2, budget_gib=mib(24)))
    assert offloaded_layers(d) == [2, 3, 6, 7]  # 33 - 12 + 3
    with pytest.raises(BudgetError, match=r"prefetch.group_size 4 / num_in_group 2 offloads too few "
                       r"layers: raise num_in_group, or remove group_size and let budget_gib decide"):
        plan_of(t, policy(group_size=4, num_in_group=2, budget_gib=mib(23)))


def test_prefetch_budget_no_fit_quotes_the_smallest_footprint_of_any_count():
    # Layers of 1, 2, 3, 4 MiB through 2 slots of the largest streamed layer: streaming
    # 0..4 layers (spread evenly) needs 19, 19, 21, 20, 17 MiB. Not monotonic, so the
    # search tries every count; the smallest, all four layers, is what the error quotes.
    t = [("model.embed_tokens.weight", "U8", (4 * MiB,))]
    t += [(f"model.layers.{i}.mlp.w", "U8", ((i + 1) * MiB,)) for i in range(4)]
    t += [("model.norm.weight", "U8", (MiB,)), ("lm_head.weight", "U8", (4 * MiB,))]
    with pytest.raises(BudgetError) as e:
        plan_of(t, policy(backend="prefetch", budget_gib=mib(15), step=2))
    assert str(e.value).startswith(
        "test.policy.yaml: the plan needs 17.0 MiB (17,825,792 bytes) of GPU memory but budget_gib "
        "0.0146484375 is 15,728,640 bytes; the smallest budget that fits this policy is "
        "budget_gib: 0.016601563 (17.0 MiB).")
    d, _ = plan_of(t, policy(backend="prefetch", budget_gib=0.016601563, step=2))
    assert d.params == expect(t, prefetch=[f"model.layers.{i}.mlp.w" for i in range(4)])
    assert (d.prefetch.slots, d.prefetch.slot_bytes, d.summary.gpu_footprint_bytes) == (2, 4 * MiB, 17 * MiB)


def test_prefetch_budget_no_fit_with_step_1():
    t = toy(4)  # 21 MiB; all 4 layers: 9 + 3 = 12 MiB at best
    with pytest.raises(BudgetError, match=r"needs 12.0 MiB .* the smallest budget that fits this policy is "
                       r"budget_gib: 0.01171875 \(12.0 MiB\)"):
        plan_of(t, policy(backend="prefetch", budget_gib=mib(11)))
    d, _ = plan_of(t, policy(backend="prefetch", budget_gib=mib(12)))
    assert offloaded_layers(d) == [0, 1, 2, 3]


def test_rules_prefetching_with_step_zero_is_an_error():
    with pytest.raises(PolicyError, match=r"test.policy.yaml: prefetch.step must be >= 1: rules place "
                       r"tensors on prefetch"):
        plan_of(toy(2), policy(backend="uva", step=0, rules=[(["lm_head"], "prefetch")]))


# ---------------------------------------------------------------- fused expert groups

def moe_toy(layers: int = 3, experts: int = 2) -> list:
    """Per layer: attention 1 MiB, then experts e: down/gate/up 1 MiB each (a fused group)."""
    out = [("model.embed_tokens.weight", "BF16", (512, 1024))]
    for i in range(layers):
        out.append((f"model.layers.{i}.self_attn.o_proj.weight", "BF16", (512, 1024)))
        for e in range(experts):
            for proj in ("down_proj", "gate_proj", "up_proj"):
                out.append((f"model.layers.{i}.mlp.experts.{e}.{proj}.weight", "BF16", (512, 1024)))
    out.append(("lm_head.weight", "BF16", (512, 1024)))
    return out


def experts_of(*layers: int, experts: int = 2) -> list[str]:
    return [f"model.layers.{i}.mlp.experts.{e}.{p}.weight" for i in layers for e in range(experts)
            for p in ("down_proj", "gate_proj", "up_proj")]


def test_uva_walk_offloads_a_fused_parameter_whole_as_vllm():
    t = moe_toy()
    # Natural order puts mlp.experts.0.down_proj first; vLLM's unit is the fused parameter: the layer's
    # down_proj over both experts (w2, 2 MiB). 1.5 MiB stops the walk after it.
    d, _ = plan_of(t, policy(offload_gib=mib(1.5)))
    assert placed(d, UVA) == [f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in (0, 1)]


def test_uva_budget_walk_moves_one_expert_of_one_parameter_at_a_time():
    t = moe_toy()  # 2 + 3 * 7 = 23 MiB
    d, _ = plan_of(t, policy(budget_gib=mib(20)))  # 3 MiB to shed: expert 0's down (1), then its gate+up (2)
    assert placed(d, UVA) == [f"model.layers.0.mlp.experts.0.{p}.weight" for p in ("down_proj", "gate_proj", "up_proj")]
    assert d.layers[1].experts == "mlp.experts: gpu 1, uva 0"  # the layer row says which experts are where


@pytest.mark.parametrize("pol, where", [
    (dict(rules=[(["re:experts\\.1\\.gate_proj"], "uva")]),
     "rules[0] (place: uva) selects model.layers.0.mlp.experts.1.gate_proj.weight but not "
     "model.layers.0.mlp.experts.1.up_proj.weight: they are one row of a fused parameter at run time"),
    (dict(offload_gib=1, uva_params=["up_proj"]),
     "uva.params selects model.layers.0.mlp.experts.0.up_proj.weight but not "
     "model.layers.0.mlp.experts.0.gate_proj.weight"),
    (dict(backend="prefetch", group_size=1, prefetch_params=["gate_proj"]),
     "prefetch.params selects 2 of the 6 tensors of fused group model.layers.0.mlp.experts (e.g. "
     "model.layers.0.mlp.experts.0.gate_proj.weight); prefetch streams a group whole"),
])
def test_splitting_a_fused_expert_or_prefetching_part_of_a_group_is_an_error(pol, where):
    with pytest.raises(PolicyError) as err:
        plan_of(moe_toy(), policy(**pol))
    text = str(err.value)
    assert "splits fused experts" in text
    assert where in text


@pytest.mark.parametrize("pol, want", [
    # a rule keeps expert 1 of layer 0 on the GPU: vLLM's walk moves the rest of each fused parameter it reaches
    (dict(offload_gib=mib(1.5), rules=[(["re:layers\\.0\\.mlp\\.experts\\.1\\."], "gpu")]),
     ["model.layers.0.mlp.experts.0.down_proj.weight", "model.layers.0.mlp.experts.0.gate_proj.weight",
      "model.layers.0.mlp.experts.0.up_proj.weight"]),
    # uva.params selects expert 0 only: the walk moves nothing else of the parameters it reaches
    (dict(offload_gib=mib(100), uva_params=["re:experts\\.0\\."]), experts_of(0, 1, 2, experts=2)[:3]
     + experts_of(1, experts=2)[:3] + experts_of(2, experts=2)[:3]),
])
def test_uva_walk_moves_nothing_a_rule_fixed_or_params_left_out(pol, want):
    d, _ = plan_of(moe_toy(), policy(**pol))
    assert placed(d, UVA) == want


def test_whole_experts_may_be_placed_apart():
    d, _ = plan_of(moe_toy(), policy(rules=[(["re:experts\\.1\\."], "uva")]))
    assert placed(d, UVA) == [f"model.layers.{i}.mlp.experts.1.{p}.weight" for i in range(3)
                              for p in ("down_proj", "gate_proj", "up_proj")]


# ---------------------------------------------------------------- a backend asked to offload must offload

@pytest.mark.parametrize("tensors, pol, message", [
    (toy(4), dict(backend="prefetch"),
     "test.policy.yaml: backend: prefetch offloads nothing: set prefetch.group_size (with num_in_group: stream "
     "the last num_in_group layers of every group, as vLLM's offload_group_size) or budget_gib (stream the "
     "fewest layers that fit)"),
    (toy(4), dict(backend="prefetch", prefetch_params=["mlp"]),
     "test.policy.yaml: backend: prefetch offloads nothing: set prefetch.group_size"),
    (toy(4), dict(backend="uva", uva_params=["mlp"]),
     "test.policy.yaml: backend: uva offloads nothing: set uva.offload_gib (GiB to offload, as vLLM's "
     "cpu_offload_gb) or budget_gib (offload until the GPU footprint fits); uva.params only narrows which "
     "tensors those offload"),
    (toy(5), dict(group_size=10, num_in_group=2),
     "test.policy.yaml: prefetch.group_size 10 is larger than the 5 layers of the layer stacks "
     "(model.layers): layer i streams iff i % 10 >= 8, so the groups never repeat; set "
     "prefetch.group_size to at most 5 (or use budget_gib and let the planner choose the layers)"),
    (toy(5), dict(group_size=6, num_in_group=3),  # it would stream layers 3 and 4: still a mistake
     "test.policy.yaml: prefetch.group_size 6 is larger than the 5 layers"),
    (dense_then_moe(), dict(group_size=4, num_in_group=1, prefetch_params=["down_proj"]),
     "test.policy.yaml: backend prefetch has nothing to offload: prefetch.group_size 4 / num_in_group 1 "
     "streams layers model.layers.3, model.layers.7, but prefetch.params selects none of their tensors (it "
     "selects e.g. model.layers.0.mlp.down_proj.weight); change prefetch.params"),
    (toy(4), dict(group_size=2, rules=[(["layers.1", "layers.3"], "gpu")]),
     "test.policy.yaml: backend prefetch has nothing to offload: prefetch.group_size 2 / num_in_group 1 "
     "streams layers model.layers.1, model.layers.3, but rules place every tensor of those layers (e.g. "
     "model.layers.1.mlp.down_proj.weight); change the rules"),
    (toy(4), dict(offload_gib=1, uva_params=["mlp"], rules=[(["mlp"], "gpu")]),
     "test.policy.yaml: backend uva has nothing to offload: uva.params selects only tensors that rules "
     "already place (e.g. model.layers.0.mlp.down_proj.weight); change uva.params or the rules"),
    (toy(4), dict(budget_gib=mib(12), uva_params=["lm_head"]),
     "test.policy.yaml: backend uva has nothing to offload: uva.params selects only tensors outside the "
     "layer stacks (e.g. lm_head.weight), which the backend never moves; place those with a rule "
     "(`{match: [...], place: uva}`)"),
    (toy(4), dict(backend="prefetch", budget_gib=mib(12), prefetch_params=["o_proj"],
                  rules=[(["o_proj"], "uva")]),
     "test.policy.yaml: backend prefetch has nothing to offload: prefetch.params selects only tensors that "
     "rules already place (e.g. model.layers.0.self_attn.o_proj.weight); change prefetch.params or the rules"),
])
def test_a_backend_that_would_offload_nothing_is_an_error_naming_the_key(tensors, pol, message):
    with pytest.raises(PolicyError) as e:
        plan_of(tensors, policy(**pol))
    assert str(e.value).startswith(message)


def test_an_empty_auto_policy_offloads_nothing_and_says_why():
    d, _ = plan_of(toy(2), policy(uva_params=["mlp"]))
    assert d.backend.value == "none" and set(d.params.values()) == {GPU}
    assert d.notes == ("nothing is offloaded: backend auto has no offload amount or budget (set "
                       "uva.offload_gib, prefetch.group_size or budget_gib) (uva.params only narrows what "
                       "uva.offload_gib or budget_gib offloads)",)


# ---------------------------------------------------------------- notes tell the final placements

def test_rules_that_offload_are_not_reported_as_nothing_offloaded():
    t = toy(4)
    d, _ = plan_of(t, policy(rules=[(["layers"], "uva")]))
    assert d.backend.value == "none" and placed(d, UVA) == layer_params(0, 1, 2, 3)
    assert d.notes == ("rules place 12.0 MiB on uva (8 tensors)",
                       "backend auto offloads nothing beyond the rules: no offload amount or budget is set")


def test_a_budget_that_fits_with_the_rules_alone_says_so():
    t = toy(8)
    d, _ = plan_of(t, policy(backend="prefetch", budget_gib=mib(29),
                             rules=[(["embed_tokens", "lm_head"], "uva")]))
    assert d.notes == ("rules place 8.0 MiB on uva (2 tensors)",
                       "the plan fits budget_gib 0.0283203125 with the rules' placements alone: backend "
                       "prefetch offloads nothing more (offloading would only cost speed)")


def test_rules_and_backend_each_report_what_they_placed():
    d, _ = plan_of(toy(4), policy(group_size=2, rules=[(["embed_tokens"], "uva")]))
    assert d.notes == ("rules place 4.0 MiB on uva (1 tensor)",
                       "backend prefetch (auto: prefetch.group_size is set): 6.0 MiB on prefetch from 2 layers")
    d, _ = plan_of(toy(4), policy(backend="uva", offload_gib=mib(3), stage_prefill=False))
    assert d.notes == ("backend uva (named by the policy): 3.0 MiB on uva from 1 layer",)


# ---------------------------------------------------------------- plans that save little GPU memory

def test_as_many_slots_as_prefetched_layers_saves_nothing():
    d, _ = plan_of(toy(4), policy(group_size=2, step=2))
    assert d.prefetch.slots == 2 and d.prefetch.pool_bytes == 6 * MiB
    assert d.notes[1:] == (
        "warning: the plan saves little GPU memory: nothing of the 6.0 MiB offloaded; the prefetch buffers "
        "take 6.0 MiB (2 slots x 3.0 MiB): there are as many slots as prefetched layers (2), so each "
        "prefetched layer has a slot of its own; lower prefetch.step or prefetch more layers",)


def test_a_prefetched_head_shares_the_slot_but_one_that_sizes_it_is_named():
    # lm_head (4 MiB) through the slot of layers 1, 3, 5, 7 (3 MiB each): one 4 MiB slot for 16 MiB moved
    d, _ = plan_of(toy(8), policy(group_size=2, rules=[(["lm_head"], "prefetch")]))
    assert d.prefetch.pool_bytes == 4 * MiB
    assert not any(n.startswith("warning: ") for n in d.notes)
    # streaming only o_proj (1 MiB a layer), the head alone makes the slot 4 MiB
    d, _ = plan_of(toy(8), policy(group_size=2, prefetch_params=["o_proj"], rules=[(["lm_head"], "prefetch")]))
    assert d.prefetch.pool_bytes == 4 * MiB
    assert d.notes[2:] == (
        "warning: prefetching lm_head sizes every slot: it needs 4.0 MiB where the other prefetched layers "
        "need at most 1.0 MiB, so the slot takes 3.0 MiB more for its sake; place it on uva or keep it on "
        "the GPU",)


def test_a_plan_saving_less_than_half_says_how_much():
    # 3 prefetched layers through 2 slots: 9 MiB offloaded, 6 MiB of buffers, 3 MiB saved
    d, _ = plan_of(toy(3), policy(group_size=1, step=2))
    assert d.notes[1:] == (
        "warning: the plan saves little GPU memory: 3.0 MiB (33% of the 9.0 MiB offloaded); the prefetch "
        "buffers take 6.0 MiB (2 slots x 3.0 MiB)",)
    d, _ = plan_of(toy(4), policy(group_size=1, step=2))  # 12 MiB, 6 MiB of buffers: half, no warning
    assert not any(n.startswith("warning: ") for n in d.notes)


# ---------------------------------------------------------------- the smallest budget is the real one

def suggested(tensors, pol) -> tuple[str, int]:
    """The budget_gib the error suggests, and the footprint in bytes it quotes."""
    with pytest.raises(BudgetError) as e:
        plan_of(tensors, pol)
    m = re.search(r"needs .* \(([\d,]+) bytes\) of GPU memory.* is budget_gib: (\S+) \(", str(e.value))
    return m[2], int(m[1].replace(",", ""))


def uneven_layers():
    """Layers of different shapes: with 2 slots, prefetching more layers can cost more than it moves."""
    t = [("model.embed_tokens.weight", "U8", (4 * MiB,))]
    t += [(f"model.layers.{i}.mlp.w", "U8", ((i % 3 + 1) * MiB,)) for i in range(9)]
    return t + [("model.norm.weight", "U8", (MiB,)), ("lm_head.weight", "U8", (4 * MiB,))]


def last_layer_largest():
    """Layers of 1, 1, 1, 1, 10 MiB: on uva, the last one frees 10 MiB but grows both staging slots by 9."""
    t = [("model.embed_tokens.weight", "U8", (4 * MiB,))]
    t += [(f"model.layers.{i}.mlp.w", "U8", ((10 if i == 4 else 1) * MiB,)) for i in range(5)]
    return t + [("model.norm.weight", "U8", (MiB,)), ("lm_head.weight", "U8", (4 * MiB,))]


def test_a_uva_walk_that_never_fits_stops_where_the_footprint_was_smallest():
    # 23 MiB; with layers 0..k on uva (resident + slots): 22 + 1, 21 + 2, 20 + 2, 19 + 2, then 9 + 2 x 10
    t = last_layer_largest()
    with pytest.raises(BudgetError, match=r"needs 21.0 MiB \(22,020,096 bytes\).* is budget_gib: 0.020507813 "):
        plan_of(t, policy(budget_gib=mib(20)))
    d, _ = plan_of(t, policy(budget_gib=mib(21)))
    assert placed(d, UVA) == [f"model.layers.{i}.mlp.w" for i in range(4)]
    assert (d.prefill.slots, d.prefill.slot_bytes, d.summary.gpu_footprint_bytes) == (2, MiB, 21 * MiB)


@pytest.mark.parametrize("tensors, kw", [
    (toy(4), dict()),                                         # uva walk, down to all stack tensors
    (toy(4), dict(stage_prefill=False)),
    (last_layer_largest(), dict()),                           # uva walk: the footprint grows at the end
    (toy(4), dict(offload_gib=mib(3))),                       # uva amount: the budget is a check
    (toy(8), dict(backend="prefetch")),                       # the fewest layers that fit
    (toy(8), dict(backend="prefetch", step=3)),
    (uneven_layers(), dict(backend="prefetch", step=2)),      # footprint not monotonic in the layer count
    (toy(8), dict(group_size=4, num_in_group=2, step=2)),     # group: the budget is a check
    (moe_toy(4), dict(backend="mixed", step=2)),
    (toy(4), dict(rules=[(["lm_head"], "prefetch")], step=2)),
])
def test_the_suggested_budget_builds_and_one_byte_less_does_not(tensors, kw):
    text, need = suggested(tensors, policy(budget_gib=mib(0.5), **kw))
    assert int(float(text) * 2**30) == need
    d, t = plan_of(tensors, policy(budget_gib=float(text), **kw))
    gpu = sum(t[n].nbytes for n, p in d.params.items() if p is GPU)
    assert gpu + (d.prefetch.pool_bytes if d.prefetch else 0) + (d.prefill.pool_bytes if d.prefill else 0) == need
    with pytest.raises(BudgetError):
        plan_of(tensors, policy(budget_gib=(need - 1) / 2**30, **kw))


def test_smallest_budget_gib_is_the_shortest_exact_decimal():
    assert smallest_budget_gib(128 * 1024) == "0.000122071"
    assert smallest_budget_gib(10 * 2**30) == "10"
    assert smallest_budget_gib(9 * MiB) == "0.008789063"
    for n in (1, 614400, 10662744064, 2**40 + 12345):
        assert int(float(smallest_budget_gib(n)) * 2**30) == n
