"""Quantized routed experts on cpu (the planner's half): `backend: mixed` with `cpu_experts: true` moves block-scaled
FP8 E4M3 experts to cpu with their scales, as the runtime's host kernel computes them (runtime/execute/host/native.cpp),
and leaves E5M2 and MXFP4 ones where they were."""
from __future__ import annotations

import dataclasses

from headeronly import UVA, infos, placed, policy
from planner.decide.placement import decide
from planner.inputs.hardware import H100
from planner.inputs.policy import Workload
from planner.layers.graph import build_graph
from planner.plan import Placement

CPU = Placement.CPU


def _quantized(tensors: list, dtype: str) -> list:
    """test_cost.py's `moe` with its experts stored `dtype` (1000 x 1000 bytes, FP8) with 128 x 128 F32 scales."""
    return [q for n, d, s in tensors for q in ([(n, dtype, s), (n + "_scale_inv", "F32", (8, 8))] if ".experts." in n
                                               else [(n, d, s)])]


def test_mixed_puts_fp8_experts_on_cpu_with_their_scales_and_not_e5m2_ones():
    """The host's kernel (native.cpp) computes block-scaled FP8 E4M3 experts, read with their scales; a one-token
    prompt at batch 1 leaves the experts' dequantized copies out of the working memory (working.py)."""
    from test_cost import HW, moe
    hw = dataclasses.replace(HW, cpu_expert_gbps=4.0, cpu_expert_sync_us=50.0)
    pol = dataclasses.replace(policy("mixed", budget_gib=60 * 10**6 / 2**30, step=2), cpu_experts=True,
                              workload=Workload(1, cuda_graphs=True, prompt_tokens=1))
    for dtype in ("F8_E4M3", "F8_E5M2"):
        t = infos(_quantized(moe(), dtype))
        d = decide(build_graph(t), t, pol, hw, 2)
        on_cpu = placed(d, CPU)
        note = next(n for n in d.notes if n.startswith("cpu_experts: "))
        if dtype == "F8_E5M2":
            assert not on_cpu and note == "cpu_experts: no whole routed expert of a decode layer on uva to compute on cpu"
            continue
        assert on_cpu and "of each layer's uva experts on cpu, the least read first: predicted request" in note
        experts = {n.rsplit(".", 2)[0] for n in on_cpu}  # whole experts: each projection's weight and scales
        assert on_cpu == sorted(f"{e}.{p}.weight{s}" for e in experts for p in ("down_proj", "gate_proj", "up_proj")
                                for s in ("", "_scale_inv"))
        assert d.summary.cpu_bytes == len(experts) * 3 * (1000 * 1000 + 8 * 8 * 4)  # stored bytes


def test_mixed_puts_no_mxfp4_expert_on_cpu():
    """gpt-oss's MXFP4 experts on uva stay there: the host does not compute them (and, pre-fused as released, no
    tensor of them is one whole expert, the unit that mixed moves to cpu)."""
    from synthetic import gpt_oss
    t = infos(gpt_oss(layers=2, hidden=256, intermediate=256, experts=8, heads=4, kv_heads=2, head_dim=64,
                      vocab=1024))
    pol = dataclasses.replace(policy("mixed", budget_gib=sum(i.nbytes for i in t.values()) * 0.8 / 2**30, step=2),
                              cpu_experts=True, workload=Workload(1, cuda_graphs=True, prompt_tokens=1))
    d = decide(build_graph(t), t, pol, dataclasses.replace(H100, cpu_expert_gbps=1e4), 2)
    assert any(".experts.gate_up_proj_blocks" in n for n in placed(d, UVA)) and CPU not in d.params.values()
    assert "cpu_experts: no whole routed expert of a decode layer on uva to compute on cpu" in d.notes


def test_the_host_costs_an_fp8_byte_what_a_bf16_element_costs():
    """native.cpp converts FP8 as it reads it and its cores set the pace (docs/fp8-cpu/: every FP8 expert on cpu ran
    at 0.52x its prediction at the bf16 byte rate): a layer of FP8 experts on cpu takes the host time of bf16 experts
    of the same elements, twice its bytes, plus its scales' bytes."""
    from test_cost import HW, moe
    from planner.decide.cost import CostModel
    from planner.layers.groups import FusedGroups

    def host_us(tensors, hw, prefill=False):
        t = infos(tensors)
        graph = build_graph(t)
        model = CostModel(graph, t, hw, 1, FusedGroups.of_layers(graph.stack_layers(), t), 2, prompt_tokens=4)
        got = model.predict({n: CPU if ".experts." in n else Placement.GPU for n in t})
        return got.prefill_us if prefill else got.layers[1].gpu_us  # a 4-token prompt: the host computes it too

    hw = dataclasses.replace(HW, cpu_expert_gbps=4.0, cpu_expert_alone_gbps=4.0, cpu_expert_sync_us=0.0)
    fp8 = host_us(_quantized(moe(), "F8_E4M3"), hw)
    bf16 = host_us([(n, "BF16", s) if ".experts." in n else (n, d, s) for n, d, s in moe()], hw)
    fp8_no_scales = host_us([(n, "F8_E4M3", s) if ".experts." in n else (n, d, s) for n, d, s in moe()], hw)
    assert fp8_no_scales == bf16 > 2000  # a layer of 2 touched experts: 12 MB of bf16 elements at 4 GB/s, not half
    assert 0 <= fp8 - fp8_no_scales <= 1  # the scales: 768 bytes an expert
    bf16_prompt, fp8_prompt = (host_us([(n, dtype, s) if ".experts." in n else (n, d, s) for n, d, s in moe()], hw, True)
                               for dtype in ("BF16", "F8_E4M3"))
    assert fp8_prompt == bf16_prompt > 2000
