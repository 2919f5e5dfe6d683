"""`plan validate` and `plan check` through `main(argv)`, bad input as one clean error, and hand edits that
every reader of a plan catches."""
from __future__ import annotations

import json
import os

import pytest

from headeronly import write_policy
from test_cli import UVA_POLICY, assert_one_error, run, work  # noqa: F401 (work: the fixture)


def test_validate_policy_and_plan(work, capsys):
    assert run(capsys, "validate", "uva.policy.yaml") == (
        0, "uva.policy.yaml: valid policy (checkpoint ckpt, 11 tensors; it plans backend uva)\n", "")
    run(capsys, "build", "uva.policy.yaml")
    assert run(capsys, "validate", "uva.plan.yaml") == (0, "uva.plan.yaml: valid plan (11 tensors, backend uva)\n", "")
    code, out, _ = run(capsys, "validate", "uva.plan.yaml", "--json")
    assert json.loads(out) == {"file": "uva.plan.yaml", "kind": "plan", "valid": True, "tensors": 11, "exact": True}
    code, out, _ = run(capsys, "validate", "uva.policy.yaml", "--json")
    assert json.loads(out) == {"file": "uva.policy.yaml", "kind": "policy", "valid": True, "backend": "uva"}


def test_validate_says_what_it_checked_and_warns_as_build_does(work, capsys):
    """A plan whose checkpoint is not at hand is checked by its structure alone, and the line says so; a policy's
    plan warnings (here: as many prefetch slots as layers) come on stderr, as `plan build` prints them."""
    run(capsys, "build", "uva.policy.yaml")
    os.rename(work / "ckpt", work / "moved")
    assert run(capsys, "validate", "uva.plan.yaml") == (
        0, "uva.plan.yaml: valid plan (11 tensors, backend uva); its parts agree, but not checked against tensor "
           "sizes: its checkpoint ckpt is not at hand\n", "")
    os.rename(work / "moved", work / "ckpt")
    write_policy(work, "prefetch:\n  group_size: 2\n  step: 2\n", name="two.policy.yaml")
    code, out, err = run(capsys, "validate", "two.policy.yaml")
    assert code == 0 and out.startswith("two.policy.yaml: valid policy")
    assert err.startswith("warning: the plan saves little GPU memory: nothing of the 6.0 MiB offloaded")


def test_validate_rejects_a_policy_whose_pattern_matches_nothing(work, capsys):
    write_policy(work, "uva:\n  offload_gib: 0.001\n  params: [mlp.dwon_proj]\n", name="typo.policy.yaml")
    code, out, err = run(capsys, "validate", "typo.policy.yaml")
    assert_one_error(code, out, err, "typo.policy.yaml:5:12: uva.params[0]: 'mlp.dwon_proj' matches no "
                     "tensor of the checkpoint; did you mean 'mlp.down_proj'?")


def test_check_fresh_then_stale(work, capsys):
    run(capsys, "build", "uva.policy.yaml")
    assert run(capsys, "check", "uva.plan.yaml") == (0, "uva.plan.yaml: up to date with ckpt and uva.policy.yaml\n", "")
    code, out, _ = run(capsys, "check", "uva.plan.yaml", "--json")
    assert (code, json.loads(out)) == (0, {"plan": "uva.plan.yaml", "stale": False, "problems": []})

    # The policy changes (a comment is enough: the plan records the bytes it was built from).
    policy = work / "uva.policy.yaml"
    policy.write_text(policy.read_text() + "# tweak\n")
    code, out, err = run(capsys, "check", "uva.plan.yaml")
    assert code == 2 and out == ""
    assert err == ("uva.plan.yaml: STALE\n  - the policy uva.policy.yaml changed since the plan was built\n"
                   "  rebuild it: plan build uva.policy.yaml -o uva.plan.yaml\n")
    policy.write_text("not: [valid\n")  # stale even when it no longer parses
    assert run(capsys, "check", "uva.plan.yaml")[0] == 2
    policy.write_text("format_version: 1\ncheckpoint: ./ckpt\n" + UVA_POLICY)
    assert run(capsys, "check", "uva.plan.yaml")[0] == 0


def test_check_stale_after_a_shard_header_changes(work, capsys):
    run(capsys, "build", "uva.policy.yaml")
    shard = work / "ckpt" / "model-00001-of-00002.safetensors"
    with open(shard, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        header = f.read(n)
        assert b'"format":"pt"' in header
        f.seek(8)
        f.write(header.replace(b'"format":"pt"', b'"format":"PT"'))
    code, out, _ = run(capsys, "check", "uva.plan.yaml", "--json")
    data = json.loads(out)
    assert code == 2 and data["stale"] is True
    assert data["problems"][0].startswith("the checkpoint ckpt changed since the plan was built")


def test_check_with_the_policy_gone(work, capsys):
    """Stale, and the advice is not to build from the file that is gone."""
    run(capsys, "build", "uva.policy.yaml")
    os.remove(work / "uva.policy.yaml")
    code, _, err = run(capsys, "check", "uva.plan.yaml")
    assert code == 2 and "the policy uva.policy.yaml named by the plan is gone" in err
    assert err.endswith("  rebuild it from its policy: put uva.policy.yaml back, or `plan build` another policy with "
                        "-o uva.plan.yaml\n")


def test_check_with_the_hardware_profile_gone(work, capsys):
    """As with a gone routing profile: stale (exit 2), naming it, not an invalid policy (exit 1)."""
    from planner.inputs.hardware import H100, dumps_hardware

    (work / "hw.yaml").write_text(dumps_hardware(H100))
    policy = work / "uva.policy.yaml"
    policy.write_text(policy.read_text() + "hardware: hw.yaml\n")
    run(capsys, "build", "uva.policy.yaml")
    os.remove(work / "hw.yaml")
    code, _, err = run(capsys, "check", "uva.plan.yaml")
    assert (code, err.splitlines()[:2]) == (2, ["uva.plan.yaml: STALE",
                                                "  - the hardware profile hw.yaml named by the policy is gone"])


def write_toy_plan(work, capsys):
    run(capsys, "build", "uva.policy.yaml")
    return (work / "uva.plan.yaml").read_text()


BAD_INPUTS = [
    (["build", "missing.policy.yaml"], "missing.policy.yaml: no such policy file"),
    (["build", "bad.policy.yaml"], "bad.policy.yaml:4:1: invalid YAML: did not find expected ',' or ']'"),
    (["build", "schema.policy.yaml"], "schema.policy.yaml:3:1: budget_gb: unknown key; did you mean 'budget_gib'?"),
    (["build", "nockpt.policy.yaml"], "nowhere: no such file or directory"),
    (["build", "budget.policy.yaml"], "the smallest budget that fits this policy is budget_gib: 0.014648438 (15.0 MiB)"),
    (["build", "uva.policy.yaml", "-o", "no/such/dir/p.yaml"], "no/such/dir/p.yaml: cannot write the plan"),
    (["show", "missing.plan.yaml"], "missing.plan.yaml: no such plan file"),
    (["show", "uva.policy.yaml"], "uva.policy.yaml: this is a policy, not a plan"),
    (["show", "edited.plan.yaml"], "edited.plan.yaml: the plan is inconsistent"),
    (["validate", "schema.policy.yaml"], "budget_gb: unknown key"),
    (["validate", "edited.plan.yaml"], "checkpoint.tensors is 3 but params lists 11"),
    (["check", "missing.plan.yaml"], "missing.plan.yaml: no such plan file"),
    (["diff", "only-one.plan.yaml"], "the following arguments are required: NEW (see `plan diff --help`)"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    ([], "the following arguments are required: COMMAND"),
    (["build", "uva.policy.yaml", "--bogus"], "unrecognized arguments: --bogus (see `plan build --help`)"),
]


@pytest.mark.parametrize("argv, message", BAD_INPUTS, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_input_is_one_error_exit_1_and_writes_nothing(work, capsys, argv, message):
    write_policy(work, "uva: {offload_gib: [1\n", name="bad.policy.yaml")
    write_policy(work, "budget_gb: 4\n", name="schema.policy.yaml")
    write_policy(work, "budget_gib: 0.001\n", name="budget.policy.yaml")
    write_policy(work, "", name="nockpt.policy.yaml", head="format_version: 1\ncheckpoint: nowhere\n")
    (work / "edited.plan.yaml").write_text(write_toy_plan(work, capsys).replace("tensors: 11", "tensors: 3"))
    before = sorted(p.name for p in work.iterdir())
    code, out, err = run(capsys, *argv)
    assert_one_error(code, out, err, message)
    assert sorted(p.name for p in work.iterdir()) == before  # nothing written, no temp file


def test_a_checkpoint_error_lists_every_problem_in_one_message(work, capsys):
    shard = work / "ckpt" / "model-00002-of-00002.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(100)
    code, out, err = run(capsys, "build", "uva.policy.yaml")
    assert_one_error(code, out, err, "the checkpoint is invalid (1 problem)\n  - model-00002-of-00002.safetensors: "
                     "header length")
    assert not (work / "uva.plan.yaml").exists()


def hand_edit(work, name="uva.plan.yaml"):
    """One placement flipped, the layer table left as it was: (line of the layer's row, of the edit)."""
    plan = work / name
    text = plan.read_text()
    name = "  model.layers.0.self_attn.o_proj.weight: "
    edited = text.replace(name + "uva", name + "gpu")
    assert edited != text
    plan.write_text(edited)
    return (edited[:edited.index("{name: model.layers.0,")].count("\n") + 1,
            edited[:edited.index("model.layers.0.self_attn.o_proj.weight: gpu")].count("\n") + 1)


def test_show_validate_and_check_catch_one_flipped_placement(work, capsys):
    run(capsys, "build", "uva.policy.yaml")
    row, param = hand_edit(work)
    error = ("error: uva.plan.yaml: the plan is inconsistent (edited by hand?): params: compared with layers:, "
             "summary:, prefetch: and prefill: with the tensor sizes in its checkpoint's headers; rebuild it: plan build "
             "uva.policy.yaml -o uva.plan.yaml\n"
             f"  - uva.plan.yaml:{row}:5: layers[1]: model.layers.0 has gpu 0, uva 3,145,728, prefetch 0; its "
             "tensors in params: have gpu 1,048,576, uva 2,097,152, prefetch 0 "
             f"(uva.plan.yaml:{param}:43: params.model.layers.0.self_attn.o_proj.weight: gpu)\n")
    assert run(capsys, "show", "uva.plan.yaml") == (1, "", error)
    assert run(capsys, "show", "uva.plan.yaml", "--tensors") == (1, "", error)
    assert run(capsys, "validate", "uva.plan.yaml") == (1, "", error)
    code, out, err = run(capsys, "check", "uva.plan.yaml")
    assert (code, out) == (2, "")
    assert err == "uva.plan.yaml: STALE\n" + "".join(f"  - {line.strip().removeprefix('- ')}\n"
                                                    for line in error[7:].splitlines())
    run(capsys, "build", "uva.policy.yaml", "-o", "fresh.plan.yaml")
    assert run(capsys, "diff", "fresh.plan.yaml", "uva.plan.yaml")[:2] == (1, "")


def test_check_catches_a_hand_edit_the_parts_agree_on(work, capsys):
    run(capsys, "build", "uva.policy.yaml")
    plan = work / "uva.plan.yaml"
    # A note rewritten: every part of the plan still agrees, but a rebuild differs.
    plan.write_text(plan.read_text().replace("3.0 MiB on uva from 1 layer", "nothing much"))
    code, out, err = run(capsys, "check", "uva.plan.yaml")
    assert code == 2
    assert "the plan is not what `plan build` makes of its policy and checkpoint" in err


def test_diff_notices_a_changed_checkpoint_alone(work, capsys):
    run(capsys, "build", "uva.policy.yaml")
    text = (work / "uva.plan.yaml").read_text()
    fp = text.split("fingerprint: ")[1].split("\n")[0]
    (work / "other.plan.yaml").write_text(text.replace(fp, '"sha256:' + "0" * 64 + '"', 1))
    code, out, _ = run(capsys, "diff", "uva.plan.yaml", "other.plan.yaml", "--detailed-exitcode")
    assert code == 2 and out.splitlines()[0] == "checkpoint: its headers differ (another fingerprint)"


def test_diff_names_the_files_that_make_two_alike_plans_differ(work, capsys):
    """The same plan copied into another folder with its own copy of the checkpoint and the policy: it names other
    files, so it differs (exit 2), and the lines say which, resolved where each plan names them alike."""
    import shutil

    run(capsys, "build", "uva.policy.yaml")
    (work / "copy").mkdir()
    for name in ("ckpt", "uva.policy.yaml", "uva.plan.yaml"):
        (shutil.copytree if (work / name).is_dir() else shutil.copy)(work / name, work / "copy" / name)
    code, out, _ = run(capsys, "diff", "uva.plan.yaml", "copy/uva.plan.yaml", "--detailed-exitcode")
    assert code == 2 and out.splitlines()[:2] == [
        f"policy: {(work / 'uva.policy.yaml').resolve().as_posix()} -> "
        f"{(work / 'copy' / 'uva.policy.yaml').resolve().as_posix()} (same content)",
        f"checkpoint: {(work / 'ckpt').resolve().as_posix()} -> {(work / 'copy' / 'ckpt').resolve().as_posix()} "
        "(the same headers)"]


def test_validate_tells_policy_from_plan_by_content_not_comments(work, capsys):
    text = (work / "uva.policy.yaml").read_text()
    (work / "commented.policy.yaml").write_text("# compare with the offplan plan of last week\n" + text)
    code, out, _ = run(capsys, "validate", "commented.policy.yaml")
    assert code == 0 and "valid policy" in out


@pytest.mark.parametrize("cut", [100, 300])
def test_a_plan_cut_short_is_said_to_be_one_by_every_reader(work, capsys, cut):
    """Its first line, offplan's, still says it is a plan: `validate` reads it as one (not as a policy missing its
    keys), and every reader says what it lacks and that it may be cut short."""
    run(capsys, "build", "uva.policy.yaml")
    (work / "cut.plan.yaml").write_bytes((work / "uva.plan.yaml").read_bytes()[:cut])
    for command in ("validate", "show", "check"):
        code, out, err = run(capsys, command, "cut.plan.yaml")
        assert_one_error(code, out, err, "cut.plan.yaml: not an offplan plan (no `params:` mapping) (it starts as "
                         "one: cut short?); build one with `plan build POLICY`")


def test_with_json_an_error_goes_to_stdout_as_json_too(work, capsys):
    write_policy(work, "uva:\n  offload_gib: 0.001\n  params: [mlp.dwon_proj]\n", name="typo.policy.yaml")
    code, out, err = run(capsys, "build", "typo.policy.yaml", "--json")
    assert code == 1 and err.startswith("error: typo.policy.yaml: ")
    assert json.loads(out) == {"error": "typo.policy.yaml: patterns that match nothing", "problems": [
        "typo.policy.yaml:5:12: uva.params[0]: 'mlp.dwon_proj' matches no tensor of the checkpoint; did you mean "
        "'mlp.down_proj'?"]}
    code, out, err = run(capsys, "show", "nope.plan.yaml", "--json")
    assert code == 1 and json.loads(out) == {"error": "nope.plan.yaml: no such plan file", "problems": []}
    code, out, err = run(capsys, "--json", "show", "nope.plan.yaml")  # before the command: the same
    assert (code, err) == (1, "error: nope.plan.yaml: no such plan file\n") and json.loads(out)["problems"] == []
    code, out, err = run(capsys, "show", "nope.plan.yaml")
    assert (code, out) == (1, "")


def test_a_setting_the_plan_ignores_is_a_warning_in_its_notes_too(work, capsys):
    """`plan build` says it once with its file:line:column; the plan keeps it, without them, for `plan show`."""
    write_policy(work, UVA_POLICY + "cpu_experts: true\n", name="ign.policy.yaml")
    code, _, err = run(capsys, "build", "ign.policy.yaml")
    said = "cpu_experts is set but backend is not mixed; it is ignored (rules place experts on cpu with `place: cpu`)"
    assert code == 0 and err.count(said) == 1 and "ign.policy.yaml:" in err.split(said)[0].splitlines()[-1]
    code, out, err = run(capsys, "show", "ign.plan.yaml")
    assert code == 0 and said in out + err


def test_show_counts_experts_on_cpu_as_offloaded_as_the_warnings_do(tmp_path, monkeypatch, capsys):
    """Experts 0-5 of 8 on cpu and 6 on uva: `plan show`'s line and the plan's warning count the same bytes off
    the GPU (uva and cpu both), so they agree on what offloading saves: here, against the experts' working memory
    (a prefill gathers every expert of a layer, and streams the cpu ones through the ring), it costs 4.5 MiB."""
    from headeronly import moe_toy
    from planner.inputs.hardware import H100, dumps_hardware
    from synthetic import write_header_only

    monkeypatch.chdir(tmp_path)
    write_header_only(tmp_path / "ckpt", moe_toy(layers=2, experts=8), single=True)
    (tmp_path / "hw.yaml").write_text(dumps_hardware(H100))
    write_policy(tmp_path, "hardware: hw.yaml\nrules:\n  - {match: ['re:experts\\.[0-5]\\.'], place: cpu}\n"
                 "  - {match: ['re:experts\\.6\\.'], place: uva}\n", name="c.policy.yaml")
    assert run(capsys, "build", "c.policy.yaml")[0] == 0
    out = run(capsys, "show", "c.plan.yaml")[1].splitlines()
    line = next(x for x in out if x.startswith("host (pinned)"))
    assert line.startswith("host (pinned): 6.0 MiB uva + 36.0 MiB cpu; offloading costs 4.5 MiB of GPU memory")
    assert out[-1].startswith("warning: the plan saves little GPU memory: none: it takes 4.5 MiB more than keeping")
