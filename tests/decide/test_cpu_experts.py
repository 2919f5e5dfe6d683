"""Routed experts on cpu (issue 24, the planner's half): rules place them, the plan counts them apart from the GPU
and the link, the cost model times the host's work beside the GPU's (after it at one token, as the runtime runs),
and nothing else may go there."""
from __future__ import annotations

import dataclasses

import pytest

from headeronly import GPU, UVA, experts_of, infos, mib, moe_toy, placed, plan_of, policy, write_policy
from planner.decide.cost import CostModel
from planner.decide.placement import decide
from planner.decide.reads import later
from planner.errors import PolicyError
from planner.inputs.hardware import H100
from planner.inputs.policy import Workload, load_policy
from planner.layers.graph import build_graph
from planner.layers.groups import FusedGroups
from planner.plan import Placement

CPU = Placement.CPU
MIB = 2**20


def test_a_rule_puts_experts_on_cpu_and_the_plan_counts_them_off_the_gpu_and_the_link():
    d, t = plan_of(moe_toy(3), policy(rules=[(["experts"], "cpu")]))
    assert placed(d, CPU) == experts_of(0, 1, 2)
    assert [l.cpu for l in d.layers] == [0, 6 * MIB, 6 * MIB, 6 * MIB, 0]
    s = d.summary
    assert (s.cpu_bytes, s.uva_bytes, s.prefetch_bytes) == (18 * MIB, 0, 0)
    assert s.gpu_bytes == sum(i.nbytes for i in t.values()) - 18 * MIB
    # the footprint adds the experts' working memory: a prefill staging a layer's 2 experts (every one: no top-k)
    # through a ring of its 6 MiB, and the host engine's outputs (192 tokens x 2 experts x hidden 512 in bf16)
    assert (s.working_prefill_bytes, s.working_buffer_bytes) == (6 * MIB + 6 * MIB, 192 * 2 * 512 * 2)
    assert s.gpu_footprint_bytes == s.gpu_bytes + 12 * MIB + 192 * 2 * 512 * 2
    assert s.predicted_h2d_bytes_per_step == 0  # the host computes them: nothing crosses the link
    assert (d.cost.cpu_threads, d.cost.cpu_expert_gbps, d.cost.cpu_expert_sync_us) == (
        H100.cpu_threads, H100.cpu_expert_gbps, H100.cpu_expert_sync_us)
    assert any("of routed experts on cpu: the host CPU computes them beside the GPU" in n for n in d.notes)


def test_a_layer_with_experts_on_cpu_costs_the_host_its_reads_and_its_call():
    """Without a top-k the cost model reads every expert each step: 6 MiB per layer, on the host (memory to itself:
    the built-in profile's rate x CPU_ALONE, 1.2), after the layer's 1 MiB of attention read from HBM (one token)."""
    cpu, _ = plan_of(moe_toy(3), policy(rules=[(["experts"], "cpu")]))
    gpu, _ = plan_of(moe_toy(3), policy())
    host = (H100.moe_layer_gpu_us + MIB / (H100.hbm_read_gbps * 1e3) + 6 * MIB / (H100.cpu_expert_gbps * 1.2e3)
            + H100.cpu_expert_sync_us)
    assert cpu.layers[1].us == round(host) > gpu.layers[1].us
    assert [l.us for l in cpu.layers[1:4]] == [round(host)] * 3
    assert cpu.layers[0].us == gpu.layers[0].us  # the embedding: no experts, no change


@pytest.mark.parametrize("batch", [1, 4])
def test_the_host_reads_each_touched_expert_once_beside_the_gpu(batch):
    """Top-1 of 4 experts, 0-1 on cpu, 2-3 on uva. The host's kernel (native.cpp) reads each touched expert once,
    as the GPU does, 1 - (3/4)^T of its 3 MiB, while the GPU reads its own: the layer ends when the later side
    does, at one token as at more (measured, docs/host-experts/). The GPU reads its uva experts at the rate the
    link keeps while the cores read host memory too."""
    t = infos(moe_toy(2, experts=4))
    graph = build_graph(t, None)
    groups = FusedGroups.find(n for layer in graph.stack_layers() for n in layer.params)
    place = {n: CPU if ".experts.0." in n or ".experts.1." in n else UVA if ".experts." in n else GPU for n in t}
    layer = CostModel(graph, t, H100, batch, groups, 1).predict(place).layers[1]
    touched = 2 * 3 * MIB * (1 - (3 / 4) ** batch)  # either side's experts' bytes a step reads
    gpu = (H100.moe_layer_gpu_us + (1 * MIB + 2 * touched) / (H100.hbm_read_gbps * 1e3)
           + touched / (H100.uva_beside_cpu_gbps * 1e3))  # the link shares host memory with the cores
    host = touched / (H100.cpu_expert_gbps * 1e3) + H100.cpu_expert_sync_us
    # which experts a step touches varies, and each side's time with it: each expert, 3 MiB, read with chance q
    q = 1 - (3 / 4) ** batch
    each = [3 * MIB / (H100.cpu_expert_gbps * 1e3)] * 2 + [3 * MIB / (H100.uva_beside_cpu_gbps * 1e3)] * 2
    var = sum(q * (1 - q) * t * t for t in each)
    assert layer.gpu_us == round(later(gpu, H100.moe_layer_gpu_us + host - gpu, var))
    assert layer.gpu_us > round(max(gpu, H100.moe_layer_gpu_us + host))  # the later side's mean: not the means' later
    assert H100.uva_beside_cpu_gbps == H100.uva_read_gbps * 47.0 / 50.3


@pytest.mark.parametrize("beside", [0.0, 20.0])
def test_beside_the_cores_the_link_reads_at_its_own_rate(beside):
    """Where the GPU's side is the later one (a host fast enough), the layer's uva experts are read at the
    profile's uva_read_beside_cpu_gbps, or its default; a layer with none on cpu reads at uva_read_gbps."""
    t = infos(moe_toy(2, experts=4))
    graph = build_graph(t, None)
    groups = FusedGroups.find(n for layer in graph.stack_layers() for n in layer.params)
    hw = dataclasses.replace(H100, cpu_expert_gbps=1e5, cpu_expert_sync_us=0.0, uva_read_beside_cpu_gbps=beside)
    rate = beside or H100.uva_read_gbps * 47.0 / 50.3
    place = {n: CPU if ".experts.0." in n else UVA if ".experts." in n else GPU for n in t}
    unslowed = dataclasses.replace(hw, uva_read_beside_cpu_gbps=hw.uva_read_gbps)
    split, alone = (CostModel(graph, t, h, 4, groups, 1).predict(place).layers[1] for h in (hw, unslowed))
    uva_bytes = 3 * 3 * MIB * (1 - (3 / 4) ** 4)  # the three uva experts' touched share
    assert abs(split.gpu_us - alone.gpu_us - uva_bytes / 1e3 * (1 / rate - 1 / hw.uva_read_gbps)) <= 1  # rounding
    assert split.gpu_us > alone.gpu_us
    no_cpu = {n: UVA if p is CPU else p for n, p in place.items()}
    assert (CostModel(graph, t, hw, 4, groups, 1).predict(no_cpu).layers[1].gpu_us
            == CostModel(graph, t, unslowed, 4, groups, 1).predict(no_cpu).layers[1].gpu_us)


def test_some_experts_on_cpu_others_on_uva_and_gpu_in_one_layer():
    d, _ = plan_of(moe_toy(2, experts=4), policy(rules=[(["re:experts\\.[01]\\."], "cpu"),
                                                          (["re:experts\\.2\\."], "uva")]))
    assert d.layers[1].experts == "mlp.experts: cpu 0-1, gpu 3, uva 2"
    assert (d.layers[1].cpu, d.layers[1].uva, d.summary.cpu_bytes) == (6 * MIB, 3 * MIB, 12 * MIB)
    assert placed(d, GPU)[-1] == "lm_head.weight" and placed(d, UVA) == experts_of(0, 1, experts=4)[6:9] + \
        experts_of(0, 1, experts=4)[18:21]


@pytest.mark.parametrize("match, named", [
    (["o_proj"], "test.policy.yaml: rules[0] (place: cpu) selects model.layers.0.self_attn.o_proj.weight, "
                 "model.layers.1.self_attn.o_proj.weight, model.layers.2.self_attn.o_proj.weight, which are not "
                 "routed experts"),
    (["lm_head"], "test.policy.yaml: rules[0] (place: cpu) selects lm_head.weight, which is not a routed expert"),
])
def test_cpu_on_what_is_no_routed_expert_is_refused_naming_it(match, named):
    with pytest.raises(PolicyError) as e:
        plan_of(moe_toy(3), policy(rules=[(match, "cpu")]))
    assert str(e.value).splitlines()[0] == "test.policy.yaml: place: cpu on tensors that are not whole routed experts"
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith(named)
    assert "narrow the rule's match to the experts" in e.value.problems[0]


def test_part_of_an_expert_on_cpu_is_refused_naming_what_the_rule_left_out():
    """The runtime computes an expert whole on the host, and refused such a plan only at load."""
    with pytest.raises(PolicyError) as e:
        plan_of(moe_toy(2), policy(rules=[(["re:experts\\.0\\.(gate|up)_proj"], "cpu")]))
    assert e.value.problems == [  # (a policy read from a file: file:line:column of the rule's match)
        "test.policy.yaml: rules[0] (place: cpu) puts part of an expert on cpu, leaving out "
        "model.layers.0.mlp.experts.0.down_proj.weight, model.layers.1.mlp.experts.0.down_proj.weight: the host "
        "computes an expert whole (its gate, up and down projections), so select all of its tensors (e.g. "
        "`re:experts\\.0\\.` for expert 0, or `experts`)"]
    d, _ = plan_of(moe_toy(2), policy(rules=[(["re:experts\\.0\\.(gate|up)_proj"], "cpu"),
                                             (["re:experts\\.0\\.down_proj"], "cpu")]))  # two rules, one expert
    assert placed(d, CPU) == [n for n in experts_of(0, 1) if ".experts.0." in n]


def test_a_budget_walk_leaves_experts_on_cpu_where_the_rule_put_them():
    # 17 of the 23 MiB stay on the GPU, and the experts' working memory (12.4 MiB: a prefill staging layer 0's
    # experts through the ring, the host engine's outputs) comes on top: 25 MiB makes the walk move the rest to uva
    d, _ = plan_of(moe_toy(3), policy(budget_gib=mib(25), rules=[(["re:layers\\.0\\.mlp\\.experts"], "cpu")]))
    assert placed(d, CPU) == experts_of(0)
    assert d.summary.gpu_footprint_bytes <= mib(25) * 2**30  # the walk fits the rest with uva
    assert placed(d, UVA)


def test_a_long_prompt_stages_the_experts_on_cpu_through_the_ring_and_no_slot():
    """Above the threshold a GEMM on the GPU beats the host's GEMV per pair: the plan lists the layers, their
    experts streamed through the ring (no slot: the ring is prefill working memory), as the cost model predicts
    the prefill."""
    d, _ = plan_of(moe_toy(3), policy(rules=[(["experts"], "cpu")]))
    assert [(l.layer, l.bytes) for l in d.prefill.layers] == [(f"model.layers.{i}", 0) for i in range(3)]
    assert (d.prefill.above_tokens, d.prefill.slots, d.prefill.ring_bytes) == (H100.stage_above_tokens, 0, 6 * MIB)
    assert d.summary.stage_buffer_bytes == 0 and d.summary.working_prefill_bytes == 6 * MIB + d.prefill.ring_bytes
    unstaged, _ = plan_of(moe_toy(3), policy(rules=[(["experts"], "cpu")], stage_experts=False))
    assert unstaged.prefill is None  # `stage_experts: false`: the host computes the prompt's pairs too


@pytest.mark.parametrize("stage_experts", [False, True])
def test_a_long_prompt_costs_the_experts_on_cpu_as_uva_ones_staged_or_not(stage_experts):
    """Above stage_above_tokens the runtime's host computes nothing (runtime/execute/host/engine.py `takes`): the
    GPU takes the experts on cpu as uva ones, streamed through the ring where the plan stages them and gathered
    over the link where it does not (`stage_experts: false`), and the prefill prediction is the uva plan's."""
    cpu, _ = plan_of(moe_toy(3), policy(rules=[(["experts"], "cpu")], stage_experts=stage_experts))
    uva, _ = plan_of(moe_toy(3), policy(rules=[(["experts"], "uva")], stage_experts=stage_experts))
    assert cpu.cost.prompt_tokens > H100.stage_above_tokens
    assert cpu.cost.prefill_us == uva.cost.prefill_us > 0


def _mixed_cpu(cpu_gbps: float, cpu_experts: bool = True, batch: int = 2):
    """test_cost.py's 4-layer MoE (8 experts of 3 MB per layer, top-2) under a 60 MB budget, mixed, replayed. At
    batch 2 (from batch 4, experts on uva would gather every expert a step touches: mixed streams whole layers
    there instead, test_cost.py) mixed puts experts on uva, whose share the host may compute."""
    from test_cost import HW, moe
    hw = dataclasses.replace(HW, cpu_expert_gbps=cpu_gbps, cpu_expert_sync_us=50.0)
    pol = dataclasses.replace(policy("mixed", budget_gib=60 * 10**6 / 2**30, step=2), cpu_experts=cpu_experts,
                              workload=Workload(batch, cuda_graphs=True))
    t = infos(moe())
    return decide(build_graph(t), t, pol, hw, 2)


def test_mixed_puts_experts_on_cpu_where_the_host_makes_the_request_faster():
    without, fast = _mixed_cpu(4.0, cpu_experts=False), _mixed_cpu(4.0)
    assert CPU not in without.params.values()
    on_cpu = placed(fast, CPU)
    assert on_cpu and all(".experts." in n for n in on_cpu)
    experts = {n.rsplit(".", 2)[0] for n in on_cpu}  # whole experts: gate, up and down together
    assert on_cpu == sorted(f"{e}.{p}.weight" for e in experts for p in ("down_proj", "gate_proj", "up_proj"))
    note = next(n for n in fast.notes if n.startswith("cpu_experts: "))
    assert "of each layer's uva experts on cpu, the least read first: predicted request" in note
    assert fast.summary.predicted_step_us < without.summary.predicted_step_us
    # the same tensors on the GPU; the working memory loses the lookahead (2 experts, 6 MB: the host's modules read
    # nothing ahead) and gains the host engine's outputs (192 tokens x 2 experts x 1000 rows of down_proj, a byte each)
    assert fast.summary.gpu_bytes == without.summary.gpu_bytes
    assert fast.summary.working_peak_bytes == without.summary.working_peak_bytes - 6 * 10**6 + 192 * 2 * 1000
    assert fast.summary.gpu_footprint_bytes < without.summary.gpu_footprint_bytes <= 60 * 10**6
    assert fast.cost.cpu_threads == H100.cpu_threads


def test_mixed_leaves_the_cpu_alone_where_the_host_is_slower_and_says_so():
    slow = _mixed_cpu(0.01)
    assert CPU not in slow.params.values()
    assert any(n.startswith("cpu_experts: no expert on cpu: predicted request") for n in slow.notes)


def test_with_several_gpus_each_process_gets_its_share_of_the_host():
    """Each GPU's process gets its share of the host's threads and their reads (hardware.py `one_of`): at 2 GPUs 7
    of 15, and its link's rate while the other copies too; mixed plans each share with them."""
    hw = dataclasses.replace(H100, cpu_expert_alone_gbps=90.0)
    assert hw.one_of(2) == dataclasses.replace(hw, h2d_copy_gbps=hw.parallel_h2d_copy_gbps, cpu_threads=7,
                                               cpu_rates_threads=7, cpu_expert_gbps=35.0, cpu_expert_alone_gbps=42.0)
    assert hw.one_of(1) is hw and dataclasses.replace(H100, cpu_threads=3).one_of(4).cpu_threads == 0
    # a host twice as fast as _mixed_cpu(4.0)'s, over 2 GPUs: the same experts on cpu, with 7 threads each
    from test_cost import HW, moe
    pol = dataclasses.replace(policy("mixed", budget_gib=60 * 10**6 / 2**30, step=2), cpu_experts=True, gpus=2,
                              workload=Workload(2, cuda_graphs=True))
    t, hw = infos(moe()), dataclasses.replace(HW, cpu_expert_gbps=8.0, cpu_expert_sync_us=50.0, cpu_threads=14,
                                              parallel_h2d_copy_gbps=HW.h2d_copy_gbps)
    shared = decide(build_graph(t), t, pol, hw.one_of(2), 2)
    assert placed(shared, CPU) == placed(_mixed_cpu(4.0), CPU)
    assert (shared.cost.cpu_threads, shared.cost.cpu_expert_gbps) == (7, 4.0)


def test_cpu_experts_is_read_from_the_policy_and_ignored_with_a_warning_outside_mixed(tmp_path):
    (tmp_path / "ckpt").mkdir()
    mixed = load_policy(write_policy(tmp_path, "backend: mixed\nbudget_gib: 1\ncpu_experts: true\n"))
    assert mixed.cpu_experts and not mixed.warnings
    other = load_policy(write_policy(tmp_path, "cpu_experts: true\n", name="o.policy.yaml"))
    assert other.warnings == (f"{tmp_path / 'o.policy.yaml'}:3:1: cpu_experts is set but backend is not mixed; "
                              "it is ignored (rules place experts on cpu with `place: cpu`)",)


@pytest.mark.parametrize("beside, alone", [(0.0, 0.0), (44.5, 92.5)])
def test_a_profile_round_trips_the_rates_beside_and_alone(tmp_path, beside, alone):
    """uva_read_beside_cpu_gbps and cpu_expert_alone_gbps are written where they are set, read back, and valid to
    the schema; absent, the profile gets the defaults the cost model takes (uva_read_gbps x 47.0/50.3, and
    cpu_expert_gbps x 1.2: hardware.py CPU_ALONE)."""
    from planner.inputs.hardware import dumps_hardware, load_hardware
    hw = dataclasses.replace(H100, uva_read_beside_cpu_gbps=beside, cpu_expert_alone_gbps=alone)
    (tmp_path / "hw.yaml").write_text(dumps_hardware(hw))
    back = load_hardware(tmp_path / "hw.yaml")
    assert ("uva_read_beside_cpu_gbps" in dumps_hardware(hw)) == bool(beside)
    assert ("cpu_expert_alone_gbps" in dumps_hardware(hw)) == bool(alone)
    assert (back.uva_read_beside_cpu_gbps, back.cpu_expert_alone_gbps) == (beside, alone)
    assert back.uva_beside_cpu_gbps == (beside or back.uva_read_gbps * 47.0 / 50.3)
    assert back.cpu_alone_gbps == (alone or back.cpu_expert_gbps * 1.2)


def test_the_host_reads_at_its_own_rate_where_the_layer_reads_nothing_over_the_link():
    """Every expert of a layer on cpu: nothing reads host memory over the link beside the cores, so the host's
    time is at cpu_expert_alone_gbps; one expert of it on uva, and the host's is at cpu_expert_gbps."""
    t = infos(moe_toy(2, experts=4))
    graph = build_graph(t, None)
    groups = FusedGroups.find(n for layer in graph.stack_layers() for n in layer.params)
    hw = dataclasses.replace(H100, cpu_expert_gbps=10.0, cpu_expert_alone_gbps=20.0)
    alone = {n: CPU if ".experts." in n else GPU for n in t}
    split = {n: UVA if ".experts.3." in n else p for n, p in alone.items()}
    us = [CostModel(graph, t, h, 1, groups, 1).predict(place).layers[1].gpu_us
          for h in (hw, dataclasses.replace(hw, cpu_expert_alone_gbps=0.0)) for place in (alone, split)]
    gpu = H100.moe_layer_gpu_us + MIB / (H100.hbm_read_gbps * 1e3)  # attention's 1 MiB; the host's side, later:
    each = 3 * MIB / 20e3  # an expert's 3 MiB at 20 GB/s, each read with chance 1/4 (top-1 of 4)
    host = H100.moe_layer_gpu_us + 4 * each / 4 + H100.cpu_expert_sync_us
    assert us[0] == round(later(gpu, host - gpu, 4 * (1 / 4) * (3 / 4) * each ** 2))
    assert us[2] > us[0] + 100  # without the figure: at 12 GB/s (10 x CPU_ALONE)
    assert us[1] == us[3] > us[0]  # beside the link: at 10 GB/s either way


@pytest.mark.parametrize("share", [0.5, 0.7])
def test_the_later_sides_mean_is_the_exact_one_within_half_a_percent(share):
    """reads.py `later` at batch 1 over Qwen3-30B-A3B's top 8 of 128 experts, `share` of them on cpu (118 us each
    on the host, 200 over the link: the H100 machine's), against E[max] over the exact (hypergeometric) count of a
    token's experts on cpu, whose independent-touch model it approximates."""
    from math import comb
    on_cpu, host_us, link_us = round(128 * share), 118.0, 200.0
    chance = [comb(on_cpu, x) * comb(128 - on_cpu, 8 - x) / comb(128, 8) for x in range(9)]
    exact = sum(p * max(180 + host_us * x, 120 + link_us * (8 - x)) for x, p in enumerate(chance))
    q = 8 / 128
    gpu, host = 120 + link_us * 8 * (1 - share), 180 + host_us * 8 * share
    var = q * (1 - q) * (on_cpu * host_us ** 2 + (128 - on_cpu) * link_us ** 2)
    assert later(gpu, host - gpu, var) == pytest.approx(exact, rel=0.005)
    assert exact > max(gpu, host) + 60  # the means' later is far off


def test_fp8_experts_on_cpu_by_rule_are_built_and_mxfp4_ones_refused_naming_them():
    """The runtime's host computes block-scaled FP8 (E4M3) experts, not MXFP4 ones, which it refused at load after
    `plan build` had written the plan: the build places FP8 experts on cpu with their scales and refuses MXFP4
    ones, naming them and the fix."""
    from synthetic import deepseek_v3, gpt_oss
    tensors = deepseek_v3(layers=2, dense_layers=1, hidden=256, intermediate=512, experts=4, moe_intermediate=128,
                          heads=2, q_lora=128, kv_lora=128, nope=64, rope=32, v_head=64, vocab=512, mtp_layers=0)
    d, _ = plan_of(tensors, policy(rules=[(["re:layers\\.1\\.mlp\\.experts\\.0\\."], "cpu")]))
    expert = "model.layers.1.mlp.experts.0"
    assert sorted(n for n in d.params if d.params[n] is CPU) == [
        f"{expert}.{p}.weight{s}" for p in ("down_proj", "gate_proj", "up_proj") for s in ("", "_scale_inv")]
    tensors = gpt_oss(layers=2, hidden=128, intermediate=128, experts=4, heads=2, kv_heads=1, head_dim=64, vocab=512)
    with pytest.raises(PolicyError) as e:
        plan_of(tensors, policy(rules=[(["re:layers\\.1\\.mlp\\.experts\\."], "cpu")]))
    assert str(e.value).splitlines()[0] == "test.policy.yaml: place: cpu on tensors that are not whole routed experts"
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith(
        "test.policy.yaml: rules[0] (place: cpu) selects model.layers.1.mlp.experts.down_proj_blocks, ")
    assert e.value.problems[0].endswith(
        "quantized: the host computes bf16, fp16, fp32 and block-scaled FP8 (E4M3) experts only (the runtime would "
        "refuse the plan); place them on uva")
