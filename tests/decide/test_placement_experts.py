"""Placement of fused expert groups, on plain data; and a backend asked to offload what it cannot: one error
naming the key."""
from __future__ import annotations

import dataclasses

import pytest

from headeronly import GPU, UVA, MiB, experts_of, infos, mib, moe_toy, placed, plan_of, policy, toy
from planner.decide.placement import decide
from planner.errors import PolicyError
from planner.inputs.policy import Workload
from planner.layers.graph import build_graph
from synthetic import gpt_oss
from test_placement_prefetch import dense_then_moe


def test_uva_walk_offloads_a_fused_parameter_whole_as_vllm():
    t = moe_toy()
    # Natural order puts mlp.experts.0.down_proj first; vLLM's unit is the fused parameter: the layer's
    # down_proj over both experts (w2, 2 MiB). 1.5 MiB stops the walk after it.
    d, _ = plan_of(t, policy(offload_gib=mib(1.5)))
    assert placed(d, UVA) == [f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in (0, 1)]


def test_uva_budget_walk_moves_one_expert_of_one_parameter_at_a_time():
    t = infos(moe_toy())  # 2 + 3 * 7 = 23 MiB; an expert 3 MiB: down_proj 1, gate_up 2
    # at top 1 and a one-token prompt the experts' working memory is the one expert a token touches (3 MiB), so
    # 22 MiB leaves 19 for the tensors: 4 MiB to shed: expert 0's down (1), its gate+up (2), then expert 1's down (1)
    pol = dataclasses.replace(policy(budget_gib=mib(22)), workload=Workload(prompt_tokens=1))
    d = decide(build_graph(t), t, pol, top_k=1)
    assert placed(d, UVA) == [f"model.layers.0.mlp.experts.0.{p}.weight" for p in ("down_proj", "gate_proj", "up_proj")
                              ] + ["model.layers.0.mlp.experts.1.down_proj.weight"]
    # the layer row says which experts of which fused parameter are where
    assert d.layers[1].experts == "mlp.experts.down_proj.weight: uva 0-1; mlp.experts.gate_up_proj.weight: gpu 1, uva 0"
    assert (d.summary.gpu_bytes, d.summary.working_peak_bytes, d.summary.gpu_footprint_bytes) == (
        19 * MiB, 3 * MiB, 22 * MiB)


@pytest.mark.parametrize("pol, where", [
    (dict(rules=[(["re:experts\\.1\\.gate_proj"], "uva")]),
     "rules[0] (place: uva) selects model.layers.0.mlp.experts.1.gate_proj.weight but not "
     "model.layers.0.mlp.experts.1.up_proj.weight (and in 2 more experts alike): they are one row of a fused "
     "parameter at run time"),
    (dict(offload_gib=1, uva_params=["up_proj"]),
     "uva.params selects model.layers.0.mlp.experts.0.up_proj.weight but not "
     "model.layers.0.mlp.experts.0.gate_proj.weight"),
    (dict(backend="prefetch", group_size=1, prefetch_params=["gate_proj"]),
     "prefetch.params selects 2 of the 6 tensors of fused group model.layers.0.mlp.experts (e.g. "
     "model.layers.0.mlp.experts.0.gate_proj.weight) (and 2 more groups alike); prefetch streams a group whole"),
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


def test_vllms_offload_params_naming_part_of_a_pre_fused_group_is_refused_under_prefetch_and_fits_uva():
    """vLLM streams just the parameters `offload_params` names (gpt-oss's `gate_up_proj`); offplan prefetches a
    group whole, so that is an error (README: the policy's vLLM equivalents); uva.params places just them."""
    t = gpt_oss(layers=2, hidden=64, intermediate=64, experts=4, heads=4, kv_heads=2, head_dim=16, vocab=256,
                mxfp4=False)
    gate_up = ["gate_up_proj", "gate_up_proj_bias"]
    with pytest.raises(PolicyError) as err:
        plan_of(t, policy(backend="prefetch", group_size=2, prefetch_params=gate_up))
    assert err.value.problems[0].startswith(
        "prefetch.params selects 2 of the 4 tensors of fused group model.layers.0.mlp.experts (e.g. "
        "model.layers.0.mlp.experts.gate_up_proj) (and 1 more group alike); prefetch streams a group whole")
    d, _ = plan_of(t, policy(backend="uva", offload_gib=1, uva_params=gate_up))
    assert placed(d, UVA) == [f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in gate_up]


def test_mixed_gives_each_strategy_its_share_on_cpu_and_keeps_the_fastest_request(monkeypatch):
    """cpu_experts: every fitting strategy's placement is tried with its best share on cpu, not only the one mixed
    picks without the host; here the spread one wins with the host where the one in execution order won without."""
    import dataclasses

    from headeronly import infos, placed, policy
    from planner.decide import mixed
    from planner.decide.placement import decide
    from planner.inputs.policy import Workload
    from planner.layers.graph import build_graph
    from planner.plan import Placement
    from test_cost import HW, moe
    tried = []
    real = mixed.on_cpu
    monkeypatch.setattr(mixed, "on_cpu", lambda fp, *a: tried.append(real(fp, *a)) or tried[-1])
    t = infos(moe())
    pol = dataclasses.replace(policy("mixed", budget_gib=70 * 10**6 / 2**30, step=2),
                              workload=Workload(1, cuda_graphs=True))
    hw = dataclasses.replace(HW, cpu_expert_gbps=4.0, cpu_expert_sync_us=50.0)
    without = decide(build_graph(t), t, pol, hw, 2)
    assert not tried and any(n.startswith("mixed chose 'sparse->uva, dense->prefetch'") for n in without.notes)
    d = decide(build_graph(t), t, dataclasses.replace(pol, cpu_experts=True), hw, 2)
    assert len(tried) >= 2  # one per fitting strategy
    new = pol.workload.new_tokens
    fastest = min((p for _, p, _ in tried), key=lambda p: p.request_us(new))
    assert d.summary.predicted_step_us == fastest.step_us
    assert fastest.request_us(new) < tried[0][1].request_us(new)  # not the first strategy's
    note = next(n for n in d.notes if n.startswith("cpu_experts: "))
    assert note.endswith("on the placement of 'sparse round the layers->uva, dense->prefetch': the fastest request "
                         "with its share on cpu ('sparse->uva, dense->prefetch' was without)")
    assert {n.split(".")[2] for n in placed(d, Placement.CPU)} == {"0", "1", "2", "3"}


def test_a_budget_error_names_the_rules_that_pin_to_the_gpu():
    """`place: gpu` on the experts under a budget they cannot fit: the error names the rule and its bytes, and asks
    to narrow it (it named only the embedding and the head, and suggested moving the embedding: a policy review)."""
    from planner.errors import BudgetError
    with pytest.raises(BudgetError) as e:
        plan_of(moe_toy(2), policy(budget_gib=mib(8) / 2**30, rules=[(["experts"], "gpu")]))
    lines = str(e.value).splitlines()
    assert lines[2] == "  Pinned to the GPU by rules (place: gpu): rules[0] 12.0 MiB."
    assert lines[3].startswith("  No choice of offloaded layers fits beside what the rules pin: narrow the place: "
                               "gpu rules")


def test_a_rule_an_earlier_one_shadows_whole_is_a_warning():
    d, _ = plan_of(moe_toy(2), policy(rules=[(["experts"], "uva"), (["re:experts\\.0\\."], "gpu")]))
    assert ("warning: rules[1] places nothing: an earlier rule places every tensor it matches (the first rule that "
            "matches a tensor wins); move it up, or remove it") in d.notes
    d, _ = plan_of(moe_toy(2), policy(rules=[(["re:experts\\.0\\."], "gpu"), (["experts"], "uva")]))
    assert not any("places nothing" in n for n in d.notes)
