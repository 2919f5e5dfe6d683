"""Prefill staging (planner/decide/staging.py): which layers the plan stages, the pool in the footprint, the plan
file's `prefill:` section, and the checks a hand edit of it meets."""
from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest
import yaml

from headeronly import infos, plan_of, policy, write_policy
from offplan.cli import main
from planner.decide.build import build
from planner.decide.placement import decide
from planner.errors import PlanFileError
from planner.inputs.checkpoint import open_checkpoint
from planner.inputs.hardware import H100, dumps_hardware
from planner.inputs.policy import Workload, load_policy
from planner.inputs.schema import schema
from planner.layers.graph import build_graph
from planner.plan import PrefillStaging, StagedLayer
from planner.planfile import dumps, loads
from planner.units import ms
from synthetic import deepseek_v3, llama, qwen3_moe, write_header_only


def small_llama():
    # per layer (BF16): q, o 64 x 64 (8 KiB each); k, v 32 x 64 (4 KiB each); 2 norms of 64 (128 B);
    # gate, up 128 x 64 and down 64 x 128 (16 KiB each); embedding and head 256 x 64 (32 KiB each)
    return llama(layers=4, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=256)


def small_qwen3_moe():
    # per layer (BF16): q, o 64 x 64 (8 KiB each); k, v 32 x 64 (4 KiB each); norms of 64 (128 B) and of the
    # head dim 16 (32 B); the router 4 x 64 (512 B); 4 experts of gate, up 32 x 64 and down 64 x 32 (4 KiB each)
    return qwen3_moe(layers=2, experts=4, hidden=64, moe_intermediate=32, heads=4, kv_heads=2, head_dim=16, vocab=128)


def test_llama_stages_each_uva_layer_and_the_head_never_the_embedding():
    d, _ = plan_of(small_llama(), policy(rules=[(["layers.0", "embed_tokens", "lm_head"], "uva"),
                                                (["re:layers\\.2\\.mlp"], "uva")]))
    # layer 0 whole: 8192 + 4096 + 4096 + 8192 + 3 x 16384, and its 2 norms of 128 B rounded up to 256;
    # layer 2's MLP: 3 x 16384; the head 32768; the embedding (a lookup of rows) stays out
    assert d.prefill == PrefillStaging(H100.stage_above_tokens, 2, 74240, (StagedLayer("model.layers.0", "model.layers.0", 74240),
                                                       StagedLayer("model.layers.2", "model.layers.2", 49152),
                                                       StagedLayer("lm_head", "lm_head", 32768)))
    assert d.summary.stage_buffer_bytes == 2 * 74240
    assert d.summary.gpu_footprint_bytes == d.summary.gpu_bytes + 2 * 74240


def test_qwen3_moe_streams_routed_experts_through_the_ring_when_the_prompt_touches_them():
    d, _ = plan_of(small_qwen3_moe(), policy(rules=[(["layers.0", "embed_tokens", "lm_head"], "uva"),
                                                    (["re:layers\\.1\\.mlp\\.experts\\.[0-2]\\."], "uva")],
                                             stage_experts=True))
    # A prompt of 512 tokens (the default workload) touches every expert. Layer 0's slot: input and
    # post-attention norms (128 B) and q_norm, k_norm (32 B), each rounded up to 256, q and o 2 x 8192, k and v
    # 2 x 4096, the router 512: 26112; its 4 experts (4 x 3 x 4096 = 49152) go through the ring. Layer 1 holds
    # only experts on uva, 3 of its 4 (36864): nothing in a slot. The head: 16384. The ring holds the larger
    # layer's host experts, 49152, and costs no footprint: the pool is the slots'
    assert d.prefill == PrefillStaging(H100.stage_above_tokens, 2, 26112, (
        StagedLayer("model.layers.0", "model.layers.0", 26112), StagedLayer("model.layers.1", "model.layers.1", 0),
        StagedLayer("lm_head", "lm_head", 16384)), ring_bytes=49152)
    assert d.summary.stage_buffer_bytes == 2 * 26112


def test_short_prompts_stage_no_routed_expert():
    pol = dataclasses.replace(policy(rules=[(["layers.0", "embed_tokens", "lm_head"], "uva"),
                                            (["re:layers\\.1\\.mlp\\.experts"], "uva")]),
                              workload=Workload(1, prompt_tokens=H100.stage_above_tokens))
    d, _ = plan_of(small_qwen3_moe(), pol)
    # a prompt at the threshold stages nothing: the experts are read in place, after the router picks them.
    # Layer 0 less its experts: 26112; layer 1 holds only experts on uva: not staged; the head: 16384
    assert d.prefill == PrefillStaging(H100.stage_above_tokens, 2, 26112, (
        StagedLayer("model.layers.0", "model.layers.0", 26112), StagedLayer("lm_head", "lm_head", 16384)))


def test_experts_are_staged_unless_refused():
    rules = [(["experts", "embed_tokens"], "uva")]
    on, _ = plan_of(small_qwen3_moe(), policy(rules=rules, stage_experts=True))
    assert on.prefill == PrefillStaging(H100.stage_above_tokens, 0, 0, (
        StagedLayer("model.layers.0", "model.layers.0", 0), StagedLayer("model.layers.1", "model.layers.1", 0)),
        ring_bytes=49152)
    assert on.summary.stage_buffer_bytes == 0
    off, _ = plan_of(small_qwen3_moe(), policy(rules=rules, stage_experts=False))
    assert (off.prefill, off.summary.stage_buffer_bytes, off.params) == (None, 0, on.params)
    assert on.cost.prefill_us <= off.cost.prefill_us  # (2 us each: these layers are tiny)
    # unset: the prompt of 512 tokens touches every expert, and the ring costs no footprint: staged, with a
    # budget or without
    auto, _ = plan_of(small_qwen3_moe(), policy(rules=rules))
    assert (auto.prefill, auto.params) == (on.prefill, on.params)
    d, _ = plan_of(small_qwen3_moe(), policy(rules=rules, budget_gib=(on.summary.gpu_footprint_bytes + 1) / 2**30))
    assert (d.prefill, d.params) == (on.prefill, on.params)


def test_stage_prefill_false_plans_no_staging_and_no_pool():
    on, _ = plan_of(small_llama(), policy(rules=[(["layers.0"], "uva")]))
    off, _ = plan_of(small_llama(), policy(rules=[(["layers.0"], "uva")], stage_prefill=False))
    assert on.prefill == PrefillStaging(H100.stage_above_tokens, 1, 74240, (StagedLayer("model.layers.0", "model.layers.0", 74240),))
    assert (off.prefill, off.summary.stage_buffer_bytes) == (None, 0)
    assert on.summary.gpu_footprint_bytes - off.summary.gpu_footprint_bytes == 74240
    assert on.params == off.params


def test_the_threshold_is_the_hardware_profiles():
    t = infos(small_llama())
    d = decide(build_graph(t), t, policy(rules=[(["layers.1"], "uva")]),
               dataclasses.replace(H100, stage_above_tokens=1024))
    assert d.prefill.above_tokens == 1024


def test_a_budget_counts_the_pool(tmp_path):
    """The budget walk pays for the slots: the plan fits budget_gib with its pool, and at a byte less the
    error quotes a footprint that includes it."""
    t = small_llama()
    total = sum(i.nbytes for i in infos(t).values())
    d, _ = plan_of(t, policy(budget_gib=(total - 100_000) / 2**30))
    assert d.summary.gpu_footprint_bytes <= total - 100_000
    assert d.summary.stage_buffer_bytes == d.prefill.pool_bytes > 0
    assert d.summary.gpu_footprint_bytes == d.summary.gpu_bytes + d.prefill.pool_bytes


# ---------------------------------------------------------------- the plan file

@pytest.fixture
def staged(tmp_path):
    """A Llama-shaped header-only checkpoint at tmp_path/ckpt and the plan of a policy staging layers 0-1."""
    write_header_only(tmp_path / "ckpt", small_llama(), single=True)
    pol = load_policy(write_policy(tmp_path, "rules:\n  - match: ['re:layers\\.[01]\\.']\n    place: uva\n"))
    plan = build(pol, tmp_path)
    return plan, dumps(plan), open_checkpoint(tmp_path / "ckpt").tensors


def test_the_prefill_section_on_file_round_trips(staged):
    plan, text, _ = staged
    assert (f"prefill:\n  above_tokens: {H100.stage_above_tokens}\n  slots: 2\n  slot_bytes: 74240\n  layers:\n"
            "    - {layer: model.layers.0, module: model.layers.0, bytes: 74240}\n"
            "    - {layer: model.layers.1, module: model.layers.1, bytes: 74240}\nparams:\n") in text
    assert "  prefetch_buffer_bytes: 0\n  stage_buffer_bytes: 148480\n  gpu_footprint_bytes: " in text
    assert f", prompt_tokens: 512, prefill_us: {plan.cost.prefill_us}}}\n" in text
    assert loads(text) == plan and dumps(loads(text)) == text
    jsonschema.validate(yaml.safe_load(text), schema("plan.schema.json"))


def test_a_plan_without_staging_or_a_prefill_prediction_still_round_trips(staged):
    """Plans written before staging lack `prefill:`, `stage_buffer_bytes` and the cost's prefill fields."""
    plan, text, _ = staged
    text = text[:text.index("built:\n")] + text[text.index("checkpoint:\n"):]  # nor a stamp, which came later
    old = text[:text.index("prefill:\n")] + text[text.index("params:\n"):]
    old = old.replace("  stage_buffer_bytes: 148480\n", "").replace(
        f", prompt_tokens: 512, prefill_us: {plan.cost.prefill_us}}}", "}")
    old = old.replace(f"gpu_footprint_bytes: {plan.summary.gpu_footprint_bytes}",
                      f"gpu_footprint_bytes: {plan.summary.gpu_footprint_bytes - 148480}")
    got = loads(old)
    assert (got.prefill, got.summary.stage_buffer_bytes, got.cost.prompt_tokens, got.cost.prefill_us) == (None, 0, 0, 0)
    assert dumps(got) == old


def test_staged_experts_on_file_round_trip_and_a_hand_edit_is_caught(tmp_path):
    write_header_only(tmp_path / "ckpt", small_qwen3_moe(), single=True)
    text = "uva:\n  stage_experts: true\nrules:\n  - match: [experts]\n    place: uva\n"
    plan = build(load_policy(write_policy(tmp_path, text)), tmp_path)
    text = dumps(plan)
    assert (f"prefill:\n  above_tokens: {H100.stage_above_tokens}\n  slots: 0\n  slot_bytes: 0\n  ring_bytes: 49152\n"
            "  layers:\n    - {layer: model.layers.0, module: model.layers.0, bytes: 0}\n") in text
    assert loads(text) == plan and dumps(loads(text)) == text
    jsonschema.validate(yaml.safe_load(text), schema("plan.schema.json"))
    with pytest.raises(PlanFileError) as e:  # without the flag, layers holding only experts stage nothing
        loads(edit(text, "  ring_bytes: 49152\n", ""))
    assert any("prefill.layers: lists model.layers.0, model.layers.1 but the layers of params: with uva tensors "
               "that prefill stages (not embeddings, routed experts or MTP layers) are none" in p
               for p in e.value.problems)
    with pytest.raises(PlanFileError) as e:  # the checkpoint's sizes give the ring
        loads(edit(text, "  ring_bytes: 49152\n", "  ring_bytes: 36864\n"), tensors=open_checkpoint(tmp_path / "ckpt").tensors)
    assert any("prefill.ring_bytes is 36864 but the staged layers' routed experts on uva or cpu give 49152" in p
               for p in e.value.problems)


def edit(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


def line(text: str, needle: str) -> int:
    return text[:text.index(needle)].count("\n") + 1


@pytest.mark.parametrize("old, new, at, problem, exact", [
    ("{layer: model.layers.1, module: model.layers.1,", "{layer: model.layers.1, module: model.layers,",
     ("{layer: model.layers.1", 7), "prefill.layers[1]: model.layers.1 runs in module model.layers.1, not "
     "model.layers", False),
    ("  slot_bytes: 74240\n", "  slot_bytes: 74496\n", ("74496", 15),
     "prefill.slot_bytes is 74496 but the largest staged layer is 74240", False),
    # by names alone: 9 tensors rounded up to 256 take 73984 (the row's uva bytes) to 73984 + 9 x 255
    ("module: model.layers.1, bytes: 74240}", "module: model.layers.1, bytes: 76800}", ("76800", 1),
     "prefill.layers[1].bytes is 76800 but the 9 staged tensors of model.layers.1 (73984 bytes on uva in its row) "
     "take a multiple of 256 from 73984 to 76279", False),
    ("module: model.layers.1, bytes: 74240}", "module: model.layers.1, bytes: 74496}", ("74496}", 1),
     "prefill.layers[1].bytes is 74496 but the staged tensors of model.layers.1 take 74240 (each rounded up to "
     "256 bytes)", True),
])
def test_a_hand_edited_prefill_section_is_refused(staged, old, new, at, problem, exact):
    _, text, tensors = staged
    bad = edit(text, old, new)
    with pytest.raises(PlanFileError) as e:
        loads(bad, "p.plan.yaml", tensors if exact else None)
    column = at[1] if at[1] > 1 else bad.splitlines()[line(bad, at[0]) - 1].index(at[0]) + 1
    assert f"p.plan.yaml:{line(bad, at[0])}:{column}: {problem}" in e.value.problems


def test_a_staged_layer_that_holds_no_stageable_uva_tensor_is_refused(staged):
    _, text, _ = staged
    bad = edit(edit(text, "  model.layers.1.mlp.down_proj.weight: uva\n", "  model.layers.1.mlp.down_proj.weight: gpu\n"),
               "  model.layers.1.mlp.gate_proj.weight: uva\n", "  model.layers.1.mlp.gate_proj.weight: gpu\n")
    # everything else of layer 1 back on the GPU too (its row and the staging left as they were)
    for n in ("input_layernorm", "post_attention_layernorm", "mlp.up_proj", "self_attn.q_proj", "self_attn.k_proj",
              "self_attn.v_proj", "self_attn.o_proj"):
        bad = edit(bad, f"  model.layers.1.{n}.weight: uva\n", f"  model.layers.1.{n}.weight: gpu\n")
    with pytest.raises(PlanFileError) as e:
        loads(bad, "p.plan.yaml")
    assert (f"p.plan.yaml:{line(bad, '- {layer: model.layers.0')}:5: prefill.layers: lists model.layers.0, "
            "model.layers.1 but the layers of params: with uva tensors that prefill stages (not embeddings, routed "
            "experts or MTP layers) are model.layers.0") in e.value.problems


def test_an_mtp_layer_on_uva_is_never_staged_and_the_check_knows_it_from_the_rows(tmp_path):
    tensors = deepseek_v3(layers=4, dense_layers=1, hidden=64, intermediate=128, experts=4, moe_intermediate=32,
                          heads=2, q_lora=32, kv_lora=16, nope=8, rope=8, v_head=8, vocab=256)
    write_header_only(tmp_path / "ckpt", tensors, single=True)
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "num_nextn_predict_layers": 1,
                                                               "num_experts_per_tok": 2}))
    pol = load_policy(write_policy(tmp_path, "rules:\n  - match: [layers.4, layers.0]\n    place: uva\n"))
    plan = build(pol, tmp_path)
    assert [l.layer for l in plan.prefill.layers] == ["model.layers.0"]  # not the MTP layer 4
    assert plan.layers[5].runs.value == "mtp" and plan.layers[5].uva > 0
    text = dumps(plan)
    assert loads(text, "p.plan.yaml", open_checkpoint(tmp_path / "ckpt").tensors) == plan


# ---------------------------------------------------------------- plan show and plan diff

def test_show_and_diff_report_the_staging_and_the_prefill(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write_header_only(tmp_path / "ckpt", small_llama(), single=True)
    (tmp_path / "hw.yaml").write_text(dumps_hardware(dataclasses.replace(H100, layer_overhead_us=1.0)))  # not launches
    rule = "hardware: hw.yaml\nrules:\n  - match: ['re:layers\\.[01]\\.']\n    place: uva\n"  # 2 x 74240 staged
    write_policy(tmp_path, rule, name="on.policy.yaml")
    write_policy(tmp_path, rule + "uva: {stage_prefill: false}\nworkload: {prompt_tokens: 1024}\n", name="off.policy.yaml")
    on, off = (build(load_policy(tmp_path / f"{name}.policy.yaml"), tmp_path) for name in ("on", "off"))
    assert main(["build", "on.policy.yaml"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        "wrote on.plan.yaml: 39 tensors, backend none; GPU 353.6 KiB (145.0 KiB of it prefill staging buffers), "
        f"host 144.5 KiB; predicted step {ms(on.summary.predicted_step_us)}, prefill of 512 tokens "
        f"{ms(on.cost.prefill_us)}")
    assert main(["build", "off.policy.yaml"]) == 0 == len(capsys.readouterr().err) and main(["show", "on.plan.yaml"]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = lines.index("prefill staging: 2 layers copy their uva tensors through 2 slots x 72.5 KiB = 145.0 KiB of "
                     f"GPU buffers when a forward carries more than {H100.stage_above_tokens} tokens")
    assert lines[at + 1:at + 3] == [
        "GPU footprint: 208.6 KiB resident + 145.0 KiB prefill staging buffers = 353.6 KiB (no budget set)",
        "host (pinned): 144.5 KiB uva; offloading costs 512 B of GPU memory: the buffers and working memory above "
        "take more than it moves off the GPU"]
    assert lines[at + 3].endswith(f"; time to first token (prefill of 512 tokens) {on.cost.prefill_us / 1e3:.3f} ms")
    assert main(["show", "on.plan.yaml", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["prefill"] == {"above_tokens": H100.stage_above_tokens, "slots": 2, "slot_bytes": 74240,
                               "ring_bytes": None, "layers": ["model.layers.0", "model.layers.1"]}
    assert (data["summary"]["stage_buffer_bytes"], data["cost"]["prompt_tokens"], data["cost"]["prefill_us"]) == (
        148480, 512, on.cost.prefill_us)
    assert main(["diff", "on.plan.yaml", "off.plan.yaml"]) == 0
    pre = off.cost.prefill_us - on.cost.prefill_us
    assert capsys.readouterr().out.splitlines()[1:6] == [
        "prompt tokens: 512 -> 1024",
        "GPU footprint: 353.6 KiB -> 208.6 KiB (-145.0 KiB)",
        f"predicted step: {ms(on.summary.predicted_step_us)} (unchanged)",
        f"predicted prefill: {ms(on.cost.prefill_us)} -> {ms(off.cost.prefill_us)} (+{ms(pre)}, "
        f"{pre / on.cost.prefill_us:+.1%})",
        "prefill staging: gone: the old plan staged 2 layers (model.layers.0, model.layers.1) through 2 slots x "
        f"72.5 KiB above {H100.stage_above_tokens} tokens"]
    assert main(["diff", "on.plan.yaml", "off.plan.yaml", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["prefill"], d["staging_changed"], d["summary"]["stage_buffer_bytes"]) == (
        {"removed": {"above_tokens": H100.stage_above_tokens, "slots": 2, "slot_bytes": 74240, "ring_bytes": 0,
                     "layers": ["model.layers.0", "model.layers.1"]}}, True, -148480)
    assert d["predicted_prefill_us"] == {"old": on.cost.prefill_us, "new": off.cost.prefill_us}
    assert main(["diff", "off.plan.yaml", "on.plan.yaml"]) == 0  # the other way, the prefill shortens
    assert f"prefill: {ms(off.cost.prefill_us)} -> {ms(on.cost.prefill_us)} (-{ms(pre)}, " in capsys.readouterr().out


def test_diff_names_what_changed_within_the_staging(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write_header_only(tmp_path / "ckpt", small_llama(), single=True)
    write_policy(tmp_path, "rules:\n  - match: ['re:layers\\.[01]\\.']\n    place: uva\n", name="a.policy.yaml")
    write_policy(tmp_path, "rules:\n  - match: ['re:layers\\.[12]\\.', 're:layers\\.3\\.mlp']\n    place: uva\n",
                 name="b.policy.yaml")
    assert main(["build", "a.policy.yaml"]) == main(["build", "b.policy.yaml"]) == 0
    capsys.readouterr()
    assert main(["diff", "a.plan.yaml", "b.plan.yaml"]) == 0
    assert ("prefill staging: stages model.layers.2, model.layers.3 too; no longer stages model.layers.0\n"
            in capsys.readouterr().out)
