"""What a plan says of its placements, on plain data: notes of the final placements, warnings for plans that
save little GPU memory, and the smallest budget that builds."""
from __future__ import annotations

import dataclasses
import re

import pytest

from headeronly import GPU, UVA, MiB, infos, mib, moe_toy, placed, plan_of, policy, toy
from planner.decide.placement import decide
from planner.decide.placement_errors import smallest_budget_gib
from planner.errors import BudgetError
from planner.inputs.policy import Workload
from planner.layers.graph import build_graph
from test_cost import HW, moe
from test_cpu_experts_quantized import _quantized
from test_placement import layer_params


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
    (moe_toy(2), dict()),  # offloading experts costs more working memory than it saves: the least is all on the GPU
    (toy(4), dict(rules=[(["lm_head"], "prefetch")], step=2)),
])
def test_the_suggested_budget_builds_and_one_byte_less_does_not(tensors, kw):
    text, need = suggested(tensors, policy(budget_gib=mib(0.5), **kw))
    assert int(float(text) * 2**30) == need
    d, t = plan_of(tensors, policy(budget_gib=float(text), **kw))
    gpu = sum(t[n].nbytes for n, p in d.params.items() if p is GPU)
    pools = (d.prefetch.pool_bytes if d.prefetch else 0) + (d.prefill.pool_bytes if d.prefill else 0)
    assert gpu + pools + d.summary.working_peak_bytes == need  # the experts' working memory counts too
    with pytest.raises(BudgetError):
        plan_of(tensors, policy(budget_gib=(need - 1) / 2**30, **kw))


def test_smallest_budget_gib_is_the_shortest_exact_decimal():
    assert smallest_budget_gib(128 * 1024) == "0.000122071"
    assert smallest_budget_gib(10 * 2**30) == "10"
    assert smallest_budget_gib(9 * MiB) == "0.008789063"
    for n in (1, 614400, 10662744064, 2**40 + 12345):
        assert int(float(smallest_budget_gib(n)) * 2**30) == n


def test_one_expert_off_the_gpu_costs_more_than_it_saves_and_says_so():
    """One of 8 experts of one layer on uva: the layer's experts forward gathers the touched rows in HBM each time
    (a prefill touches all 8: 24 MiB, working.py) for 3 MiB moved off the GPU."""
    d, _ = plan_of(moe_toy(layers=3, experts=8), policy(rules=[(["re:layers\\.0\\.mlp\\.experts\\.0\\."], "uva")],
                                                         stage_prefill=False))
    assert (d.summary.uva_bytes, d.summary.working_peak_bytes) == (3 * MiB, 24 * MiB)
    assert d.notes[-1] == (
        "warning: the plan saves little GPU memory: none: it takes 21.0 MiB more than keeping every weight on the GPU "
        "would; the experts' working memory takes 24.0 MiB at its peak (the rows of the touched experts off the GPU, "
        "gathered in each forward): offload more of them, or none")


def test_a_plan_that_offloads_nothing_gets_no_saving_warning_though_fp8_experts_have_working_memory():
    """Resident FP8 experts are dequantized row by row in each forward (working.py): working memory, but not a cost
    of offloading. A plan that fits whole offloads nothing: it said it took that memory "more than keeping every
    weight on the GPU would" (DeepSeek-V3, every weight resident: 31.5 GiB)."""
    t = infos(_quantized(moe(), "F8_E4M3"))
    pol = dataclasses.replace(policy("mixed", budget_gib=1.0, step=2), workload=Workload(1, prompt_tokens=512))
    d = decide(build_graph(t), t, pol, HW, 2)
    assert set(d.params.values()) == {GPU} and d.summary.working_peak_bytes > 0
    assert not any(n.startswith("warning: ") for n in d.notes), d.notes
