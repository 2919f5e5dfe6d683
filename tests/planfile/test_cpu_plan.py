"""A plan with routed experts on cpu as a file: it round-trips, validates, shows and diffs with a cpu column, a hand
edit that puts anything else there is refused, and this runtime refuses to apply it (it cannot compute them yet);
plans without cpu read as before (tests/test_examples.py holds them byte for byte)."""
from __future__ import annotations

import pytest

from headeronly import moe_toy, write_policy
from planner.decide.build import build
from planner.errors import PlanFileError
from planner.inputs.checkpoint import open_checkpoint
from planner.inputs.hardware import H100
from planner.inputs.policy import load_policy
from planner.planfile import dumps, loads
from planner.planfile.diff import diff_data, diff_text
from planner.planfile.show import print_to, show, show_data
from synthetic import write_header_only

CPU_RULE = "rules:\n  - match: [experts]\n    place: cpu\n"
UVA_RULE = "rules:\n  - match: [experts]\n    place: uva\n"


@pytest.fixture
def plans(tmp_path):
    """(uva plan, cpu plan, their texts, the checkpoint) over a 3-layer MoE toy with 2 experts per layer."""
    write_header_only(tmp_path / "ckpt", moe_toy(3))
    out = []
    for name, body in (("uva", UVA_RULE), ("cpu", CPU_RULE)):
        plan = build(load_policy(write_policy(tmp_path, body, name=f"{name}.policy.yaml")), tmp_path)
        out.append((plan, dumps(plan)))
    return out, open_checkpoint(tmp_path / "ckpt")


def rendered(items) -> str:
    import io
    buf = io.StringIO()
    print_to(buf, items)
    return buf.getvalue()


def test_the_file_round_trips_and_says_cpu_where_it_is(plans):
    (_, _), (plan, text) = plans[0]
    assert "cpu_bytes: 18874368\n" in text and f"cpu_threads: {H100.cpu_threads}" in text
    # the host's figures the prediction assumed, which the load checks the host against
    assert (f"cpu_expert_gbps: {H100.cpu_expert_gbps!r}, cpu_expert_sync_us: {H100.cpu_expert_sync_us!r}}}\n"
            in text)
    assert "{name: model.layers.1, gpu: 1048576, uva: 0, prefetch: 0, cpu: 6291456," in text
    assert text.count(": cpu\n") == 18
    again = loads(text, "p.plan.yaml", plans[1].tensors)
    assert again == plan and dumps(again) == text


def test_a_plan_without_cpu_has_no_cpu_keys(plans):
    (_, text), _ = plans[0]
    assert "cpu_bytes" not in text and "cpu:" not in text and "cpu_threads" not in text and "cpu_expert" not in text


def test_show_has_a_cpu_column_and_says_what_the_host_computes(plans):
    (_, _), (plan, _) = plans[0]
    out = rendered(show(plan))
    header = next(l for l in out.splitlines() if l.strip().startswith("layer"))
    assert header.split()[:5] == ["layer", "gpu", "uva", "prefetch", "cpu"]
    assert (f"host CPU: computes 18.0 MiB of routed experts with {H100.cpu_threads} threads (assumed: "
            f"{H100.cpu_expert_gbps:g} GB/s and {H100.cpu_expert_sync_us:g} us a call), kept in host memory") in out
    data = show_data(plan)
    assert data["layers"][1]["cpu"] == 6 * 2**20 and data["summary"]["cpu_bytes"] == 18 * 2**20
    assert data["cost"]["cpu_threads"] == H100.cpu_threads
    assert (data["cost"]["cpu_expert_gbps"], data["cost"]["cpu_expert_sync_us"]) == (H100.cpu_expert_gbps,
                                                                                     H100.cpu_expert_sync_us)
    (uva, _), _ = plans[0]
    assert "cpu" not in show_data(uva)["layers"][1] and "cpu" not in rendered(show(uva)).split("\n\n")[1].split()[:6]


def test_diff_moves_experts_from_uva_to_cpu_with_a_cpu_column(plans):
    (uva, _), (cpu, _) = plans[0]
    d = diff_data(uva, cpu)
    assert list(d["moved"]) == ["uva->cpu"] and len(d["moved"]["uva->cpu"]) == 18
    assert d["layers"][0] == {"name": "model.layers.0", "gpu": 0, "uva": -6 * 2**20, "prefetch": 0,
                              "cpu": 6 * 2**20}
    assert d["summary"]["cpu_bytes"] == 18 * 2**20
    text = rendered(diff_text(d))
    assert "model.layers.0   uva -> cpu: mlp.experts (fused, 6 tensors)" in text
    header = next(l for l in text.splitlines() if l.strip().startswith("layer"))
    assert header.split() == ["layer", "moved", "gpu", "uva", "prefetch", "cpu"]


def test_a_hand_edit_putting_a_dense_tensor_on_cpu_is_refused_naming_it(plans):
    (_, _), (_, text) = plans[0]
    bad = text.replace("model.layers.1.self_attn.o_proj.weight: gpu", "model.layers.1.self_attn.o_proj.weight: cpu")
    with pytest.raises(PlanFileError) as e:
        loads(bad, "p.plan.yaml")
    assert any("params.model.layers.1.self_attn.o_proj.weight: cpu holds routed experts only" in p
               for p in e.value.problems)
