"""The plan file: deterministic bytes, exact round trip, schema and consistency checks, atomic writes."""
from __future__ import annotations

import os
import stat

import jsonschema
import pytest
import yaml

from headeronly import MiB, toy, write_policy
from planner.build import build, build_file
from planner.checkpoint import open_checkpoint
from planner.errors import OffplanError, PlanFileError
from planner.plan import dumps, load_plan, loads, write_atomic
from planner.policy import Placement, load_policy
from planner.synthetic import write_header_only
from planner.yamlio import schema

POLICIES = {
    "none": "",
    "uva": "uva:\n  offload_gib: 0.005\n",
    "prefetch": "prefetch:\n  group_size: 2\n  step: 2\n",
    "budget": "budget_gib: 0.015\nrules:\n  - match: [lm_head]\n    place: uva\n",
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


def test_plan_content(tmp_path, built):
    plan, text = built["prefetch"]
    assert plan.checkpoint_path == "ckpt" and plan.policy_path == "prefetch.policy.yaml"
    assert plan.checkpoint_fingerprint == open_checkpoint(tmp_path / "ckpt").fingerprint
    assert (plan.tensors, plan.total_bytes) == (11, 21 * MiB)
    assert plan.backend == "prefetch" and plan.stacks == ("model.layers",) and not plan.tied_embeddings
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
    assert "  - {name: model.layers.1, gpu: 0, uva: 0, prefetch: 3145728, h2d: 3145728, us: 1}\n" in text
    assert "    - {layer: model.layers.1, slot: 0, after: model.layers.1}\n" in text
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
    bad = bad.replace("format_version: 1\n", "format_version: 1\nextra: 1\n")
    e = plan_error(bad)
    assert e.headline == "p.plan.yaml: the plan is invalid"
    line = lambda s: bad[:bad.index(s)].count("\n") + 1  # noqa: E731
    assert e.problems == [
        f"p.plan.yaml:{line('extra')}:1: extra: unknown key (allowed: format_version, checkpoint, policy, "
        "backend, budget_bytes, stacks, tied_embeddings, summary, cost, notes, layers, prefetch, params)",
        f"p.plan.yaml:{line('backend: gpu')}:10: backend: 'gpu' is not one of none, uva, prefetch, mixed",
        f"p.plan.yaml:{line(': disk')}:40: params.model.layers.2.mlp.down_proj.weight: 'disk' is not one "
        "of gpu, uva, prefetch",
    ]


def test_not_a_plan():
    assert str(plan_error("format_version: 1\n")) == (
        "p.plan.yaml: not an offplan plan (no `params:` mapping); build one with `plan build POLICY`")
    assert str(plan_error("params: [\n")).startswith("p.plan.yaml:2:1: invalid YAML: ")


@pytest.mark.parametrize("name, edit, problem", [
    ("uva", ("  tensors: 11\n", "  tensors: 12\n"), "checkpoint.tensors is 12 but params lists 11"),
    ("uva", ("  uva_bytes: 6291456\n", "  uva_bytes: 6291457\n"),
     "summary.uva_bytes is 6291457 but the layers add up to 6291456"),
    ("uva", ("  bytes: 22020096\n", "  bytes: 22020095\n"),
     "checkpoint.bytes is 22020095 but the layers add up to 22020096"),
    ("uva", ("  gpu_footprint_bytes: 15728640\n", "  gpu_footprint_bytes: 1\n"),
     "summary.gpu_footprint_bytes is 1 but gpu_bytes + prefetch_buffer_bytes is 15728640"),
    ("prefetch", ("  prefetch_buffer_bytes: 6291456\n", "  prefetch_buffer_bytes: 3145728\n"),
     "summary.prefetch_buffer_bytes is 3145728 but the prefetch section sizes the pool at 6291456"),
    ("prefetch", ("  slot_bytes: 3145728\n", "  slot_bytes: 3145729\n"),
     "summary.prefetch_buffer_bytes is 6291456 but the prefetch section sizes the pool at 6291458"),
    ("prefetch", ("{layer: model.layers.3, slot: 1, after: model.layers.3}",
                  "{layer: model.layers.3, slot: 0, after: model.layers.1}"),
     "prefetch.schedule[1]: model.layers.3 must use slot 1 after model.layers.3, not slot 0 after "
     "model.layers.1"),
    ("prefetch", ("    - {layer: model.layers.3, slot: 1, after: model.layers.3}\n", ""),
     "prefetch.schedule must list exactly the layers holding prefetched bytes, in order: "
     "model.layers.1, model.layers.3"),
    ("prefetch", ("  slots: 2\n", "  slots: 1\n"),
     "prefetch.slots is 1 but step 2 over 2 layers gives 2"),
])
def test_hand_edited_inconsistent_plans_are_rejected(built, name, edit, problem):
    _, text = built[name]
    assert edit[0] in text
    e = plan_error(text.replace(*edit))
    assert e.headline == "p.plan.yaml: the plan is inconsistent (edited by hand?); rebuild it with `plan build`"
    assert problem in e.problems


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
