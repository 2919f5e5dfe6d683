"""The plan file: deterministic bytes, exact round trip, schema and consistency checks, atomic writes."""
from __future__ import annotations

import os
import stat

import jsonschema
import pytest
import yaml

from headeronly import MiB, toy, write_policy
from planner.decide.build import build, build_file
from planner.errors import OffplanError
from planner.files import write_atomic
from planner.inputs.checkpoint import open_checkpoint
from planner.inputs.policy import load_policy
from planner.inputs.schema import schema
from planner.plan import Placement
from planner.planfile import dumps, loads
from synthetic import write_header_only

POLICIES = {
    "none": "",
    "uva": "uva:\n  offload_gib: 0.005\n",
    "prefetch": "prefetch:\n  group_size: 2\n  step: 2\n",
    "budget": "budget_gib: 0.015\nrules:\n  - match: [lm_head]\n    place: uva\n",
    "eager": "budget_gib: 0.015\nworkload:\n  cuda_graphs: false\n",
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
    """By default (workload.cuda_graphs: true) a plan predicts no CPU launch time, says it assumed graph replay,
    and keeps the launches of eager steps (eager_cpu_us); an eager plan (cuda_graphs: false) has no cuda_graphs
    key in its cost, as plans written before it, and no eager_cpu_us: its cpu_us is that."""
    graphs, text = built["budget"]
    eager, eager_text = built["eager"]
    assert graphs.cost.cuda_graphs and graphs.cost.cpu_us == 0 and graphs.cost.eager_cpu_us > 0
    assert (f", cuda_graphs: true, eager_cpu_us: {graphs.cost.eager_cpu_us}, prompt_tokens: 512, prefill_us: "
            f"{graphs.cost.prefill_us}}}\n") in text
    assert not eager.cost.cuda_graphs and eager.cost.cpu_us > 0 and "cuda_graphs" not in eager_text
    assert "eager_cpu_us" not in eager_text and eager.cost.eager_cpu_us is None


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


@pytest.mark.parametrize("names", [["model.a.weight", "lm_head.weight"], ["a", "Yes"], ["on", "b"], ["NULL.x", "y"],
                                   ["a b"], ["1a"], ["a", ""], ["a\nb"], ["a.b-c/d_e", "N"], ["_x", "~"]])
def test_params_are_written_plain_at_once_exactly_when_each_would_be(names):
    """file.py writes the params in one join when every name is plain (`yamlio.all_plain`, no newline in one):
    the same bytes as `scalar` name by name."""
    from planner.inputs.yamlio import all_plain, scalar
    from planner.planfile.file import _params
    assert "".join(_params(dict.fromkeys(names, Placement.GPU))) == "".join(f"  {scalar(n)}: gpu\n" for n in names)
    if not any("\n" in n for n in names):
        assert all_plain("\n".join(names)) == all(scalar(n) == n for n in names)


def test_paths_are_relative_to_the_plan_file(tmp_path, toy_ckpt):
    (tmp_path / "plans").mkdir()
    policy_path = write_policy(tmp_path / "plans", head="format_version: 1\ncheckpoint: ../ckpt\n")
    plan, out = build_file(policy_path)
    assert out == tmp_path / "plans" / "model.plan.yaml"
    assert (plan.checkpoint_path, plan.policy_path) == ("../ckpt", "model.policy.yaml")
    plan, out = build_file(policy_path, tmp_path / "elsewhere" / "x.yaml")
    assert (plan.checkpoint_path, plan.policy_path) == ("../ckpt", "../plans/model.policy.yaml")


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


def test_write_atomic_writes_through_a_symlink_in_its_folder_only(tmp_path):
    """`-o current.plan.yaml`, a link to the plan of the day beside it: that file gets the plan, the link stays. A
    link into another folder (the plan's relative paths would be wrong for one of the two), to nothing, or a loop:
    refused, nothing written."""
    target = tmp_path / "v1.plan.yaml"
    target.write_text("old")
    (tmp_path / "current.plan.yaml").symlink_to("v1.plan.yaml")
    write_atomic(tmp_path / "current.plan.yaml", "new\n")
    assert (tmp_path / "current.plan.yaml").is_symlink() and target.read_text() == "new\n"
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "v2.plan.yaml").write_text("old")
    (tmp_path / "other.plan.yaml").symlink_to(tmp_path / "kept" / "v2.plan.yaml")
    (tmp_path / "loop.plan.yaml").symlink_to("loop.plan.yaml")
    (tmp_path / "none.plan.yaml").symlink_to("gone.plan.yaml")
    with pytest.raises(OffplanError, match=r"other.plan.yaml: a symlink to .*kept/v2.plan.yaml, in another folder: "
                                           r"the plan's paths are relative to where it lies"):
        write_atomic(tmp_path / "other.plan.yaml", "x")
    for name in ("loop", "none"):
        with pytest.raises(OffplanError, match=rf"{name}.plan.yaml: a symlink to no file \(.*\): write the plan to a "
                                               "plain file"):
            write_atomic(tmp_path / f"{name}.plan.yaml", "x")
    assert (tmp_path / "kept" / "v2.plan.yaml").read_text() == "old" and all(
        (tmp_path / f"{n}.plan.yaml").is_symlink() for n in ("other", "loop", "none"))
    assert sorted(os.listdir(tmp_path)) == ["current.plan.yaml", "kept", "loop.plan.yaml", "none.plan.yaml",
                                            "other.plan.yaml", "v1.plan.yaml"]


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


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_consistent_plan_is_read_in_one_parse(tmp_path, built, name, monkeypatch):
    """Locations (`file:line:column`) compose the file's node tree, a second parse of the whole file: only a
    message needs them (consistency.py). A plan without a `prefetch:` section composed it for a message it dropped,
    1.1 s of a DeepSeek-V3 plan's 3.2 s read."""
    from planner.planfile import read_plan
    path = tmp_path / f"{name}.plan.yaml"
    path.write_text(built[name][1])

    def compose(*args, **kwargs):
        raise AssertionError("the node tree was composed, for no message")
    monkeypatch.setattr(yaml, "compose", compose)
    assert read_plan(path).plan == built[name][0]


def test_a_layer_row_that_hides_its_split_experts_is_named(tmp_path):
    """A hand edit drops a layer row's `experts:` map: the readers say the row claims no split group while params:
    split one, quoting the map they give (not Python's None)."""
    from headeronly import moe_toy

    write_header_only(tmp_path / "ckpt", moe_toy(layers=2, experts=4), single=True)
    policy = write_policy(tmp_path, "rules:\n  - {match: ['re:experts\\.0\\.'], place: uva}\n")
    text = dumps(build(load_policy(policy), tmp_path))
    row = next(line for line in text.splitlines() if "name: model.layers.0," in line)
    assert row.endswith(', experts: "mlp.experts: gpu 1-3, uva 0"}')
    edited = text.replace(row, row.replace(', experts: "mlp.experts: gpu 1-3, uva 0"}', "}"))
    with pytest.raises(OffplanError) as e:
        loads(edited, "p.plan.yaml", open_checkpoint(tmp_path / "ckpt").tensors)
    assert any(p.endswith("layers[1]: model.layers.0 says experts: no split expert group, but params: place them "
                          "'mlp.experts: gpu 1-3, uva 0'") for p in e.value.problems)
