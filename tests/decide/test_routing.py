"""Routing profiles in the planner: the file, the cost model's fractions, mixed plans, notes, staleness."""
from __future__ import annotations

import dataclasses
import json

import pytest

from headeronly import infos
from offplan.cli import main
from planner.decide.build import build_file
from planner.decide.cost import CostModel
from planner.errors import PolicyError, RoutingProfileError
from planner.inputs.checkpoint import open_checkpoint
from planner.inputs.hardware import Hardware
from planner.inputs.policy import Workload, load_policy
from planner.inputs.routing import (HEADER, LayerHits, RoutingProfile, dumps_profile, load_profile, mismatches,
                                    profile_fingerprint, skew)
from planner.layers.graph import build_graph
from planner.layers.groups import FusedGroups
from planner.planfile import dumps, load_plan
from synthetic import qwen3_moe, write_header_only

HW = Hardware("test", h2d_copy_gbps=1.0, uva_read_gbps=0.5, hbm_read_gbps=10.0, layer_overhead_us=100.0)
FP = "sha256:" + "ab" * 32

PROFILE = """\
format_version: 1
checkpoint:
  path: ckpt
  fingerprint: "{fp}"
recorded:
  prompts: prompts.txt
  sequences: 4
  new_tokens: 26
  top_k: 2
tokens:
  prefill: 40
  decode: 100
layers:
  model.layers.0.mlp.experts:
    experts: 8
    decode: [60, 0, 50, 0, 0, 45, 0, 45]
    prefill: [10, 10, 10, 10, 10, 10, 10, 10]
  model.layers.1.mlp.experts:
    experts: 8
    decode: [0, 70, 0, 50, 40, 0, 40, 0]
    prefill: [20, 0, 20, 0, 20, 0, 20, 0]
"""


def profile_file(tmp_path, text=None, fp=FP, name="r.routing.yaml"):
    path = tmp_path / name
    path.write_text(HEADER + (text or PROFILE).format(fp=fp))
    return path


def line(path, needle: str) -> int:
    text = path.read_text()
    return text[:text.index(needle)].count("\n") + 1


def error(path) -> RoutingProfileError:
    with pytest.raises(RoutingProfileError) as e:
        load_profile(path)
    return e.value


# ---------------------------------------------------------------- the file

def test_the_file_is_typed_and_round_trips_byte_for_byte(tmp_path):
    path = profile_file(tmp_path)
    got = load_profile(path)
    assert got == RoutingProfile(
        checkpoint_path="ckpt", checkpoint_fingerprint=FP, prompts="prompts.txt", sequences=4, new_tokens=26,
        top_k=2, prefill_tokens=40, decode_tokens=100,
        layers={"model.layers.0.mlp.experts": LayerHits(8, (60, 0, 50, 0, 0, 45, 0, 45), (10,) * 8),
                "model.layers.1.mlp.experts": LayerHits(8, (0, 70, 0, 50, 40, 0, 40, 0), (20, 0) * 4)})
    assert (got.path, got.fingerprint) == (path, profile_fingerprint(path.read_text()))
    assert dumps_profile(got) == path.read_text()
    assert got.probabilities("model.layers.0.mlp.experts") == (0.6, 0.0, 0.5, 0.0, 0.0, 0.45, 0.0, 0.45)


def test_odd_strings_are_quoted_and_read_back(tmp_path):
    p = load_profile(profile_file(tmp_path))
    odd = RoutingProfile(**{**{k: getattr(p, k) for k in p.__dataclass_fields__ if k not in ("path", "fingerprint")},
                            "prompts": "yes: #1", "checkpoint_path": "../my model"})
    path = tmp_path / "odd.yaml"
    path.write_text(dumps_profile(odd))
    assert '  prompts: "yes: #1"\n  sequences' in path.read_text()
    assert load_profile(path) == odd


def test_schema_violations_are_located(tmp_path):
    text = PROFILE.replace("top_k: 2", "top_k: 0").replace("    experts: 8\n    decode: [0, 70",
                                                          "    experts: 8\n    hits: 1\n    decode: [0, 70")
    path = profile_file(tmp_path, text)
    e = error(path)
    assert e.headline == f"{path}: the routing profile is invalid"
    assert e.problems == [
        f"{path}:{line(path, 'hits')}:5: layers.model.layers.1.mlp.experts.hits: unknown key "
        "(allowed: experts, decode, prefill)",
        f"{path}:{line(path, 'top_k')}:10: recorded.top_k: must be at least 1, not 0"]


def test_counts_that_disagree_are_located(tmp_path):
    text = (PROFILE.replace("decode: [60, 0, 50, 0, 0, 45, 0, 45]", "decode: [60, 0, 50, 0, 0, 45, 0]")
            .replace("decode: [0, 70, 0, 50, 40, 0, 40, 0]", "decode: [0, 110, 0, 10, 40, 0, 40, 0]")
            .replace("prefill: [20, 0, 20, 0, 20, 0, 20, 0]", "prefill: [20, 0, 20, 0, 20, 0, 20, 1]"))
    path = profile_file(tmp_path, text)
    e = error(path)
    assert e.headline == (f"{path}: the routing profile is inconsistent (edited by hand?); record it again with "
                          "`plan profile`")
    at0, at1, at2 = line(path, "[60, 0"), line(path, "[0, 110"), line(path, "[20, 0")
    assert e.problems == [
        f"{path}:{at0}:13: layers.model.layers.0.mlp.experts.decode: 7 counts, but the layer has 8 experts "
        "(`experts:`)",
        f"{path}:{at0}:13: layers.model.layers.0.mlp.experts.decode: the counts add up to 155, but each of the 100 "
        "decode tokens (tokens.decode) takes 2 experts (recorded.top_k): 200",
        f"{path}:{at1}:13: layers.model.layers.1.mlp.experts.decode: expert 1 took 110 of the 100 decode tokens: a "
        "token takes an expert at most once",
        f"{path}:{at2}:14: layers.model.layers.1.mlp.experts.prefill: the counts add up to 81, but each of the 40 "
        "prefill tokens (tokens.prefill) takes 2 experts (recorded.top_k): 80"]


def test_no_decode_tokens(tmp_path):
    zeros = "[0, 0, 0, 0, 0, 0, 0, 0]"
    text = (PROFILE.replace("decode: 100", "decode: 0").replace("[60, 0, 50, 0, 0, 45, 0, 45]", zeros)
            .replace("[0, 70, 0, 50, 40, 0, 40, 0]", zeros))
    path = profile_file(tmp_path, text)
    assert error(path).problems == [
        f"{path}:{line(path, 'decode: 0')}:11: tokens.decode: no decode tokens: the cost model reads decode "
        "routing; record with `plan profile --new-tokens 2` or more"]


@pytest.mark.parametrize("content, message", [
    ("", "r.routing.yaml: a routing profile is a YAML mapping but the file is empty; record one with "
         "`plan profile CHECKPOINT -o FILE`"),
    ("format_version: 1\ncheckpoint: ./ckpt\n", "r.routing.yaml: this is a policy, not a routing profile: build "
                                                 "a plan from it with `plan build"),
    ("format_version: 1\nname: gpu\nh2d_copy_gbps: 1\n", "r.routing.yaml: this is a hardware profile, not a "
                                                         "routing profile"),
    ("- 1\n", "r.routing.yaml: a routing profile is a YAML mapping but it holds a list"),
])
def test_not_a_profile(tmp_path, content, message):
    path = tmp_path / "r.routing.yaml"
    path.write_text(content)
    assert message in str(error(path))


def test_skew():
    p = RoutingProfile("c", FP, "x", 1, 2, 2, 0, 10, {
        "a": LayerHits(10, (10, 10, 0, 0, 0, 0, 0, 0, 0, 0), (0,) * 10),
        "b": LayerHits(10, (2,) * 10, (0,) * 10)})
    s = skew(p)
    assert (s.top, s.experts, s.share, s.uniform) == (1, 10, 0.3, 0.1)
    assert s.text() == "each layer's most-hit expert (of 10) takes 30.0% of decode hits (10.0% if uniform)"


# ---------------------------------------------------------------- the cost model

def moe_tensors(layers=2, experts=4) -> list:
    out = [("model.embed_tokens.weight", "BF16", (1000, 500))]
    for i in range(layers):
        out.append((f"model.layers.{i}.self_attn.o_proj.weight", "U8", (10**6,)))
        for e in range(experts):
            for proj in ("down_proj", "gate_proj", "up_proj"):
                out.append((f"model.layers.{i}.mlp.experts.{e}.{proj}.weight", "U8", (10**6,)))
    return out + [("lm_head.weight", "U8", (10**6,))]


def test_fractions_come_from_the_profile():
    t = infos(moe_tensors())
    g = build_graph(t)
    groups = FusedGroups.find(n for l in g.stack_layers() for n in l.params)
    # 8 decode tokens, top-2: p = hits / 8 = (1, .5, .5, 0) and (.25, .75, .25, .75)
    profile = RoutingProfile("c", FP, "x", 1, 9, 2, 0, 8, {
        "model.layers.0.mlp.experts": LayerHits(4, (8, 4, 4, 0), (0,) * 4),
        "model.layers.1.mlp.experts": LayerHits(4, (2, 6, 2, 6), (0,) * 4)})
    m = CostModel(g, t, HW, 2, groups, 2, None, profile)
    got = {n: f for n, f in m.frac.items() if ".experts." in n}
    want = {0: (1.0, 0.75, 0.75, 0.0), 1: (0.4375, 0.9375, 0.4375, 0.9375)}  # 1 - (1 - p)^2
    assert got == {f"model.layers.{i}.mlp.experts.{e}.{proj}.weight": want[i][e]
                   for i in range(2) for e in range(4) for proj in ("down_proj", "gate_proj", "up_proj")}
    uniform = CostModel(g, t, HW, 2, groups, 2)
    assert {f for n, f in uniform.frac.items() if ".experts." in n} == {1 - (1 - 2 / 4) ** 2}


def test_the_prefill_takes_its_shares_from_the_profiles_prefill_counts():
    t = infos(moe_tensors())
    g = build_graph(t)
    groups = FusedGroups.find(n for l in g.stack_layers() for n in l.params)
    # 4 prefill tokens, top-2: layer 0 sends every one to experts 0 and 1; layer 1 spreads them evenly
    profile = RoutingProfile("c", FP, "x", 1, 9, 2, 4, 8, {
        "model.layers.0.mlp.experts": LayerHits(4, (8, 4, 4, 0), (4, 4, 0, 0)),
        "model.layers.1.mlp.experts": LayerHits(4, (2, 6, 2, 6), (2, 2, 2, 2))})
    m = CostModel(g, t, HW, 2, groups, 2, None, profile, prompt_tokens=3)
    read = {0: (1.0, 1.0, 0.0, 0.0), 1: (1 - 0.5 ** 3,) * 4}  # 1 - (1 - share)^3 over the 3 prompt tokens
    share = {0: (1.0, 1.0, 0.0, 0.0), 1: (0.5,) * 4}  # of the tokens each expert computes
    names = [(i, e, f"model.layers.{i}.mlp.experts.{e}.{proj}.weight") for i in range(2) for e in range(4)
             for proj in ("down_proj", "gate_proj", "up_proj")]
    assert {n: m.pre_frac[n] for _, _, n in names} == {n: read[i][e] for i, e, n in names}
    assert {n: m.flops[n] for _, _, n in names} == {n: 2 * 3 * 10**6 * share[i][e] for i, e, n in names}
    # a profile without prefill tokens: its decode shares stand in
    no_prefill = dataclasses.replace(profile, prefill_tokens=0, layers={
        k: dataclasses.replace(h, prefill=(0,) * 4) for k, h in profile.layers.items()})
    m = CostModel(g, t, HW, 2, groups, 2, None, no_prefill, prompt_tokens=3)
    assert m.flops["model.layers.0.mlp.experts.1.up_proj.weight"] == 2 * 3 * 10**6 * 0.5  # 4 of 8 decode tokens


def test_mismatches_name_every_layer():
    p = RoutingProfile("c", FP, "x", 1, 2, 2, 0, 1, {
        "model.layers.0.mlp.experts": LayerHits(4, (1, 1, 0, 0), (0,) * 4),
        "model.layers.9.mlp.experts": LayerHits(2, (1, 1), (0, 0))})
    assert mismatches(p, {"model.layers.0.mlp.experts": 8, "model.layers.1.mlp.experts": 8}) == [
        "model.layers.0.mlp.experts: the profile counts 4 experts, the checkpoint has 8",
        "model.layers.1.mlp.experts: the profile has no counts for this MoE layer of the checkpoint",
        "model.layers.9.mlp.experts: the profile counts this layer, which is no MoE layer of the checkpoint"]


# ---------------------------------------------------------------- plans

@pytest.fixture
def work(tmp_path, monkeypatch):
    """cwd = tmp_path: ckpt/, a header-only Qwen3-MoE shape (2 layers of 8 experts, top-2)."""
    monkeypatch.chdir(tmp_path)
    ckpt = write_header_only(tmp_path / "ckpt", qwen3_moe(layers=2, hidden=64, experts=8, moe_intermediate=32,
                                                          heads=4, kv_heads=2, head_dim=16, vocab=256))
    (ckpt / "config.json").write_text(json.dumps({"num_experts_per_tok": 2, "num_hidden_layers": 2}))
    return tmp_path


def mixed_policy(work, routing: str | None, shed_experts: int = 8):
    """backend mixed with a budget that leaves room for all but `shed_experts` experts (12 KiB each)."""
    total = open_checkpoint(work / "ckpt").total_bytes
    budget = (total - shed_experts * 12 * 1024) / 2**30
    path = work / "m.policy.yaml"
    path.write_text(f"format_version: 1\ncheckpoint: ./ckpt\nbackend: mixed\nbudget_gib: {budget!r}\n"
                    + (f"workload:\n  routing: {routing}\n" if routing else ""))
    return path


def test_mixed_keeps_the_most_hit_experts_on_the_gpu(work):
    fp = open_checkpoint(work / "ckpt").fingerprint
    profile_file(work, fp=fp)
    policy = mixed_policy(work, "r.routing.yaml")
    assert load_policy(policy).workload == Workload(1, None, work / "r.routing.yaml", "r.routing.yaml")
    plan, _ = build_file(policy, work / "m.plan.yaml")
    rows = {l.name: l.experts for l in plan.layers if l.experts}
    assert rows == {"model.layers.0": "mlp.experts: gpu 0,2,5,7, uva 1,3-4,6",
                    "model.layers.1": "mlp.experts: gpu 1,3-4,6, uva 0,2,5,7"}
    assert plan.summary.predicted_h2d_bytes_per_step == 0  # only experts no decode token took are on uva
    assert plan.routing.path == "r.routing.yaml"
    assert plan.routing.fingerprint == profile_fingerprint((work / "r.routing.yaml").read_text())
    assert plan.notes[2] == ("routing from the profile r.routing.yaml (workload.routing): 100 decode tokens of 4 "
                             "prompts (prompts.txt); each layer's most-hit expert (of 8) takes 32.5% of decode hits "
                             "(12.5% if uniform)")
    assert not any(n.startswith("warning:") for n in plan.notes)
    text = dumps(plan)
    assert f"routing:\n  path: r.routing.yaml\n  fingerprint: \"{plan.routing.fingerprint}\"\nbackend: mixed\n" in text
    (work / "m.plan.yaml").write_text(text)
    assert dumps(load_plan(work / "m.plan.yaml")) == text


def test_without_a_profile_routing_is_uniform_and_the_plan_says_so(work):
    plan, _ = build_file(mixed_policy(work, None), work / "m.plan.yaml")
    # least read first: the embedding's rows (32 KiB), then experts in order, whatever the router prefers
    assert {l.name: l.experts for l in plan.layers if l.experts} == {"model.layers.0": (
        "mlp.experts.down_proj.weight: gpu 6-7, uva 0-5; mlp.experts.gate_up_proj.weight: gpu 5-7, uva 0-4")}
    assert plan.routing is None
    assert "routing assumed uniform: no workload.routing profile (record one with `plan profile`)" in plan.notes
    assert "routing: null\nbackend: mixed\n" in dumps(plan)


def test_a_profile_of_another_checkpoint_with_the_same_layers_is_a_warning(work):
    profile_file(work)
    plan, _ = build_file(mixed_policy(work, "r.routing.yaml"), work / "m.plan.yaml")
    assert plan.notes[-1] == (
        f"warning: the routing profile r.routing.yaml was recorded on another checkpoint (ckpt, {FP[:19]}...): its "
        "layers and experts match this one's, but it predicts this one's routing only if the two route alike "
        "(record one: `plan profile`)")


def test_a_profile_of_another_model_is_an_error(work):
    profile_file(work, PROFILE.replace("model.layers.1.", "model.layers.7."))
    path = mixed_policy(work, "r.routing.yaml")
    path.write_text(path.read_text() + "  experts_per_token: 4\n")
    with pytest.raises(RoutingProfileError) as e:
        build_file(path)
    assert e.value.headline == (
        f"{work}/m.policy.yaml:6:12: workload.routing: {work}/r.routing.yaml does not fit the checkpoint "
        f"{work}/ckpt (a profile of another model?); record one of this checkpoint: plan profile {work}/ckpt -o "
        f"{work}/r.routing.yaml")
    assert e.value.problems == [
        "model.layers.1.mlp.experts: the profile has no counts for this MoE layer of the checkpoint",
        "model.layers.7.mlp.experts: the profile counts this layer, which is no MoE layer of the checkpoint",
        "recorded.top_k: each of the profile's tokens took 2 experts, but the plan assumes 4 "
        "(workload.experts_per_token, else the checkpoint's config.json)"]


def test_a_missing_profile_is_located_with_the_fix(work, monkeypatch):
    monkeypatch.setenv("HOME", str(work / "home"))
    with pytest.raises(PolicyError) as e:
        load_policy(mixed_policy(work, "~/nope.yaml"))
    assert e.value.problems == [
        f"{work}/m.policy.yaml:6:12: workload.routing: no such file {work}/home/nope.yaml (record one with "
        f"`plan profile {work}/ckpt -o {work}/home/nope.yaml`; the path is relative to the policy file)"]


def test_a_changed_or_missing_profile_makes_the_plan_stale(work, capsys):
    profile_file(work, fp=open_checkpoint(work / "ckpt").fingerprint)
    mixed_policy(work, "r.routing.yaml")
    assert main(["build", "m.policy.yaml"]) == 0
    capsys.readouterr()
    assert main(["check", "m.plan.yaml"]) == 0
    assert capsys.readouterr().out == "m.plan.yaml: up to date with ckpt, m.policy.yaml and r.routing.yaml\n"
    path = work / "r.routing.yaml"
    path.write_text(path.read_text().replace("prompts: prompts.txt", "prompts: other.txt"))
    assert main(["check", "m.plan.yaml"]) == 2
    assert capsys.readouterr().err == ("m.plan.yaml: STALE\n  - the routing profile r.routing.yaml changed since the "
                                       "plan was built\n  rebuild it: plan build m.policy.yaml -o m.plan.yaml\n")
    path.unlink()
    assert main(["check", "m.plan.yaml"]) == 2
    assert "  - the routing profile r.routing.yaml named by the plan is gone\n" in capsys.readouterr().err


def test_diff_and_validate_name_the_profile(work, capsys):
    fp = open_checkpoint(work / "ckpt").fingerprint
    profile_file(work, fp=fp)
    mixed_policy(work, None)
    assert main(["build", "m.policy.yaml", "-o", "uniform.plan.yaml"]) == 0
    mixed_policy(work, "r.routing.yaml")
    assert main(["build", "m.policy.yaml", "-o", "profiled.plan.yaml"]) == 0
    capsys.readouterr()
    assert main(["diff", "uniform.plan.yaml", "profiled.plan.yaml"]) == 0
    assert "routing profile: none (uniform) -> r.routing.yaml\n" in capsys.readouterr().out
    path = work / "r.routing.yaml"
    path.write_text(path.read_text().replace("prompts: prompts.txt", "prompts: other.txt"))
    assert main(["build", "m.policy.yaml", "-o", "again.plan.yaml"]) == 0
    capsys.readouterr()
    assert main(["diff", "profiled.plan.yaml", "again.plan.yaml"]) == 0
    assert "routing profile: r.routing.yaml changed since the old plan was built\n" in capsys.readouterr().out
    assert main(["show", "profiled.plan.yaml", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["routing"] == "r.routing.yaml"
    assert main(["validate", "r.routing.yaml"]) == 0
    assert capsys.readouterr().out == ("r.routing.yaml: valid routing profile (2 MoE layers, 100 decode tokens; each "
                                       "layer's most-hit expert (of 8) takes 32.5% of decode hits (12.5% if "
                                       "uniform))\n")
