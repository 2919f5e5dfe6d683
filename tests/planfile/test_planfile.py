"""The plan file: deterministic bytes, exact round trip, schema and consistency checks, atomic writes."""
from __future__ import annotations

import os
import stat

import jsonschema
import pytest
import yaml

from headeronly import MiB, toy, write_policy
from planner.decide.build import build, build_file
from planner.errors import OffplanError, PlanFileError
from planner.files import write_atomic
from planner.inputs.checkpoint import open_checkpoint
from planner.inputs.policy import load_policy
from planner.inputs.schema import schema
from planner.plan import Placement
from planner.planfile import dumps, load_plan, loads
from synthetic import write_header_only

POLICIES = {
    "none": "",
    "uva": "uva:\n  offload_gib: 0.005\n",
    "prefetch": "prefetch:\n  group_size: 2\n  step: 2\n",
    "budget": "budget_gib: 0.015\nrules:\n  - match: [lm_head]\n    place: uva\n",
    "graphs": "budget_gib: 0.015\nworkload:\n  cuda_graphs: true\n",
}


@pytest.fixture
def built(tmp_path, toy_ckpt):
    """policy name -> (plan, text) for each of POLICIES over the 4-layer toy checkpoint."""
    out = {}
    for name, body in POLICIES.items():
        pol = load_policy(write_policy(tmp_path, body, name=f"{name}.policy.yaml"))
        plan = build(pol, tmp_path)
        out[name] = (plan, dumps(plan))
    return out


def test_cost_records_graph_replay(built):
    """workload.cuda_graphs: true predicts no CPU launch time, and the plan says it assumed graph replay;
    an eager plan's cost has no cuda_graphs key, as plans written before it."""
    graphs, text = built["graphs"]
    assert graphs.cost.cuda_graphs and graphs.cost.cpu_us == 0
    assert f", cuda_graphs: true, prompt_tokens: 512, prefill_us: {graphs.cost.prefill_us}}}\n" in text
    eager, text = built["budget"]
    assert not eager.cost.cuda_graphs and eager.cost.cpu_us > 0 and "cuda_graphs" not in text


def test_plan_content(tmp_path, built):
    plan, text = built["prefetch"]
    assert plan.checkpoint_path == "ckpt" and plan.policy_path == "prefetch.policy.yaml"
    assert plan.checkpoint_fingerprint == open_checkpoint(tmp_path / "ckpt").fingerprint
    assert (plan.tensors, plan.total_bytes) == (11, 21 * MiB)
    assert plan.backend.value == "prefetch" and plan.stacks == ("model.layers",) and not plan.tied_embeddings
    s = plan.summary
    assert (s.gpu_bytes, s.uva_bytes, s.prefetch_bytes, s.prefetch_buffer_bytes) == (
        15 * MiB, 0, 6 * MiB, 6 * MiB)
    assert s.gpu_footprint_bytes == 21 * MiB
    names = (["model.embed_tokens.weight"]
             + [f"model.layers.{i}.{p}" for i in range(4) for p in ("mlp.down_proj.weight", "self_attn.o_proj.weight")]
             + ["model.norm.weight", "lm_head.weight"])
    assert list(plan.params) == names  # every tensor once, in execution order
    assert text.endswith("params:\n" + "".join(
        f"  {n}: {'prefetch' if n.startswith(('model.layers.1.', 'model.layers.3.')) else 'gpu'}\n"
        for n in names))
    assert "  - {name: model.layers.1, gpu: 0, uva: 0, prefetch: 3145728, h2d: 3145728, us: 77}\n" in text
    assert "    - {layer: model.layers.1, module: model.layers.1, layout: 0, slot: 0, after: model.layers.1}\n" in text
    assert ("  layouts:\n    - bytes: 3145728\n      buffers:\n"
            "        - {name: mlp.down_proj.weight, dtype: U8, shape: [2097152], offset: 0, bytes: 2097152}\n"
            "        - {name: self_attn.o_proj.weight, dtype: U8, shape: [1048576], offset: 2097152, bytes: 1048576}\n"
            ) in text
    assert "\n  gpu_footprint_bytes: 22020096\n" in text


@pytest.mark.parametrize("name", POLICIES)
def test_summary_sums_params_and_matches_the_schema(tmp_path, built, name):
    plan, text = built[name]
    sizes = {n: t.nbytes for n, t in open_checkpoint(tmp_path / "ckpt").tensors.items()}
    for kind in Placement:
        want = sum(sizes[n] for n, p in plan.params.items() if p is kind)
        assert getattr(plan.summary, f"{kind.value}_bytes") == want
    jsonschema.validate(yaml.safe_load(text), schema("plan.schema.json"))


@pytest.mark.parametrize("name", POLICIES)
def test_deterministic_and_round_trips_byte_for_byte(tmp_path, built, name):
    plan, text = built[name]
    again = dumps(build(load_policy(tmp_path / f"{name}.policy.yaml"), tmp_path))
    assert again == text
    assert loads(text) == plan
    assert dumps(loads(text)) == text


def test_odd_tensor_names_round_trip(tmp_path):
    tensors = toy(2) + [("on", "U8", (1,)), ("1.weight", "U8", (1,)), ("model.ü.a b", "U8", (1,)),
                        ("model.x: y", "U8", (1,)), ('q"uote', "U8", (1,)), ("null", "U8", (1,))]
    write_header_only(tmp_path / "ckpt", tensors, single=True)
    plan = build(load_policy(write_policy(tmp_path)), tmp_path)
    text = dumps(plan)
    assert set(yaml.safe_load(text)["params"]) == {n for n, _, _ in tensors}
    assert dumps(loads(text)) == text
    assert plan.checkpoint_path == "ckpt/model.safetensors"


def test_paths_are_relative_to_the_plan_file(tmp_path, toy_ckpt):
    (tmp_path / "plans").mkdir()
    policy_path = write_policy(tmp_path / "plans", head="format_version: 1\ncheckpoint: ../ckpt\n")
    plan, out = build_file(policy_path)
    assert out == tmp_path / "plans" / "model.plan.yaml"
    assert (plan.checkpoint_path, plan.policy_path) == ("../ckpt", "model.policy.yaml")
    plan, out = build_file(policy_path, tmp_path / "elsewhere" / "x.yaml")
    assert (plan.checkpoint_path, plan.policy_path) == ("../ckpt", "../plans/model.policy.yaml")


# ---------------------------------------------------------------- rejected plans

def plan_error(text) -> PlanFileError:
    with pytest.raises(PlanFileError) as e:
        loads(text, "p.plan.yaml")
    return e.value


def test_schema_violations_are_located(built):
    _, text = built["uva"]
    bad = text.replace("backend: uva\n", "backend: gpu\n").replace(
        "model.layers.2.mlp.down_proj.weight: gpu", "model.layers.2.mlp.down_proj.weight: disk")
    bad = bad.replace("format_version: 2\n", "format_version: 2\nextra: 1\n")
    e = plan_error(bad)
    assert e.headline == "p.plan.yaml: the plan is invalid"
    line = lambda s: bad[:bad.index(s)].count("\n") + 1  # noqa: E731
    assert e.problems == [
        f"p.plan.yaml:{line('extra')}:1: extra: unknown key (allowed: format_version, checkpoint, policy, "
        "routing, backend, budget_bytes, stacks, tied_embeddings, summary, cost, notes, layers, prefetch, prefill, "
        "params)",
        f"p.plan.yaml:{line('backend: gpu')}:10: backend: 'gpu' is not one of none, uva, prefetch, mixed",
        f"p.plan.yaml:{line(': disk')}:40: params.model.layers.2.mlp.down_proj.weight: 'disk' is not one "
        "of gpu, uva, prefetch",
    ]


def test_a_format_1_plan_says_to_rebuild(built):
    _, text = built["prefetch"]
    assert str(plan_error(text.replace("format_version: 2\n", "format_version: 1\n"))) == (
        "p.plan.yaml: a format 1 plan, from an offplan without slot layouts in plans; rebuild it with "
        "`plan build POLICY`")


def test_not_a_plan():
    assert str(plan_error("format_version: 1\n")) == (
        "p.plan.yaml: not an offplan plan (no `params:` mapping); build one with `plan build POLICY`")
    assert str(plan_error("params: [\n")).startswith("p.plan.yaml:2:1: invalid YAML: ")


def line(text: str, needle: str) -> int:
    assert text.count(needle) == 1, needle
    return text[:text.index(needle)].count("\n") + 1


HEADLINE = ("p.plan.yaml: the plan is inconsistent (edited by hand?): params: compared with layers:, summary:, "
            "prefetch: and prefill: ")


@pytest.mark.parametrize("name, edit, at, problem", [
    ("uva", ("  tensors: 11\n", "  tensors: 12\n"), ("tensors: 12", 12),
     "checkpoint.tensors is 12 but params lists 11"),
    ("uva", ("  uva_bytes: 6291456\n", "  uva_bytes: 6291457\n"), ("uva_bytes: 6291457", 14),
     "summary.uva_bytes is 6291457 but the layers add up to 6291456"),
    ("uva", ("  bytes: 22020096\n", "  bytes: 22020095\n"), ("bytes: 22020095", 10),
     "checkpoint.bytes is 22020095 but the layers add up to 22020096"),
    ("uva", ("  gpu_footprint_bytes: 22020096\n", "  gpu_footprint_bytes: 1\n"), ("gpu_footprint_bytes: 1\n", 24),
     "summary.gpu_footprint_bytes is 1 but gpu_bytes + prefetch_buffer_bytes + stage_buffer_bytes is 22020096"),
    ("prefetch", ("  prefetch_buffer_bytes: 6291456\n", "  prefetch_buffer_bytes: 3145728\n"),
     ("prefetch_buffer_bytes: 3145728", 26),
     "summary.prefetch_buffer_bytes is 3145728 but the prefetch section sizes the pool at 6291456"),
    ("prefetch", ("  slot_bytes: 3145728\n", "  slot_bytes: 3145729\n"), ("slot_bytes: 3145729", 15),
     "prefetch.slot_bytes is 3145729 but the largest layout is 3145728"),
    ("prefetch", ("{layer: model.layers.3, module: model.layers.3, layout: 0, slot: 1, after: model.layers.3}",
                  "{layer: model.layers.3, module: model.layers.3, layout: 0, slot: 0, after: model.layers.1}"),
     ("{layer: model.layers.3", 7),
     "prefetch.schedule[1]: model.layers.3 must use slot 1 after model.layers.3, not slot 0 after "
     "model.layers.1"),
    ("prefetch", ("    - {layer: model.layers.3, module: model.layers.3, layout: 0, slot: 1, after: model.layers.3}\n",
                  ""), ("{layer: model.layers.1", 5),
     "prefetch.schedule: lists model.layers.1 but the layers with prefetched tensors in params: are "
     "model.layers.1, model.layers.3"),
    ("prefetch", ("  slots: 2\n", "  slots: 1\n"), ("slots: 1", 10),
     "prefetch.slots is 1 but step 2 over 2 layers gives 2"),
    ("prefetch", ("{name: mlp.down_proj.weight, ", "{name: mlp.up_proj.weight, "), ("{layer: model.layers.1", 7),
     "prefetch.schedule[0]: layout 0 of model.layers.1 lacks mlp.down_proj.weight, which params: prefetch; it "
     "has mlp.up_proj.weight, which params: does not prefetch"),
    ("prefetch", ("{layer: model.layers.3, module: model.layers.3, ", "{layer: model.layers.3, module: model.layers.2, "),
     ("{layer: model.layers.3", 7),
     "prefetch.schedule[1]: model.layers.3 runs in module model.layers.3, not model.layers.2"),
    # Both tensors of layer 0 moved back to the GPU: the uva bytes of its row have no tensor.
    ("uva", ("model.layers.0.mlp.down_proj.weight: uva\n  model.layers.0.self_attn.o_proj.weight: uva",
             "model.layers.0.mlp.down_proj.weight: gpu\n  model.layers.0.self_attn.o_proj.weight: gpu"),
     ("{name: model.layers.0,", 41),
     "layers[1].uva: model.layers.0 has 3145728 bytes on uva but params: place none of its tensors on uva"),
    ("uva", ("  - {name: model.norm, ", "  - {name: model.final_norm, "), ("{name: model.final_norm", 5),
     "layers[5]: lists model.final_norm where the tensors of params: (with stacks: ['model.layers']) "
     "make model.norm"),
    ("uva", ("  - {name: model.norm, gpu: 1048576, uva: 0, prefetch: 0, h2d: 0, us: 0}\n", ""),
     ("{name: lm_head", 5),
     "layers[5]: lists lm_head where the tensors of params: (with stacks: ['model.layers']) make model.norm "
     "(6 layers; params: make 7)"),
])
def test_hand_edited_inconsistent_plans_are_rejected(built, name, edit, at, problem):
    _, text = built[name]
    assert edit[0] in text
    bad = text.replace(*edit)
    e = plan_error(bad)
    assert e.headline == (HEADLINE + "by tensor names only: no checkpoint given; rebuild it: plan build "
                          f"{name}.policy.yaml -o p.plan.yaml")
    assert f"p.plan.yaml:{line(bad, at[0])}:{at[1]}: {problem}" in e.problems


def test_one_flipped_placement_is_caught_with_the_checkpoint_and_names_the_lines(tmp_path, built):
    _, text = built["uva"]
    tensors = open_checkpoint(tmp_path / "ckpt").tensors
    name = "  model.layers.0.self_attn.o_proj.weight: "
    bad = text.replace(name + "uva\n", name + "gpu\n")
    assert loads(bad, "p.plan.yaml") is not None  # the names alone cannot tell
    with pytest.raises(PlanFileError) as e:
        loads(bad, "p.plan.yaml", tensors)
    row = line(bad, "{name: model.layers.0,")
    param = line(bad, "model.layers.0.self_attn.o_proj.weight: gpu")
    staged = line(bad, "{layer: model.layers.0,")
    assert e.value.headline == (HEADLINE + "with the tensor sizes in its checkpoint's headers; rebuild it: plan "
                                "build uva.policy.yaml -o p.plan.yaml")
    assert e.value.problems == [
        f"p.plan.yaml:{row}:5: layers[1]: model.layers.0 has gpu 0, uva 3,145,728, prefetch 0; its tensors in "
        f"params: have gpu 1,048,576, uva 2,097,152, prefetch 0 (p.plan.yaml:{param}:43: "
        "params.model.layers.0.self_attn.o_proj.weight: gpu)",
        f"p.plan.yaml:{staged}:62: prefill.layers[0].bytes is 3145728 but the staged tensors of model.layers.0 "
        "take 2097152 (each rounded up to 256 bytes)"]


def test_a_split_fused_group_and_wrong_buffers_are_caught(tmp_path):
    from synthetic import qwen3_moe
    write_header_only(tmp_path / "moe", qwen3_moe(layers=2, experts=4, hidden=64, moe_intermediate=32, heads=4,
                                                  kv_heads=2, head_dim=16, vocab=128), single=True)
    pol = load_policy(write_policy(tmp_path, "prefetch: {group_size: 2}\n",
                                   head="format_version: 1\ncheckpoint: ./moe\n"))
    text = dumps(build(pol, tmp_path))
    tensors = open_checkpoint(tmp_path / "moe").tensors
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    bad = text.replace(f"  {name}: prefetch\n", f"  {name}: gpu\n")
    with pytest.raises(PlanFileError) as e:
        loads(bad, "p.plan.yaml")
    assert f"p.plan.yaml:{line(bad, name + ': gpu')}:{len(name) + 5}: params.{name}: gpu, but fused group " \
        "model.layers.1.mlp.experts is prefetched, so all of it must be (its parameters are views of one slot): " \
        "11 prefetch, 1 gpu" in e.value.problems
    gate = "mlp.experts.0.gate_proj.weight, dtype: BF16, shape: "
    bad = text.replace(gate + "[32, 64]", gate + "[64, 32]")
    with pytest.raises(PlanFileError) as e:
        loads(bad, "p.plan.yaml", tensors)
    assert e.value.problems == [
        f"p.plan.yaml:{line(bad, '- bytes: 75264')}:7: prefetch.layouts[0]: the layout of model.layers.1 is not "
        "the one its prefetched tensors need (73.5 KiB; it lacks or misplaces mlp.experts.0.gate_proj.weight "
        "at 16640 (4096 bytes))"]


def test_load_plan_errors(tmp_path):
    with pytest.raises(PlanFileError, match="no such plan file"):
        load_plan(tmp_path / "missing.plan.yaml")


# ---------------------------------------------------------------- atomic writes

def test_write_atomic_replaces_and_keeps_umask_permissions(tmp_path):
    target = tmp_path / "p.plan.yaml"
    target.write_text("old")
    old = os.umask(0o022)
    try:
        write_atomic(target, "new\n")
    finally:
        os.umask(old)
    assert target.read_text() == "new\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert os.listdir(tmp_path) == ["p.plan.yaml"]


def test_write_atomic_leaves_nothing_on_error(tmp_path):
    with pytest.raises(OffplanError, match=r"missing/p.plan.yaml: cannot write the plan: No such file"):
        write_atomic(tmp_path / "missing" / "p.plan.yaml", "x")
    (tmp_path / "adir").mkdir()
    with pytest.raises(OffplanError, match=r"adir: cannot write the plan: Is a directory"):
        write_atomic(tmp_path / "adir", "x")
    assert sorted(os.listdir(tmp_path)) == ["adir"] and os.listdir(tmp_path / "adir") == []


def test_write_atomic_cleans_up_when_interrupted(tmp_path, monkeypatch):
    def boom(*a):
        raise KeyboardInterrupt
    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(tmp_path / "p.plan.yaml", "x")
    assert os.listdir(tmp_path) == []
