"""Routing profiles in the planner: the cost model's fractions, mixed plans, notes, staleness."""
from __future__ import annotations

import dataclasses
import json

import pytest

from headeronly import FP, PROFILE, infos, profile_file
from offplan.cli import main
from planner.decide.build import build_file
from planner.decide.cost import CostModel
from planner.errors import PolicyError, RoutingProfileError
from planner.inputs.checkpoint import open_checkpoint
from planner.inputs.hardware import Hardware
from planner.inputs.policy import Workload, load_policy
from planner.inputs.routing import LayerHits, RoutingProfile, mismatches, profile_fingerprint
from planner.layers.graph import build_graph
from planner.layers.groups import FusedGroups
from planner.planfile import dumps, load_plan
from synthetic import qwen3_moe, write_header_only

HW = Hardware("test", h2d_copy_gbps=1.0, uva_read_gbps=0.5, hbm_read_gbps=10.0, layer_overhead_us=100.0)


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
    """backend mixed with a budget that leaves room for all but `shed_experts` experts (12 KiB each), for
    one-token prompts: the experts' working memory in the footprint (planner/decide/working.py) is then a decode
    step's 2 experts, and the lookahead's 2 where both layers read experts over the link."""
    total = open_checkpoint(work / "ckpt").total_bytes
    budget = (total - shed_experts * 12 * 1024) / 2**30
    path = work / "m.policy.yaml"
    path.write_text(f"format_version: 1\ncheckpoint: ./ckpt\nbackend: mixed\nbudget_gib: {budget!r}\nworkload:\n"
                    + (f"  routing: {routing}\n" if routing else "") + "  prompt_tokens: 1\n")
    return path


def test_mixed_keeps_the_most_hit_experts_on_the_gpu(work):
    fp = open_checkpoint(work / "ckpt").fingerprint
    profile_file(work, fp=fp)
    policy = mixed_policy(work, "r.routing.yaml")
    assert load_policy(policy).workload == Workload(1, None, work / "r.routing.yaml", "r.routing.yaml",
                                                    prompt_tokens=1)
    plan, _ = build_file(policy, work / "m.plan.yaml")
    rows = {l.name: l.experts for l in plan.layers if l.experts}
    # least hit first: 8 experts' bytes and the working memory's 4 (both layers read over the link) make 12 experts,
    # 144 KiB: the 8 experts no decode token took, the embedding's rows (32 KiB), then of layer 1's experts hit 40
    # times (of 100 tokens) expert 4 and expert 6's down_proj, one fused parameter at a time; the most hit stay
    assert rows == {"model.layers.0": "mlp.experts: gpu 0,2,5,7, uva 1,3-4,6",
                    "model.layers.1": "mlp.experts.down_proj.weight: gpu 1,3, uva 0,2,4-7; "
                                      "mlp.experts.gate_up_proj.weight: gpu 1,3,6, uva 0,2,4-5,7"}
    # per step: the embedding's row (128 B) and 40% of expert 4 (12 KiB) and of expert 6's down_proj (4 KiB)
    assert plan.summary.predicted_h2d_bytes_per_step == int(128 + 0.4 * 16 * 1024)
    assert plan.summary.working_peak_bytes == 4 * 12 * 1024
    assert plan.routing.path == "r.routing.yaml"
    assert plan.routing.fingerprint == profile_fingerprint((work / "r.routing.yaml").read_text())
    assert plan.notes[2] == ("routing from the profile r.routing.yaml (workload.routing): 100 decode tokens of 4 "
                             "prompts (prompts.txt); each layer's most-hit expert (of 8) takes 32.5% of decode hits "
                             "(12.5% if uniform)")
    assert not any(n.startswith("warning:") for n in plan.notes)  # the working memory is within the budget
    text = dumps(plan)
    assert f"routing:\n  path: r.routing.yaml\n  fingerprint: \"{plan.routing.fingerprint}\"\nbackend: mixed\n" in text
    (work / "m.plan.yaml").write_text(text)
    assert dumps(load_plan(work / "m.plan.yaml")) == text


def test_without_a_profile_routing_is_uniform_and_the_plan_says_so(work):
    plan, _ = build_file(mixed_policy(work, None), work / "m.plan.yaml")
    # least read first: the embedding's rows (32 KiB), then experts in order, whatever the router prefers, until 8
    # experts' bytes and the working memory's 2 (one layer reads over the link: no lookahead) are off, 120 KiB
    assert {l.name: l.experts for l in plan.layers if l.experts} == {"model.layers.0": (
        "mlp.experts.down_proj.weight: uva 0-7; mlp.experts.gate_up_proj.weight: gpu 7, uva 0-6")}
    assert plan.summary.working_peak_bytes == 2 * 12 * 1024
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


def test_diff_names_the_routing_profiles_of_alike_plans_by_where_they_lie(work, capsys):
    """The plan, its policy, profile and checkpoint copied to another folder: both name `r.routing.yaml`, so diff
    says which two files they are (resolved), not `r.routing.yaml -> r.routing.yaml`."""
    import shutil

    profile_file(work, fp=open_checkpoint(work / "ckpt").fingerprint)
    mixed_policy(work, "r.routing.yaml")
    assert main(["build", "m.policy.yaml"]) == 0
    (work / "copy").mkdir()
    for name in ("ckpt", "r.routing.yaml", "m.policy.yaml", "m.plan.yaml"):
        (shutil.copytree if (work / name).is_dir() else shutil.copy)(work / name, work / "copy" / name)
    capsys.readouterr()
    assert main(["diff", "m.plan.yaml", "copy/m.plan.yaml", "--detailed-exitcode"]) == 2
    assert (f"routing profile: {(work / 'r.routing.yaml').resolve().as_posix()} -> "
            f"{(work / 'copy' / 'r.routing.yaml').resolve().as_posix()}") in capsys.readouterr().out.splitlines()
