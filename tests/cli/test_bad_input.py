"""Bad input never gives a traceback and never destroys a file.

The corpus runs each bad input through `main(argv)` and asserts: exit code 1,
one `error:` message on stderr that names the file (with `file:line:column` for
YAML) or key and the fix, no traceback, nothing on stdout, and every file in
the working directory as it was (names, sizes, mtimes). test_bad_input_beyond.py
covers what it cannot.
"""
from __future__ import annotations

import importlib.util

import pytest

from bad_inputs import (HARDWARE, HEAD, POLICY, case, edited_plan, fp8_checkpoint, hardware, nothing, policy,
                        routing_profile, snapshot, socket_file, write)
from offplan.cli import main

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="plan apply needs torch")


@pytest.fixture
def work(tmp_path, toy_ckpt, monkeypatch):
    """cwd = tmp_path: ckpt/ (header-only toy checkpoint), p.policy.yaml, its plan p.plan.yaml, hw.yaml."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.policy.yaml").write_text(POLICY)
    (tmp_path / "hw.yaml").write_text(HARDWARE)
    assert main(["build", "p.policy.yaml"]) == 0
    return tmp_path


CORPUS = [
    # Non-finite and absurd numbers: refused at the schema, with the key's location.
    case("nan budget", policy("budget_gib: .nan\n"), ["build", "bad.policy.yaml"],
     "bad.policy.yaml: the policy is invalid\n"
     "  - bad.policy.yaml:3:13: budget_gib: must be a number, not .nan (finite numbers only)"),
    case("inf budget", policy("budget_gib: .inf\n"), ["build", "bad.policy.yaml"],
     "bad.policy.yaml:3:13: budget_gib: must be a number, not .inf (finite numbers only)"),
    case("-inf offload", policy("uva:\n  offload_gib: -.inf\n"), ["build", "bad.policy.yaml"],
     "bad.policy.yaml:4:16: uva.offload_gib: must be a number, not -.inf (finite numbers only)"),
    case("1e300 budget", policy("budget_gib: 1.0e+300\n"), ["build", "bad.policy.yaml"],
     "bad.policy.yaml:3:13: budget_gib: must be at most 1048576, not 1e+300"),
    case("huge integer budget", policy("budget_gib: 99999999999999999999999\n"), ["validate", "bad.policy.yaml"],
     "bad.policy.yaml:3:13: budget_gib: must be at most 1048576, not 99999999999999999999999"),
    case("huge batch", policy("workload: {batch_size: 0x10000000000}\n"), ["build", "bad.policy.yaml"],
     "bad.policy.yaml:3:24: workload.batch_size: must be at most 65536, not 1099511627776"),
    case("nan group_size", policy("prefetch:\n  group_size: .nan\n"), ["build", "bad.policy.yaml"],
     "bad.policy.yaml:4:15: prefetch.group_size: must be a whole number, not .nan (finite numbers only)"),
    case("1e300 step", policy("prefetch: {group_size: 2, step: 1.0e+300}\n"), ["build", "bad.policy.yaml"],
     "bad.policy.yaml:3:33: prefetch.step: must be at most 65536, not 1e+300"),
    case("nan in a plan", edited_plan("  gpu_bytes: ", "  gpu_bytes: .nan #", at=".nan"), ["show", "bad.plan.yaml"],
         "bad.plan.yaml: the plan is invalid\n"
         "  - bad.plan.yaml:{at}: summary.gpu_bytes: must be a whole number, not .nan (finite numbers only)"),
    case("inf in a plan's cost", edited_plan("batch_size: 1,", "batch_size: .inf,", at=".inf"),
         ["check", "bad.plan.yaml"],
         "bad.plan.yaml:{at}: cost.batch_size: must be a whole number, not .inf (finite numbers only)"),
    case("huge integer in a plan", edited_plan("  tensors: 11", "  tensors: 99999999999999999999", at="99999999999999999999"),
         ["validate", "bad.plan.yaml"],
         "bad.plan.yaml:{at}: checkpoint.tensors: must be at most 9007199254740992, not 99999999999999999999"),
    case("nan in a hardware profile", hardware("h2d_copy_gbps: 55.0", "h2d_copy_gbps: .nan"),
     ["build", "bad.policy.yaml"],
     "bad-hw.yaml: the hardware profile is invalid\n"
     "  - bad-hw.yaml:3:16: h2d_copy_gbps: must be a number, not .nan (finite numbers only)"),
    case("tiny bandwidth", hardware("uva_read_gbps: 50.0", "uva_read_gbps: 1.0e-300"), ["build", "bad.policy.yaml"],
     "bad-hw.yaml:4:16: uva_read_gbps: must be at least 0.001, not 1e-300"),
    case("huge overhead", hardware("layer_overhead_us: 800.0", "layer_overhead_us: 1.0e+300"),
     ["validate", "bad.policy.yaml"],
     "bad-hw.yaml:6:20: layer_overhead_us: must be at most 1000000000, not 1e+300"),
    case("1e3 is text", policy("budget_gib: 1e3\n"), ["build", "bad.policy.yaml"],
     "bad.policy.yaml:3:13: budget_gib: '1e3' is text to YAML 1.1, not a number (a number with an exponent "
     "needs a dot and a signed exponent); write 1000 or 1.0e+3"),
    case("quoted number", policy("budget_gib: '12'\n"), ["build", "bad.policy.yaml"],
     "bad.policy.yaml:3:13: budget_gib: must be a number, not the string '12'; write it without quotes"),
    case("negative offload", policy("uva: {offload_gib: -1}\n"), ["build", "bad.policy.yaml"],
     "bad.policy.yaml:3:20: uva.offload_gib: must be at least 0, not -1"),
    case("negative group_size", policy("prefetch: {group_size: -2}\n"), ["build", "bad.policy.yaml"],
     "bad.policy.yaml:3:24: prefetch.group_size: must be at least 0, not -2"),
    case("negative bytes in a plan", edited_plan("budget_bytes: 16106127", "budget_bytes: -5 #", at="-5"),
         ["show", "bad.plan.yaml"], "bad.plan.yaml:{at}: budget_bytes: must be at least 0, not -5"),
    # An output that is one of the inputs: refused, nothing written.
    case("-o the policy", nothing, ["build", "p.policy.yaml", "-o", "p.policy.yaml"],
     "p.policy.yaml: this is the policy, an input of the plan: writing the plan there would destroy it. "
     "Nothing was written; choose another -o (default: p.plan.yaml)"),
    case("-o ./the policy", nothing, ["build", "p.policy.yaml", "-o", "./p.policy.yaml"],
     "p.policy.yaml: this is the policy, an input of the plan"),
    case("-o a shard", nothing, ["build", "p.policy.yaml", "-o", "ckpt/model-00001-of-00002.safetensors"],
     "ckpt/model-00001-of-00002.safetensors: this is a file of the checkpoint, an input of the plan"),
    case("-o the index", nothing, ["build", "p.policy.yaml", "-o", "ckpt/../ckpt/model.safetensors.index.json"],
     "ckpt/../ckpt/model.safetensors.index.json: this is a file of the checkpoint, an input of the plan"),
    case("-o the hardware profile", policy("budget_gib: 0.018\nhardware: hw.yaml\n"),
     ["build", "bad.policy.yaml", "-o", "hw.yaml"],
     "hw.yaml: this is the hardware profile, an input of the plan: writing the plan there would destroy it. "
     "Nothing was written; choose another -o (default: bad.plan.yaml)"),
    case("-o the routing profile", routing_profile("budget_gib: 0.018\nworkload: {routing: r.yaml}\n"),
         ["build", "bad.policy.yaml", "-o", "r.yaml"],
     "r.yaml: this is the routing profile, an input of the plan: writing the plan there would destroy it. "
     "Nothing was written; choose another -o (default: bad.plan.yaml)"),
    case("-o a directory", nothing, ["build", "p.policy.yaml", "-o", "ckpt"],
     "ckpt: is a directory; -o names the plan file to write (nothing was written)"),
    # Duplicate keys: both lines named.
    case("duplicate top-level key", policy("budget_gib: 1\nbackend: uva\nbudget_gib: 2\n"),
     ["build", "bad.policy.yaml"],
     "bad.policy.yaml: duplicate keys (YAML would keep the last one silently); keep one of each\n"
     "  - bad.policy.yaml:5:1: 'budget_gib' again (first at 3:1)"),
    case("duplicate nested key", policy("prefetch:\n  group_size: 2\n  step: 1\n  group_size: 4\n"),
     ["validate", "bad.policy.yaml"], "bad.policy.yaml:6:3: 'group_size' again (first at 4:3)"),
    case("duplicate in a flow mapping", policy("uva: {offload_gib: 1, offload_gib: 2}\n"),
     ["build", "bad.policy.yaml"], "bad.policy.yaml:3:23: 'offload_gib' again (first at 3:7)"),
    case("duplicate param in a plan",
     edited_plan("  model.norm.weight: gpu\n", "  model.norm.weight: gpu\n  model.norm.weight: uva\n",
                 first="model.norm.weight: gpu", at="model.norm.weight: uva"),
     ["show", "bad.plan.yaml"], "bad.plan.yaml:{at}: 'model.norm.weight' again (first at {first})"),
    # Messages that say what is wrong in the user's terms.
    case("tab", policy("uva:\n\toffload_gib: 1\n"), ["build", "bad.policy.yaml"],
     "bad.policy.yaml:4:1: a tab in the indentation: YAML indents with spaces only; replace the tab with spaces"),
    case("tab in a list", policy("stacks:\n  - model.layers\n\t- x\n"), ["build", "bad.policy.yaml"],
     "bad.policy.yaml:5:1: a tab in the indentation"),
    case("rule without place or role", policy("rules:\n  - match: [lm_head]\n"), ["build", "bad.policy.yaml"],
     "bad.policy.yaml:4:5: rules[0]: needs `place` (gpu, uva, prefetch, cpu) or `role` (expert, embedding, dense), "
     "or both"),
    case("rule matching nothing", policy("rules:\n  - {match: [], place: gpu}\n"), ["build", "bad.policy.yaml"],
     "bad.policy.yaml:4:13: rules[0].match: must not be empty"),
    case("~ checkpoint", policy("", head="format_version: 1\ncheckpoint: ~/models/x\n"), ["build", "bad.policy.yaml"],
     "checkpoint: ~/models/x -> {home}/models/x: no such file or directory"),
    case("policy to show", nothing, ["show", "p.policy.yaml"],
     "p.policy.yaml: this is a policy, not a plan: build a plan from it with `plan build p.policy.yaml`"),
    case("policy to check", nothing, ["check", "p.policy.yaml"], "p.policy.yaml: this is a policy, not a plan"),
    case("policy to diff (old)", nothing, ["diff", "p.policy.yaml", "p.plan.yaml"],
     "p.policy.yaml: this is a policy, not a plan"),
    case("policy to diff (new)", nothing, ["diff", "p.plan.yaml", "p.policy.yaml"],
     "p.policy.yaml: this is a policy, not a plan"),
    case("policy to apply", nothing, ["apply", "p.policy.yaml"],
         "p.policy.yaml: this is a policy, not a plan: build a plan from it with `plan build p.policy.yaml`",
         marks=needs_torch),
    case("plan to build", nothing, ["build", "p.plan.yaml"],
     "p.plan.yaml: this is a plan, not a policy: its policy is p.policy.yaml"),
    case("hardware profile to build", nothing, ["build", "hw.yaml"],
     "hw.yaml: this is a hardware profile, not a policy: name it in a policy: `hardware: hw.yaml`"),
    case("policy as hardware profile", policy("budget_gib: 0.018\nhardware: p.policy.yaml\n"),
     ["build", "bad.policy.yaml"],
     "p.policy.yaml: this is a policy, not a hardware profile: build a plan from it with `plan build p.policy.yaml`"),
    case("policy to profile", nothing, ["profile", "p.policy.yaml", "-o", "r.yaml"],
         "p.policy.yaml: this is a policy; plan profile takes a checkpoint or a plan: profile its checkpoint: "
         "plan profile ckpt -o PROFILE", marks=needs_torch),
    case("policy with a list for checkpoint to profile", policy("checkpoint: [a]\n", head="format_version: 1\n"),
         ["profile", "bad.policy.yaml", "-o", "r.yaml"],
         "bad.policy.yaml: this is a policy; plan profile takes a checkpoint or a plan: profile its checkpoint: "
         "plan profile CHECKPOINT -o PROFILE", marks=needs_torch),
    case("header-only checkpoint to profile", nothing, ["profile", "ckpt", "-o", "r.yaml"],
         "ckpt: the checkpoint holds no weights: the data of its shards are holes in sparse files", marks=needs_torch),
    case("missing checkpoint to profile", nothing, ["profile", "nope", "-o", "r.yaml"],
         "nope: no such checkpoint or plan", marks=needs_torch),
    case("policy as routing profile", policy("budget_gib: 0.018\nworkload: {routing: p.policy.yaml}\n"),
         ["build", "bad.policy.yaml"],
         "p.policy.yaml: this is a policy, not a routing profile: build a plan from it with `plan build p.policy.yaml`"),
    case("missing routing profile", policy("budget_gib: 0.018\nworkload:\n  routing: r.yaml\n"),
         ["build", "bad.policy.yaml"],
         "bad.policy.yaml:5:12: workload.routing: no such file r.yaml (record one with `plan profile ckpt -o r.yaml`; "
         "the path is relative to the policy file)"),
    case("routing profile of another model", routing_profile("budget_gib: 0.018\nworkload: {routing: r.yaml}\n"),
         ["build", "bad.policy.yaml"],
         "bad.policy.yaml:4:21: workload.routing: r.yaml does not fit the checkpoint ckpt (a profile of another "
         "model?); record one of this checkpoint: plan profile ckpt -o r.yaml\n"
         "  - model.layers.0.mlp.experts: the profile counts this layer, which is no MoE layer of the checkpoint"),
    case("--max-new-tokens abc", nothing, ["apply", "p.plan.yaml", "--max-new-tokens", "abc"],
     "argument --max-new-tokens: must be a whole number, not 'abc' (see `plan apply --help`)"),
    case("--max-new-tokens 0", nothing, ["apply", "p.plan.yaml", "--max-new-tokens", "0"],
     "argument --max-new-tokens: must be at least 1, not 0"),
    case("--batch under the prompts", nothing, ["apply", "p.plan.yaml", "--prompt", "a", "--prompt", "b", "--batch", "1"],
         "--batch 1: fewer sequences than the 2 prompts given; give --batch 2 or more, or fewer prompts",
         marks=needs_torch),
    case("empty prompt", nothing, ["apply", "p.plan.yaml", "--prompt", ""],
         "--prompt: an empty prompt; give each prompt one or more characters", marks=needs_torch),
    case("--batch 0", nothing, ["apply", "p.plan.yaml", "--batch", "0"], "argument --batch: must be at least 1, not 0"),
    # Invented in the same spirit.
    case("empty policy", write("empty.yaml", b""), ["build", "empty.yaml"],
     "empty.yaml: a policy is a YAML mapping but the file is empty; start with `format_version: 1` and "
     "`checkpoint: DIR`"),
    case("comments only", write("c.yaml", b"# nothing yet\n"), ["validate", "c.yaml"],
     "c.yaml: a policy is a YAML mapping but the file is empty"),
    case("empty plan", write("empty.plan.yaml", b""), ["show", "empty.plan.yaml"],
     "empty.plan.yaml: not an offplan plan (no `params:` mapping); build one with `plan build POLICY`"),
    case("a list for a policy", write("l.yaml", b"- format_version: 1\n"), ["build", "l.yaml"],
     "l.yaml: a policy is a YAML mapping but it holds a list"),
    case("binary garbage", write("bin.yaml", bytes(range(256))), ["build", "bin.yaml"],
     "bin.yaml: not a text file (byte 0x80 at offset 128 is not UTF-8); a policy is YAML text"),
    case("NUL byte", write("nul.yaml", HEAD.encode() + b"backend: a\x00b\n"), ["build", "nul.yaml"],
     "nul.yaml:3:11: invalid YAML: character U+0000 is not allowed (a control character: is this a text file?)"),
    case("two documents", policy("---\nbackend: uva\n"), ["build", "bad.policy.yaml"],
     "bad.policy.yaml:3:1: invalid YAML: but found another document"),
    case("python tag", policy("backend: !!python/object/apply:os.system [ls]\n"), ["build", "bad.policy.yaml"],
     "bad.policy.yaml:3:10: invalid YAML: could not determine a constructor for the tag"),
    case("unhashable key", policy("? [a, b]\n: 1\n"), ["build", "bad.policy.yaml"],
     "bad.policy.yaml:3:3: invalid YAML: found unhashable key"),
    case("directory as policy", nothing, ["build", "ckpt"], "ckpt: is a directory, not a policy file"),
    case("directory as plan", nothing, ["show", "ckpt"], "ckpt: is a directory, not a plan file"),
    case("unreadable (a socket)", socket_file, ["build", "sock.yaml"],
     "sock.yaml: cannot read the policy: No such device or address"),
    case("missing policy", nothing, ["validate", "nope.yaml"], "nope.yaml: no such policy or plan file"),
    case("wrong type: checkpoint", policy("", head="format_version: 1\ncheckpoint: 5\n"), ["build", "bad.policy.yaml"],
     "bad.policy.yaml:2:13: checkpoint: must be a string, not 5"),
    case("wrong type: null", policy("", head="format_version: 1\ncheckpoint:\n"), ["build", "bad.policy.yaml"],
     "bad.policy.yaml:2:12: checkpoint: must be a string, not null"),
    case("wrong type: stacks", policy("stacks: model.layers\n"), ["build", "bad.policy.yaml"],
     "bad.policy.yaml:3:9: stacks: must be a list, not 'model.layers'"),
    case("wrong type: rules", policy("rules: {match: x}\n"), ["build", "bad.policy.yaml"],
     "bad.policy.yaml:3:8: rules: must be a list, not a mapping"),
    case("wrong type: bool", policy("uva: {offload_gib: yes}\n"), ["build", "bad.policy.yaml"],
     "bad.policy.yaml:3:20: uva.offload_gib: must be a number, not true"),
    case("wrong type: format_version", policy("", head="format_version: '1'\ncheckpoint: ./ckpt\n"),
     ["build", "bad.policy.yaml"], "bad.policy.yaml:1:17: format_version: must be 1, not '1'"),
    case("integer key", policy("1: x\n"), ["build", "bad.policy.yaml"],
     "bad.policy.yaml:3:1: 1: unknown key (allowed: format_version"),
    case("FP8 with per-tensor scales", fp8_checkpoint(()), ["build", "bad.policy.yaml"],
         "fp8: quantized tensors offplan cannot load\n  - model.layers.0.self_attn.q_proj.weight: F8_E4M3 [256, 128] "
         "with scales model.layers.0.self_attn.q_proj.weight_scale_inv [], which are not its 128 x 128 block scales "
         "(those would be [2, 1]; the block is config.json's quantization_config.weight_block_size, default 128 x "
         "128): only block-scaled FP8 is supported: use the model's block-scaled FP8 release, or its bf16 one"),
    case("checkpoint is a plan file", policy("", head="format_version: 1\ncheckpoint: p.plan.yaml\n"),
     ["build", "bad.policy.yaml"],
     "p.plan.yaml: not a safetensors checkpoint (expected a directory, a .safetensors file or a "
     "model.safetensors.index.json)"),
    case("checkpoint is the policy", policy("", head="format_version: 1\ncheckpoint: bad.policy.yaml\n"),
     ["build", "bad.policy.yaml", "-o", "-"], "bad.policy.yaml: not a safetensors checkpoint"),
    case("plan params as a list", edited_plan("params:\n", "params: [x]\nold_params:\n", at="[x]"),
         ["show", "bad.plan.yaml"], "bad.plan.yaml:{at}: params: must be a mapping, not a list"),
    case("plan with a policy's key", edited_plan("backend: uva\n", "backend: uva\nbudget_gib: 3\n", at="budget_gib: 3"),
         ["validate", "bad.plan.yaml"], "bad.plan.yaml:{at}: budget_gib: unknown key; did you mean 'budget_bytes'?"),
    case("unknown placement in a plan", edited_plan("  model.norm.weight: gpu", "  model.norm.weight: disk", at="disk"),
         ["show", "bad.plan.yaml"],
         "bad.plan.yaml:{at}: params.model.norm.weight: 'disk' is not one of gpu, uva, prefetch, cpu"),
    # The prefill fields of a policy, and its plan's staging section edited by hand.
    case("prompt_tokens 0", policy("workload: {prompt_tokens: 0}\n"), ["build", "bad.policy.yaml"],
         "bad.policy.yaml: the policy is invalid\n"
         "  - bad.policy.yaml:3:27: workload.prompt_tokens: must be at least 1, not 0"),
    case("huge prompt_tokens", policy("workload:\n  prompt_tokens: 2097152\n"), ["validate", "bad.policy.yaml"],
         "bad.policy.yaml:4:18: workload.prompt_tokens: must be at most 1048576, not 2097152"),
    case("new_tokens as text", policy("workload: {new_tokens: many}\n"), ["build", "bad.policy.yaml"],
         "bad.policy.yaml:3:24: workload.new_tokens: must be a whole number, not 'many'"),
    case("new_tokens a fraction", policy("workload: {new_tokens: 2.5}\n"), ["build", "bad.policy.yaml"],
         "bad.policy.yaml:3:24: workload.new_tokens: must be a whole number, not 2.5"),
    case("stage_prefill as text", policy("uva:\n  stage_prefill: 'off'\n"), ["build", "bad.policy.yaml"],
         "bad.policy.yaml:4:18: uva.stage_prefill: must be true or false, not 'off'"),
    case("stage_prefill misspelled", policy("uva: {stage_prefil: false}\n"), ["build", "bad.policy.yaml"],
         "bad.policy.yaml:3:7: uva.stage_prefil: unknown key; did you mean 'stage_prefill'?"),
    case("a staged layer dropped", edited_plan("    - {layer: model.layers.3, module: model.layers.3, bytes: 3145728}\n",
                                               "", at="- {layer: model.layers.0"),
         ["show", "bad.plan.yaml"],
         "bad.plan.yaml:{at}: prefill.layers: lists model.layers.0, model.layers.1, model.layers.2 but the layers of "
         "params: with uva tensors that prefill stages (not embeddings, routed experts or MTP layers) are "
         "model.layers.0, model.layers.1, model.layers.2, model.layers.3"),
    case("a staged layer's bytes", edited_plan("module: model.layers.2, bytes: 3145728}", "module: model.layers.2, "
                                               "bytes: 3145984}", at="3145984"),
         ["validate", "bad.plan.yaml"],
         "bad.plan.yaml:{at}: prefill.layers[2].bytes is 3145984 but the staged tensors of model.layers.2 take "
         "3145728 (each rounded up to 256 bytes)"),
    case("staging slots", edited_plan("prefill:\n  above_tokens: 192\n  slots: 2\n",
                                      "prefill:\n  above_tokens: 192\n  slots: 1\n", at="1\n  slot_bytes"),
         ["diff", "p.plan.yaml", "bad.plan.yaml"],
         "bad.plan.yaml:{at}: prefill.slots is 1 but 4 staged layers with bytes in a slot give 2 (at most 2)"),
    case("staging pool left out of the summary", edited_plan("  stage_buffer_bytes: 6291456\n", "",
                                                             at="gpu_bytes: 9437184"),
         ["show", "bad.plan.yaml"],
         "bad.plan.yaml:{at}: summary.stage_buffer_bytes is 0 but the prefill section sizes the pool at 6291456"),
    case("staging threshold 0", edited_plan("  above_tokens: 192\n", "  above_tokens: 0\n", at="0\n  slots"),
         ["show", "bad.plan.yaml"],
         "bad.plan.yaml:{at}: prefill.above_tokens: must be at least 1, not 0"),
]


@pytest.mark.parametrize("setup, argv, message", CORPUS)
def test_bad_input_is_one_message_exit_1_and_writes_nothing(work, capsys, monkeypatch, setup, argv, message):
    monkeypatch.setenv("HOME", str(work / "home"))
    spots = setup(work) or {}
    before = snapshot(work)
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert (code, out) == (1, "")
    assert err.startswith("error: ") and err.count("error:") == 1
    assert "Traceback" not in err and "warning:" not in err
    assert message.format(home=work / "home", **spots) in err
    assert snapshot(work) == before


def test_the_corpus_covers_every_command_that_reads_a_file():
    assert {c.values[1][0] for c in CORPUS} == {"build", "show", "check", "diff", "validate", "apply", "profile"}


# ---------------------------------------------------------------- beyond the corpus
