"""Bad input the corpus (test_bad_input.py) cannot cover: symlinks and hard links to inputs, `~`, merge keys,
closed pipes, names the file system refuses, a broken config.json, one shard of a sharded checkpoint, a truncated
shard and a plan cut inside its YAML."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bad_inputs import HEAD, POLICY, snapshot
from offplan.cli import main
from planner.inputs.policy import load_policy
from test_bad_input import work  # noqa: F401 (work: the fixture)

ROOT = Path(__file__).resolve().parents[2]


def test_an_output_linked_to_an_input_is_refused(work, capsys):
    (work / "link.yaml").symlink_to("p.policy.yaml")
    os.link(work / "hw.yaml", work / "hard.yaml")
    (work / "h.policy.yaml").write_text(POLICY + "hardware: hw.yaml\n")
    before = snapshot(work)
    assert main(["build", "p.policy.yaml", "-o", "link.yaml"]) == 1
    assert capsys.readouterr().err == (
        "error: link.yaml: this is the policy (p.policy.yaml), an input of the plan: writing the plan there "
        "would destroy it. Nothing was written; choose another -o (default: p.plan.yaml)\n")
    assert main(["build", "h.policy.yaml", "-o", "hard.yaml"]) == 1
    assert "error: hard.yaml: this is the hardware profile (hw.yaml), an input" in capsys.readouterr().err
    assert snapshot(work) == before


def test_an_output_that_is_a_file_but_no_plan_is_refused(work, capsys):
    """A file no rule names as an input (a checkpoint folder's other files, another policy, notes) is replaced only
    where it is a plan or empty (`-o "$(mktemp)"`): any other content stays, and the message says how to go on."""
    (work / "ckpt" / "generation_config.json").write_text('{"do_sample": false}\n')
    (work / "other.policy.yaml").write_text(POLICY)
    os.mkfifo(work / "fifo")  # not opened: it would block
    before = snapshot(work)
    for out in ("ckpt/generation_config.json", "other.policy.yaml", "fifo"):
        assert main(["build", "p.policy.yaml", "-o", out]) == 1
        assert capsys.readouterr().err == (
            f"error: {out}: exists and is not a plan (its first line is not the `# offplan plan ...` line offplan "
            "writes): writing the plan there would destroy it. Nothing was written; choose another -o (default: "
            "p.plan.yaml), or remove that file first\n")
    assert snapshot(work) == before
    (work / "empty.yaml").write_text("")
    assert main(["build", "p.policy.yaml", "-o", "empty.yaml"]) == 0
    assert (work / "empty.yaml").read_text().startswith("# offplan plan: ")


def test_calibrate_refuses_an_output_that_is_no_hardware_profile_before_measuring(work, capsys):
    before = snapshot(work)
    assert main(["calibrate", "-o", "p.policy.yaml"]) == 1  # on any machine: refused before the GPU is asked
    assert capsys.readouterr().err == (
        "error: p.policy.yaml: exists and is not a hardware profile (its first line is not the `# offplan hardware "
        "profile ...` line offplan writes): writing the hardware profile there would destroy it. Nothing was "
        "written; choose another -o, or remove that file first\n")
    assert snapshot(work) == before


def test_calibrate_refuses_more_host_threads_than_the_process_may_use_before_measuring(work, capsys):
    cores = len(os.sched_getaffinity(0))
    before = snapshot(work)
    # on any machine, GPU or not: refused before anything is measured
    assert main(["calibrate", "-o", "measured.yaml", "--cpu-threads", str(cores + 1)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: --cpu-threads {cores + 1}: this process may run on {cores} cores (its CPU "
                          f"affinity), so the host kernel can run 1 to {cores} threads; ask for at most {cores}")
    assert err.endswith("or widen the affinity (`taskset -c`, the container's CPU limit)\n") and err.count("\n") == 1
    assert snapshot(work) == before
    assert main(["calibrate", "-o", "measured.yaml", "--cpu-threads", "0"]) == 1  # not a count: a usage error
    assert "--cpu-threads: must be at least 1" in capsys.readouterr().err
    assert snapshot(work) == before


def test_rebuilding_over_the_previous_plan_is_allowed(work, capsys):
    before = (work / "p.plan.yaml").read_bytes()
    assert main(["build", "p.policy.yaml", "-o", "./p.plan.yaml"]) == 0
    assert (work / "p.plan.yaml").read_bytes() == before


def test_tilde_expands_to_the_home_directory(work, monkeypatch):
    monkeypatch.setenv("HOME", str(work))
    (work / "t.policy.yaml").write_text("format_version: 1\ncheckpoint: ~/ckpt\nhardware: ~/hw.yaml\n")
    got = load_policy(work / "t.policy.yaml")
    assert (got.checkpoint, got.hardware, got.checkpoint_text) == (work / "ckpt", work / "hw.yaml", "~/ckpt")
    assert main(["build", "t.policy.yaml"]) == 0


def test_a_key_a_merge_brings_in_may_be_overridden(work, capsys):
    """`<<: *base` then `step: 2` is YAML's way to override, not a duplicate; two `step:` are."""
    (work / "m.policy.yaml").write_text(HEAD + "prefetch:\n  <<: {group_size: 2, step: 1}\n  step: 2\n")
    assert main(["validate", "m.policy.yaml"]) == 0
    assert load_policy(work / "m.policy.yaml").prefetch.step == 2
    capsys.readouterr()
    (work / "m.policy.yaml").write_text(HEAD + "prefetch:\n  <<: {group_size: 2, step: 1}\n  step: 2\n  step: 3\n")
    assert main(["validate", "m.policy.yaml"]) == 1
    assert capsys.readouterr().err.endswith("m.policy.yaml:6:3: 'step' again (first at 5:3)\n")


@pytest.mark.parametrize("argv", [["show", "p.plan.yaml"], ["build", "p.policy.yaml", "-o", "-"]])
def test_a_closed_stdout_ends_quietly(work, argv):
    """The reader is gone before the command writes (as `| head` does once it has its lines)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.Popen([sys.executable, "-m", "offplan", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert (proc.wait(), err) == (141, "")


@pytest.mark.parametrize("module", ["offplan", "offplan.cli"])
def test_both_module_spellings_run_the_cli(work, module):
    """`python -m offplan` and `python -m offplan.cli` (torchrun's `-m` takes either) run the command, as `plan`
    does: here `plan show`, its table on stdout."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-m", module, "show", "p.plan.yaml"], capture_output=True, text=True,
                          env=env)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.startswith("plan for ")


def test_ctrl_c_while_the_cli_is_imported_is_one_line_and_exit_130(monkeypatch, capsys):
    """`plan` (offplan/__main__.py `run`) imports the CLI inside the handler: an interrupt there, as in a command,
    prints `interrupted`, no traceback."""
    import types

    import offplan.__main__ as entry

    class Interrupted(types.ModuleType):
        def __getattr__(self, name):
            raise KeyboardInterrupt
    monkeypatch.setitem(sys.modules, "offplan.cli", Interrupted("offplan.cli"))
    assert entry.run() == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_a_name_longer_than_the_file_system_allows_is_one_error(work, capsys):
    """Wherever the long name is (the plan's -o, the policy's checkpoint or hardware): exit 1, one line naming it."""
    long = "a" * 300
    (work / "c.policy.yaml").write_text(f"format_version: 1\ncheckpoint: ./{long}\n")
    (work / "h.policy.yaml").write_text(POLICY + f"hardware: {long}.yaml\n")
    before = snapshot(work)
    for argv in (["build", "p.policy.yaml", "-o", f"{long}.plan.yaml"], ["build", "c.policy.yaml"],
                 ["build", "h.policy.yaml"]):
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and long in err, err
        assert "File name too long" in err and "Traceback" not in err
    assert snapshot(work) == before


@pytest.mark.parametrize("text", ["{bad", "[1, 2]", '{"num_experts_per_tok": "eight"}'])
def test_a_broken_config_json_is_an_error_not_a_plan_without_it(work, capsys, text):
    (work / "ckpt" / "config.json").write_text(text)
    before = snapshot(work)
    assert main(["build", "p.policy.yaml", "-o", "new.plan.yaml"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {Path('ckpt') / 'config.json'}: ") and "restore the checkpoint's config.json" in err
    assert snapshot(work) == before


def test_one_shard_of_a_sharded_checkpoint_is_refused(work, capsys):
    (work / "s.policy.yaml").write_text("format_version: 1\ncheckpoint: ./ckpt/model-00001-of-00002.safetensors\n")
    assert main(["build", "s.policy.yaml"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ckpt/model-00001-of-00002.safetensors: one of the 2 shards that "
                          "model.safetensors.index.json beside it indexes (it holds ")
    assert err.endswith("point `checkpoint:` at the folder, ckpt\n") and not (work / "s.plan.yaml").exists()


def test_shards_without_their_index_are_refused(work, capsys):
    """The index gone: the folder says the index is missing, and one shard alone is refused by its name (it was
    planned as a whole checkpoint: a fraction of the model)."""
    (work / "ckpt" / "model.safetensors.index.json").unlink()
    (work / "s.policy.yaml").write_text("format_version: 1\ncheckpoint: ./ckpt/model-00001-of-00002.safetensors\n")
    (work / "d.policy.yaml").write_text("format_version: 1\ncheckpoint: ./ckpt\n")
    before = snapshot(work)
    assert main(["build", "s.policy.yaml"]) == 1
    assert capsys.readouterr().err == (
        "error: ckpt/model-00001-of-00002.safetensors: its name says it is shard 1 of 2, and no "
        "model.safetensors.index.json beside it lists the others: planned alone, it would be part of the model; put "
        "the index back and point `checkpoint:` at the folder, ckpt\n")
    assert main(["build", "d.policy.yaml"]) == 1
    assert capsys.readouterr().err.endswith(": shards of a checkpoint whose model.safetensors.index.json is missing; "
                                            "put it back, as the checkpoint's writer made it)\n")
    assert snapshot(work) == before


def test_a_config_json_declaring_more_layers_than_the_checkpoint_holds_is_refused(work, capsys):
    """config.json says 8 decoder layers, the checkpoint's tensors make 4: refused at build, not at the load."""
    (work / "ckpt" / "config.json").write_text('{"num_hidden_layers": 8}\n')
    before = snapshot(work)
    assert main(["build", "p.policy.yaml", "-o", "new.plan.yaml"]) == 1
    assert capsys.readouterr().err == (
        f"error: {Path('ckpt') / 'config.json'}: num_hidden_layers is 8, but the checkpoint's tensors make 4 layers of "
        "model.layers: a checkpoint missing layers (a shard left out?) or the config.json of another model; point "
        "`checkpoint:` at the whole checkpoint, or restore its config.json\n")
    assert snapshot(work) == before
    (work / "ckpt" / "config.json").write_text('{"num_hidden_layers": 4}\n')
    assert main(["build", "p.policy.yaml", "-o", "new.plan.yaml"]) == 0


def test_a_truncated_shard_names_the_tensors_past_its_end_once(work, capsys):
    shard = work / "ckpt" / "model-00002-of-00002.safetensors"
    os.truncate(shard, shard.stat().st_size - 100)
    assert main(["build", "p.policy.yaml", "-o", "new.plan.yaml"]) == 1
    err = capsys.readouterr().err
    assert "the checkpoint is invalid (1 problem)\n" in err and "in the index but not in this shard" not in err


def test_a_plan_cut_inside_its_yaml_says_to_rebuild(work, capsys):
    text = (work / "p.plan.yaml").read_text()
    second = text.index("\n", text.index("\nsummary:\n") + 10) + 6  # inside the summary's second key: no ':'
    (work / "cut.plan.yaml").write_text(text[:second])
    assert main(["show", "cut.plan.yaml"]) == 1
    err = capsys.readouterr().err
    assert "invalid YAML" in err and err.endswith("(it starts as a plan: cut short, or edited?); rebuild it with "
                                                  "`plan build POLICY`\n"), err


def test_output_paths_that_cannot_be_written_say_what_to_do(work, capsys):
    """An empty -o, and a folder that does not exist (found before planning): one error each, with the fix, and
    nothing written."""
    before = snapshot(work)
    assert main(["build", "p.policy.yaml", "-o", ""]) == 1
    assert capsys.readouterr().err == ("error: -o: an empty path; name the plan file to write, or leave -o out for "
                                       "p.plan.yaml\n")
    assert main(["build", "p.policy.yaml", "-o", "nowhere/p.plan.yaml"]) == 1
    assert capsys.readouterr().err == ("error: nowhere/p.plan.yaml: cannot write the plan: its folder nowhere does "
                                       "not exist; create it, or write the plan elsewhere\n")
    assert snapshot(work) == before


def test_validate_of_a_file_of_none_of_offplans_kinds_is_one_error(work, capsys):
    """A checkpoint's config.json given to `plan validate`: not read as a policy with a dozen unknown keys."""
    (work / "ckpt" / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 4, "vocab_size": 8}\n')
    assert main(["validate", "ckpt/config.json"]) == 1
    assert capsys.readouterr().err == (
        "error: ckpt/config.json: not a policy, plan, hardware or routing profile (none of its keys is one of "
        "theirs, or close to one): `plan validate` checks offplan's files\n")
    (work / "typo.policy.yaml").write_text("chekpoint: ./ckpt\n")  # misspelled: read as the policy it nearly is
    assert main(["validate", "typo.policy.yaml"]) == 1
    assert "did you mean 'checkpoint'?" in capsys.readouterr().err
