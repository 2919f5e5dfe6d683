"""Recording routing on tiny real transformers MoE models (CPU), and `plan profile` end to end."""
from __future__ import annotations

import os
import re
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from offplan.cli import main  # noqa: E402
from planner.decide.build import build_file  # noqa: E402
from planner.errors import OffplanError  # noqa: E402
from planner.inputs.checkpoint import open_checkpoint  # noqa: E402
from planner.inputs.routing import load_profile  # noqa: E402
from runtime.measure.routing import RoutingRecorder, checkpoint_groups, record_routing  # noqa: E402
from tiny_models import make_plan, qwen3_moe_config, reference, save_model  # noqa: E402

LAYERS = [f"model.layers.{i}.mlp.experts" for i in range(4)]  # tiny Qwen3-MoE: 4 layers of 4 experts, top-2


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return save_model(qwen3_moe_config(), tmp_path_factory.mktemp("models") / "moe")


@pytest.fixture(scope="module")
def model(moe):
    return reference(moe)


def test_the_recorder_counts_every_routed_token_per_phase_and_changes_nothing(model):
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        plain = model(ids).logits
        recorder = RoutingRecorder(model)
        prefill = model(ids).logits
        step = model(ids[:, :1]).logits  # one token per sequence: a decode step
        recorder.remove()
        model(ids)  # after remove(): counted nowhere
    assert torch.equal(prefill, plain)
    assert torch.equal(step, model(ids[:, :1]).logits)
    assert recorder.tokens == {"decode": 2, "prefill": 18}
    hits = recorder.hits()
    assert list(hits) == LAYERS
    assert {layer: (sum(h["decode"]), sum(h["prefill"]), len(h["decode"])) for layer, h in hits.items()} == {
        layer: (2 * 2, 18 * 2, 4) for layer in LAYERS}  # tokens x top-k, per layer per phase


def test_record_routing_runs_greedy_generation_one_prompt_at_a_time(model, moe):
    fp = open_checkpoint(moe).fingerprint
    prompts = [torch.arange(n) + 3 for n in (5, 7, 9)]
    with torch.no_grad():
        before = [model.generate(p[None], max_new_tokens=4, do_sample=False) for p in prompts]
    profile = record_routing(model, prompts, 4, checkpoint_fingerprint=fp, source="three prompts")
    assert (profile.prefill_tokens, profile.decode_tokens) == (21, 3 * 3)  # 4 new tokens: 1 from the prefill
    assert (profile.sequences, profile.new_tokens, profile.top_k, profile.prompts) == (3, 4, 2, "three prompts")
    assert profile.checkpoint_fingerprint == fp
    assert {k: (sum(h.decode), sum(h.prefill)) for k, h in profile.layers.items()} == {
        layer: (9 * 2, 21 * 2) for layer in LAYERS}
    with torch.no_grad():
        after = [model.generate(p[None], max_new_tokens=4, do_sample=False) for p in prompts]
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # the hooks are gone, nothing changed


def test_record_routing_refuses_prompts_it_cannot_count(model):
    with pytest.raises(OffplanError, match="prompt 2 has 1 token"):
        record_routing(model, [torch.arange(4), torch.arange(1)], 4, checkpoint_fingerprint="x")
    with pytest.raises(OffplanError, match="new_tokens is 1: the first new token comes from the prefill"):
        record_routing(model, [torch.arange(4)], 1, checkpoint_fingerprint="x")


def test_a_dense_model_has_no_routing_to_record(tmp_path):
    from tiny_models import llama_config
    dense = reference(save_model(llama_config(num_hidden_layers=1), tmp_path / "llama"))
    with pytest.raises(OffplanError, match="LlamaForCausalLM has no experts module"):
        RoutingRecorder(dense)


def test_mixtral_layers_are_keyed_by_the_checkpoint_names(tmp_path):
    from transformers import MixtralConfig
    ckpt = save_model(MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                    num_experts_per_tok=2, max_position_embeddings=128), tmp_path / "mixtral")
    m = reference(ckpt)
    keys = checkpoint_groups(m, open_checkpoint(ckpt))
    assert keys == {f"model.layers.{i}.mlp.experts": f"model.layers.{i}.block_sparse_moe.experts" for i in range(2)}
    profile = record_routing(m, [torch.arange(6)], 3, checkpoint_fingerprint="x", keys=keys)
    assert list(profile.layers) == [f"model.layers.{i}.block_sparse_moe.experts" for i in range(2)]


# ---------------------------------------------------------------- plan profile

def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_profile_end_to_end(moe, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(capsys, "profile", str(moe), "-o", "r.yaml", "--random-prompts", "3", "--prompt-len", "5",
                       "--new-tokens", "4", "--device", "cpu")
    assert code == 0
    lines = out.splitlines()
    assert re.fullmatch(r"wrote r\.yaml: 4 MoE layers, 15 prefill and 9 decode tokens from 3 prompts \(random "
                        r"token ids, 5 each, seed 0\) on cpu; each layer's most-hit expert \(of 4\) takes "
                        r"\d+\.\d% of decode hits \(25\.0% if uniform\)", lines[0]), lines[0]
    assert lines[1:] == ["note: the prompts are random token ids (seed 0): routing on random input is not your "
                         "workload's; record with --prompts FILE for a real one"]
    profile = load_profile(tmp_path / "r.yaml")
    assert (profile.checkpoint_fingerprint, profile.checkpoint_path) == (open_checkpoint(moe).fingerprint,
                                                                       os.path.relpath(moe, tmp_path))
    assert list(profile.layers) == LAYERS
    # the policy names it: the plan records it, says how skewed it is, and is current
    (tmp_path / "m.policy.yaml").write_text(f"format_version: 1\ncheckpoint: {moe}\nbackend: mixed\n"
                                            "budget_gib: 0.0005\nworkload: {routing: r.yaml}\n")
    plan, _ = build_file(tmp_path / "m.policy.yaml")
    assert plan.routing.path == "r.yaml"
    assert any(n.startswith("routing from the profile r.yaml (workload.routing): 9 decode tokens of 3 prompts")
               for n in plan.notes)
    assert run(capsys, "build", "m.policy.yaml")[0] == 0
    assert run(capsys, "check", "m.plan.yaml")[0] == 0


def test_plan_profile_of_a_plan_with_a_tokenizer(moe, tmp_path, capsys, monkeypatch):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    monkeypatch.chdir(tmp_path)
    ckpt = shutil.copytree(moe, tmp_path / "ckpt")
    words = ["[UNK]", "the", "capital", "of", "france", "is", "a", "cat", "sat", "on", "mat"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(ckpt)
    (tmp_path / "prompts.txt").write_text("the capital of france is\n\nthe cat sat on a mat\n")
    plan = make_plan(tmp_path, ckpt, "prefetch: {group_size: 2, num_in_group: 1, step: 1}")
    code, out, err = run(capsys, "profile", str(plan), "-o", "r.yaml", "--prompts", "prompts.txt", "--new-tokens",
                         "3", "--json")
    assert code == 0, err
    data = __import__("json").loads(out)
    assert {k: data[k] for k in ("profile", "layers", "prompts", "sequences", "tokens", "top_k")} == {
        "profile": "r.yaml", "layers": 4, "prompts": "prompts.txt", "sequences": 2,
        "tokens": {"prefill": 5 + 6, "decode": 2 * 2}, "top_k": 2}
    assert load_profile(tmp_path / "r.yaml").checkpoint_fingerprint == open_checkpoint(ckpt).fingerprint
    (tmp_path / "one.txt").write_text("the capital\nfrance\n")
    code, out, err = run(capsys, "profile", str(plan), "-o", "one.yaml", "--prompts", "one.txt")
    assert (code, out, err) == (1, "", "error: one.txt:2: the prompt is a single token; a prompt needs two or more, "
                                       "or its prefill cannot be told from a decode step\n")


def snapshot(directory) -> dict:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(directory.rglob("*"))}


@pytest.mark.parametrize("argv, message", [
    (["--prompts", "prompts.txt"], "prompts.txt: the checkpoint {moe} has no tokenizer (tokenizer.json, "
                                   "tokenizer_config.json, tokenizer.model are missing) to tokenize the prompts with; "
                                   "use --random-prompts N instead"),
    (["--prompts", "nope.txt"], "nope.txt: no such prompts file"),
    (["--prompts", "empty.txt"], "empty.txt: no prompts in it (one prompt per line)"),
    (["--prompts", "prompts.txt", "--random-prompts", "2"], "--prompts reads prompts from a file; --random-prompts "
                                                            "and --prompt-len make random ones: give one or the other"),
    (["-o", "sub"], "sub: is a directory; -o names the profile file to write (nothing was written)"),
    (["-o", "nowhere/r.yaml"], "nowhere/r.yaml: no such directory nowhere (nothing was written)"),
    (["-o", "{moe}/config.json"], "{moe}/config.json: this is a file of the checkpoint, an input of the profile: "
                                  "writing the profile there would destroy it. Nothing was written; choose another -o"),
    (["-o", "prompts.txt"], "prompts.txt: exists and is not a routing profile (its first line is not the `# offplan "
                            "routing profile ...` line offplan writes)"),
    (["--new-tokens", "1"], "argument --new-tokens: must be at least 2, not 1 (see `plan profile --help`)"),
    (["--device", "cuda"], "--device cuda: no CUDA device here (leave --device out to use the CPU)")
    if not torch.cuda.is_available() else (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
])
def test_bad_input_is_one_error_and_writes_nothing(moe, tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.txt").write_text("the capital of france is\n")
    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "sub").mkdir()
    argv = [a.format(moe=moe) for a in argv]
    before = snapshot(tmp_path), snapshot(moe)
    code, out, err = run(capsys, "profile", str(moe), *(["-o", "r.yaml"] if "-o" not in argv else []), *argv)
    assert (code, out) == (1, "")
    assert err.startswith("error: ") and err.count("error:") == 1 and "Traceback" not in err
    assert message.format(moe=moe) in err
    assert (snapshot(tmp_path), snapshot(moe)) == before
