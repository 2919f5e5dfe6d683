"""`plan check`'s short answer (staleness.py `up_to_date`) against its full checks: a plan `plan build` makes
passes every check a reader runs (schema, consistency against the headers), so a file byte for byte equal to a
fresh build is current; any other file is left to the full checks, whose verdicts stay as they were."""
from __future__ import annotations

import json

import pytest

from headeronly import PROFILE, profile_file
from offplan.cli import main
from planner.inputs.checkpoint import open_checkpoint
from planner.planfile import read_plan
from planner.planfile.staleness import stale_reasons, up_to_date
from synthetic import deepseek_v3, gpt_oss, qwen3_moe, write_header_only

CHECKPOINTS = {
    "deepseek": (lambda: deepseek_v3(layers=4, dense_layers=1, hidden=256, intermediate=512, experts=8,
                                     moe_intermediate=128, heads=4, q_lora=128, kv_lora=64, nope=32, rope=16,
                                     v_head=32, vocab=512),
                 {"num_hidden_layers": 4, "num_nextn_predict_layers": 1, "n_routed_experts": 8,
                  "num_experts_per_tok": 2}),
    "qwen3": (lambda: qwen3_moe(layers=2, hidden=64, experts=8, moe_intermediate=32, heads=2, kv_heads=1,
                                head_dim=32, vocab=256), {"num_experts_per_tok": 2}),
    "gpt-oss": (lambda: gpt_oss(layers=2, hidden=64, intermediate=64, experts=4, heads=4, kv_heads=2, head_dim=16,
                                vocab=256), {"num_local_experts": 4, "num_experts_per_tok": 2}),
}
POLICIES = {
    "none": "",
    "uva": "backend: uva\nuva: {offload_gib: 0.0005}\n",
    # a one-token prompt read in place: the experts' working memory, in the footprint (planner/decide/working.py),
    # stays below what the walk saves in checkpoints this small (a long prompt's prefill gathers a layer's experts)
    "budget": "budget_gib: BUDGET\nuva: {stage_prefill: false}\nworkload: {prompt_tokens: 1}\n",
    "prefetch": "prefetch: {group_size: 2, num_in_group: 1, step: 2, params: [experts]}\n"
                "rules:\n  - match: [embed_tokens]\n    place: uva\n",
    "prefetch-budget": "backend: prefetch\nbudget_gib: BUDGET\nprefetch: {step: 1}\n",
    "mixed": "backend: mixed\nbudget_gib: BUDGET\nuva: {stage_prefill: false}\nworkload: {batch_size: 4}\n",
}


def built(tmp_path, model: str, name: str):
    """(plan path, policy path) of POLICIES[name] built over CHECKPOINTS[model] (budgets: 9/10 of its bytes)."""
    tensors, config = CHECKPOINTS[model]
    write_header_only(tmp_path / "ckpt", tensors(), shard_bytes=2**20)
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    budget = open_checkpoint(tmp_path / "ckpt").total_bytes * 0.9 / 2**30
    policy = tmp_path / f"{name}.policy.yaml"
    policy.write_text("format_version: 1\ncheckpoint: ./ckpt\n" + POLICIES[name].replace("BUDGET", f"{budget:.6f}"))
    assert main(["build", str(policy)]) == 0
    return tmp_path / f"{name}.plan.yaml", policy


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("model", CHECKPOINTS)
def test_a_fresh_plan_passes_every_check_and_is_up_to_date(tmp_path, capsys, model, name):
    plan_path, policy = built(tmp_path, model, name)
    loaded = read_plan(plan_path)  # schema and consistency, exact against the headers
    assert loaded.unchecked is None
    assert stale_reasons(loaded.plan, plan_path, open_checkpoint(tmp_path / "ckpt")) == []
    assert up_to_date(plan_path) is not None


@pytest.mark.parametrize("edit", ["placement", "note", "comment", "policy", "checkpoint", "not a plan"])
def test_what_is_not_a_fresh_build_is_left_to_the_full_checks(tmp_path, capsys, edit):
    plan_path, policy = built(tmp_path, "qwen3", "budget")
    text = plan_path.read_text()
    if edit == "placement":
        last = text.splitlines(True)[-1]
        flipped = last.replace(": gpu\n", ": uva\n") if last.endswith(": gpu\n") else last.split(": ")[0] + ": gpu\n"
        plan_path.write_text(text[:-len(last)] + flipped)
    elif edit == "note":
        plan_path.write_text(text.replace("notes:\n  - ", "notes:\n  - (edited) ", 1))
    elif edit == "comment":
        plan_path.write_text(text + "# reviewed\n")
    elif edit == "policy":
        policy.write_text(policy.read_text() + "# tweak\n")
    elif edit == "checkpoint":
        (tmp_path / "ckpt" / "model.safetensors.index.json").write_text(
            (tmp_path / "ckpt" / "model.safetensors.index.json").read_text() + "\n")
    else:
        plan_path.write_text("params: {}\n")
    assert up_to_date(plan_path) is None
    assert main(["check", str(plan_path)]) in (1, 2)


def test_a_routing_profile_that_changes_makes_the_plan_stale(tmp_path, capsys):
    write_header_only(tmp_path / "ckpt", qwen3_moe(layers=2, hidden=64, experts=8, moe_intermediate=32, heads=2,
                                                   kv_heads=1, head_dim=32, vocab=256), shard_bytes=2**20)
    fp = open_checkpoint(tmp_path / "ckpt").fingerprint
    profile = profile_file(tmp_path, fp=fp)
    policy = tmp_path / "r.policy.yaml"
    policy.write_text(f"format_version: 1\ncheckpoint: ./ckpt\nworkload: {{routing: {profile.name}}}\n")
    assert main(["build", str(policy)]) == 0
    plan_path = tmp_path / "r.plan.yaml"
    assert up_to_date(plan_path).routing == profile
    capsys.readouterr()
    assert main(["check", str(plan_path)]) == 0
    assert capsys.readouterr().out == f"{plan_path}: up to date with {tmp_path / 'ckpt'}, {policy} and {profile}\n"
    profile.write_text(profile.read_text().replace(PROFILE.splitlines()[-1], PROFILE.splitlines()[-1] + " "))
    assert up_to_date(plan_path) is None and main(["check", str(plan_path)]) == 2
