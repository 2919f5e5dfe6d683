"""What a policy may not ask, and what mixed does not do for nothing: refusals and choices a policy-authoring review
found wrong (a top-k above a layer's experts, a cpu share that gains no time)."""
from __future__ import annotations

import dataclasses
import re

import pytest

from headeronly import infos, moe_toy, plan_of, policy
from planner.decide.placement import decide
from planner.errors import PolicyError
from planner.inputs.hardware import H100
from planner.inputs.policy import Workload
from planner.layers.graph import build_graph
from planner.plan import Placement

CPU = Placement.CPU


def test_mixed_puts_no_expert_on_cpu_where_the_request_is_no_faster_for_it():
    """An eager step bound by its launches takes longer with experts on cpu (its launches wait out the host's time
    at each such layer: cost.py): fewer bytes over the link then are no gain, and the experts stay on uva."""
    from test_cost import HW, moe
    hw = dataclasses.replace(HW, cpu_expert_gbps=4.0, cpu_expert_sync_us=50.0, layer_overhead_us=10**5)
    pol = dataclasses.replace(policy("mixed", budget_gib=60 * 10**6 / 2**30, step=2), cpu_experts=True,
                              workload=Workload(2, cuda_graphs=False))
    t = infos(moe())
    d = decide(build_graph(t), t, pol, hw, 2)
    assert CPU not in d.params.values()
    note = next(n for n in d.notes if n.startswith("cpu_experts: "))
    assert note.startswith("cpu_experts: no expert on cpu: predicted request")
    none, best = map(float, re.findall(r"(\d+\.\d+) ms", note))
    assert none < best  # the launches no shorter, the host's time added


def test_a_top_k_above_a_layers_experts_is_refused():
    """It read more experts a step than a layer holds: a working memory larger than the layer (a policy review)."""
    with pytest.raises(PolicyError, match=r"top-k 9 \(workload.experts_per_token, or config.json's\) is more than "
                                          r"the \d+ routed experts of a layer"):
        t = infos(moe_toy(2))
        decide(build_graph(t), t, policy(), H100, 9)
