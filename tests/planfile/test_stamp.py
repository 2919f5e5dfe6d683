"""A plan's `built:` stamp (planner/provenance.py): `plan check` answers "up to date" from the inputs' bytes without
building the plan again, and any change the stamp does not vouch for goes to the full checks, which build it."""
from __future__ import annotations

import dataclasses
import json
from importlib import metadata

import pytest

import planner.planfile.staleness as staleness
from offplan.cli import main
from planner.inputs.checkpoint import fingerprint, open_checkpoint
from planner.inputs.hardware import H100, dumps_hardware
from planner.provenance import PLACEHOLDER, signed
from synthetic import qwen3_moe, write_header_only


@pytest.fixture
def plan(tmp_path, capsys):
    """A budget plan over a header-only Qwen3-MoE with its config.json and a hardware profile: the plan's path."""
    write_header_only(tmp_path / "ckpt", qwen3_moe(layers=2, hidden=64, experts=8, moe_intermediate=32, heads=2,
                                                   kv_heads=1, head_dim=32, vocab=256), shard_bytes=2**20)
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({"num_experts_per_tok": 2}))
    (tmp_path / "hw.yaml").write_text(dumps_hardware(dataclasses.replace(H100, name="test GPU", h2d_copy_gbps=50.0)))
    budget = open_checkpoint(tmp_path / "ckpt").total_bytes * 0.6 / 2**30
    policy = tmp_path / "p.policy.yaml"
    # a one-token prompt: the experts' working memory in the footprint (planner/decide/working.py) is then a decode
    # step's, not a prefill's whole layer of experts, which in a checkpoint this small costs more than it saves
    policy.write_text(f"format_version: 1\ncheckpoint: ./ckpt\nhardware: hw.yaml\nbudget_gib: {budget:.6f}\n"
                      "workload: {prompt_tokens: 1}\n")
    assert main(["build", str(policy)]) == 0
    capsys.readouterr()
    return tmp_path / "p.plan.yaml"


def builds_counted(monkeypatch) -> list:
    """Count the builds `plan check` runs (staleness.build)."""
    calls = []
    real = staleness.build
    monkeypatch.setattr(staleness, "build", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_a_built_plan_is_stamped_and_signed_and_an_edit_anywhere_unsigns_it(plan):
    text = plan.read_text()
    head = text[:text.index("checkpoint:")]
    assert "built:\n  offplan: " in head and "  inputs: \"sha256:" in head and PLACEHOLDER not in text
    assert signed(text)
    assert not signed(text.replace("notes:\n  - ", "notes:\n  - (edited) ", 1))
    assert not signed(text + "# reviewed\n")
    assert not signed(text.replace("built:\n", "built: \n"))  # the stamp itself
    assert not signed(text[:text.index("built:")] + text[text.index("checkpoint:"):])  # no stamp at all


def test_check_answers_from_the_stamp_without_building(plan, monkeypatch, capsys):
    calls = builds_counted(monkeypatch)
    assert main(["check", str(plan)]) == 0
    assert calls == [] and "up to date" in capsys.readouterr().out
    assert main(["check", str(plan), "--rebuild"]) == 0  # the exact answer: one build, compared byte for byte
    assert calls == [1]


@pytest.mark.parametrize("change", ["hardware", "config", "checkpoint", "version"])
def test_what_the_stamp_does_not_vouch_for_is_built_again_and_found_stale(plan, monkeypatch, capsys, change):
    """Before stamps, a changed hardware profile or config.json was found only by building again; it still is,
    and any edit of either makes the plan stale (the stamp's `inputs` differs), like the policy's bytes."""
    root = plan.parent
    if change == "hardware":
        (root / "hw.yaml").write_text((root / "hw.yaml").read_text() + "# recalibrated\n")
    elif change == "config":
        (root / "ckpt" / "config.json").write_text(json.dumps({"num_experts_per_tok": 3}))
    elif change == "checkpoint":
        index = root / "ckpt" / "model.safetensors.index.json"
        index.write_text(index.read_text() + "\n")
    else:  # another offplan installed
        monkeypatch.setattr("planner.provenance.metadata.version", lambda _: "99.0")
    calls = builds_counted(monkeypatch)
    assert staleness.up_to_date(plan) is None
    assert calls == [1]  # the stamp declined; one build said no
    assert main(["check", str(plan)]) == 2
    err = capsys.readouterr().err
    assert "STALE" in err
    if change in ("hardware", "config"):  # what the stamp's `inputs` covers, named
        assert (f"(the hardware profile {root / 'hw.yaml'} or the checkpoint's config.json changed since it was "
                "built)") in err
    if change == "version":
        assert "(edited by hand, or built with another hardware profile, config.json or offplan version)" in err


def test_a_plans_missing_checkpoint_is_one_error_naming_the_plans_key(plan, capsys):
    """check, apply and profile of a plan whose checkpoint was moved: exit 1 naming the plan, its checkpoint and
    the fix, before anything loads; build of its policy (the plan there) names the policy's key."""
    root = plan.parent
    (root / "ckpt").rename(root / "moved")
    want = (f"error: {plan}: its checkpoint {root / 'ckpt'} (checkpoint.path: ckpt, relative to the plan) is "
            "missing: put it back there, or build the plan again from a policy that names where it is now\n")
    for argv in (["check", str(plan)], ["apply", str(plan), "--max-new-tokens", "2"],
                 ["profile", str(plan), "-o", str(root / "r.yaml")]):
        assert main(argv) == 1
        assert capsys.readouterr().err == want, argv
    assert main(["build", str(root / "p.policy.yaml")]) == 1
    assert capsys.readouterr().err == (f"error: {root / 'p.policy.yaml'}: checkpoint: ./ckpt -> {root / 'ckpt'}: no "
                                       "such file or directory (the path is relative to the policy file)\n")


def test_a_plan_from_before_stamps_is_checked_by_building_it(plan, monkeypatch, capsys):
    text = plan.read_text()
    calls = builds_counted(monkeypatch)
    plan.write_text(text[:text.index("built:")] + text[text.index("checkpoint:"):])
    assert main(["check", str(plan)]) == 2  # built today, the plan has a stamp: this one is not what build makes
    assert calls and "not what `plan build` makes" in capsys.readouterr().err


@pytest.mark.parametrize("single", [False, True])
def test_the_quick_fingerprint_is_the_checkpoint_readers(tmp_path, single):
    write_header_only(tmp_path / "ckpt", qwen3_moe(layers=1, hidden=64, experts=4, moe_intermediate=32, heads=2,
                                                   kv_heads=1, head_dim=32, vocab=256), shard_bytes=2**16,
                      single=single)
    assert fingerprint(tmp_path / "ckpt") == open_checkpoint(tmp_path / "ckpt").fingerprint
    if not single:
        next((tmp_path / "ckpt").glob("*.safetensors")).unlink()
        assert fingerprint(tmp_path / "ckpt") is None


def test_an_uninstalled_offplan_finds_a_stamped_plan_current_by_building_it(plan, monkeypatch, capsys):
    """Run from a source tree (no version: its builds carry no stamp), a plan an installed offplan built and
    stamped is current where the rest of it is what the build makes; an edit is still stale."""
    def unknown(_):
        raise metadata.PackageNotFoundError("offplan")
    monkeypatch.setattr("planner.provenance.metadata.version", unknown)
    calls = builds_counted(monkeypatch)
    assert staleness.up_to_date(plan) is not None and calls == [1]
    assert main(["check", str(plan)]) == 0
    assert "up to date" in capsys.readouterr().out
    plan.write_text(plan.read_text() + "# reviewed\n")  # any other byte: not what the build makes
    assert main(["check", str(plan)]) == 2

