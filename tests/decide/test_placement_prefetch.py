"""Placement with prefetch, on plain data: vLLM's group rule, slot images, the schedule's slots and copy
triggers, and the fewest layers a budget needs."""
from __future__ import annotations

import pytest

from headeronly import GPU, MiB, infos, mib, offloaded_layers, plan_of, policy, toy
from planner.decide.schedule import make_schedule, spread
from planner.errors import BudgetError, PolicyError
from planner.inputs.hardware import H100
from planner.layers.graph import build_graph
from planner.plan import Buffer, Layout, PrefillStaging, StagedLayer, Transfer
from test_placement import DOWN, O, expect, layer_params

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


@pytest.mark.parametrize("params", [(), ("experts",), ("mlp",), ("self_attn",), ("weight", "experts"),
                                    ("shared_experts", "kv_a_proj_with_mqa"), ("layers",)])
@pytest.mark.parametrize("rules", [(), ((("model.layers.3.self_attn",), "gpu"),)])
def test_streamed_layers_moved_by_their_marks_are_moved_by_name(params, rules, monkeypatch):
    """backends.py `_streamable` and footprint.py `move_picked` (a layer's picks and their scales by place) place
    what `chosen` and `move` (by name) place: the whole decision, on an FP8 checkpoint whose weights' scales the
    picks leave out or take."""
    from planner.decide import backends
    from planner.decide.placement import decide
    from planner.layers.alike import Shapes
    from planner.layers.scales import layer_pairs
    from synthetic import deepseek_v3
    t = infos(deepseek_v3(layers=9, dense_layers=1, hidden=256, intermediate=384, experts=16, moe_intermediate=128,
                          heads=2, q_lora=128, kv_lora=128, nope=16, rope=8, v_head=16, vocab=64))
    graph, shapes = build_graph(t), Shapes(t)
    quantized, _ = layer_pairs(graph.layers, t, (128, 128), shapes)
    assert quantized.positions
    pol = policy(group_size=2, num_in_group=1, step=2, prefetch_params=params, rules=rules)
    fast = decide(graph, t, pol, quantized=quantized, shapes=shapes)
    monkeypatch.setattr(backends, "_streamable", lambda *a: None)
    assert fast == decide(graph, t, pol, quantized=dict(quantized), shapes=shapes)
    assert fast.prefetch is not None
