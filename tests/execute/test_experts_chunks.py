"""A long forward's experts staged a chunk at a time (runtime/execute/grouped.py), on the CPU: outputs bitwise those
of the whole forward (and so of transformers' grouped_mm), in bf16, block-scaled FP8 and MXFP4, with biases and
transposed experts (gpt-oss), with the host's experts merged in; and the plan's prefill working memory is one
chunk's rows as the runtime counts them. The chunk is made small here (CHUNK_BYTES patched) so that these tiny
models' forwards run in several."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import dataclasses  # noqa: E402

from planner.decide import working  # noqa: E402
from planner.inputs.hardware import H100, dumps_hardware  # noqa: E402
from planner.planfile import load_plan  # noqa: E402
from runtime.execute import experts, grouped  # noqa: E402
from runtime.hf import from_pretrained  # noqa: E402
from quantized_models import write_fp8, write_mxfp4  # noqa: E402
from tiny_models import gpt_oss_config, make_plan, qwen3_moe_config, reference, save_family, save_model  # noqa: E402

CONFIG = dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2)
PLANS = {"split": "rules:\n  - {match: ['re:experts\\.[0246]\\.'], place: uva}\n",
         "uva": "rules:\n  - {match: [experts], place: uva}\n",
         "gpu": ""}
TOKENS = 12  # 2 sequences x 12 tokens x top-2: 48 pairs, above BATCHED_PAIRS: grouped_mm's arithmetic


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("chunks")
    bf16 = save_model(qwen3_moe_config(**CONFIG), root / "bf16")
    oss = save_family(gpt_oss_config(num_hidden_layers=2, num_local_experts=8), root / "oss")  # [E, H, 2I], biases
    return {"bf16": bf16, "fp8": write_fp8(bf16, root / "fp8", block=16), "oss": oss,
            "oss-mxfp4": write_mxfp4(oss, root / "oss-mxfp4")}


def logits(model, seed: int = 7):
    torch.manual_seed(seed)
    with torch.no_grad():
        return model(torch.randint(0, 256, (2, TOKENS))).logits


def counted(monkeypatch) -> list[int]:
    """The chunk sizes of the chunked forwards that run (experts.chunked_pairs, wrapped)."""
    seen, real = [], grouped.chunked_pairs

    def spy(*args, **kw):
        seen.append(args[7])  # chunk
        return real(*args, **kw)
    monkeypatch.setattr(experts, "chunked_pairs", spy)
    return seen


# (checkpoint, plan): bf16 experts all in HBM run transformers' own implementation, staging nothing; gpt-oss's
# experts are stored fused (no expert of their own to split)
CASES = [("bf16", "split"), ("bf16", "uva"), ("fp8", "split"), ("fp8", "uva"), ("fp8", "gpu"), ("oss", "uva"),
         ("oss-mxfp4", "uva"), ("oss-mxfp4", "gpu")]


@pytest.mark.parametrize("per", [1, 3])  # experts a chunk (a random router may send every pair to a few)
@pytest.mark.parametrize("kind, plan", CASES)
def test_chunked_forwards_equal_the_whole_one_bitwise(tmp_path, checkpoints, kind, plan, per, monkeypatch):
    model, handle = from_pretrained(make_plan(tmp_path, checkpoints[kind], PLANS[plan]), progress=False, device="cpu")
    try:
        whole = logits(model)
        module = model.get_submodule("model.layers.0.mlp.experts")
        one = grouped.expert_bytes(module, experts.fused_params(module))
        monkeypatch.setattr(working, "CHUNK_BYTES", per * one)  # 8 slots in 8 chunks, or in 3
        seen = counted(monkeypatch)
        assert torch.equal(logits(model), whole)
        assert seen == [per] * model.config.num_hidden_layers, seen
    finally:
        handle.remove(restore=False)
    if kind == "bf16":  # and so transformers' grouped_mm's, which the whole forward reproduces (test_experts.py)
        ref = reference(checkpoints[kind])
        ref.set_experts_implementation("grouped_mm")
        assert torch.equal(whole, logits(ref))


def test_the_hosts_experts_merge_into_a_chunked_forward(tmp_path, checkpoints, monkeypatch):
    """Experts on cpu (computed by the host for a forward of at most the profile's 64 tokens): their slots are
    staged with the chunk but never read, and the host's outputs replace theirs, as in the whole forward."""
    (tmp_path / "hw.yaml").write_text(dumps_hardware(dataclasses.replace(H100, cpu_threads=1, stage_above_tokens=64)))
    body = "hardware: hw.yaml\nrules:\n  - {match: ['re:experts\\.[0246]\\.'], place: cpu}\n"
    model, handle = from_pretrained(make_plan(tmp_path, checkpoints["bf16"], body), progress=False, device="cpu")
    try:
        whole = logits(model)
        module = model.get_submodule("model.layers.0.mlp.experts")
        monkeypatch.setattr(working, "CHUNK_BYTES", 3 * grouped.expert_bytes(module, experts.fused_params(module)))
        seen, calls = counted(monkeypatch), handle.host_experts.host_calls
        assert torch.equal(logits(model), whole)
        assert seen == [3, 3] and handle.host_experts.host_calls == calls + 2  # each layer: chunked, host merged
    finally:
        handle.remove(restore=False)


def test_an_expert_larger_than_a_chunk_is_staged_alone(tmp_path, checkpoints, monkeypatch):
    plan = make_plan(tmp_path, checkpoints["bf16"], PLANS["uva"])
    model, handle = from_pretrained(plan, progress=False, device="cpu")
    try:
        whole = logits(model)
        monkeypatch.setattr(working, "CHUNK_BYTES", 1)
        seen = counted(monkeypatch)
        assert torch.equal(logits(model), whole) and seen == [1, 1]
    finally:
        handle.remove(restore=False)


def test_no_chunk_where_the_rows_fit_or_the_pairs_are_few(tmp_path, checkpoints, monkeypatch):
    """CHUNK_BYTES holds every tiny expert; a forward of at most BATCHED_PAIRS pairs runs batched_mm's arithmetic,
    never chunked."""
    model, handle = from_pretrained(make_plan(tmp_path, checkpoints["fp8"], PLANS["uva"]), progress=False, device="cpu")
    try:
        seen = counted(monkeypatch)
        logits(model)
        monkeypatch.setattr(working, "CHUNK_BYTES", 1)
        with torch.no_grad():
            model(torch.tensor([[1, 2]]))  # a prompt of 2 tokens: 4 pairs
        assert seen == []
    finally:
        handle.remove(restore=False)


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_the_plan_counts_one_chunk_of_the_rows_the_runtime_stages(tmp_path, checkpoints, kind, monkeypatch):
    """The plan's prefill working memory (a 512-token prompt touches every expert) is `experts_per_chunk` experts'
    rows, each counted from the headers as the runtime counts its module's (grouped.expert_bytes)."""
    body = PLANS["uva"] + "uva: {stage_prefill: false}\n"  # not staged: a staged layer holds every expert
    plan = make_plan(tmp_path, checkpoints[kind], body, name="whole")
    model, handle = from_pretrained(plan, progress=False, device="cpu")
    try:
        module = model.get_submodule("model.layers.0.mlp.experts")
        one = grouped.expert_bytes(module, experts.fused_params(module))
    finally:
        handle.remove(restore=False)
    whole = load_plan(tmp_path / "whole.plan.yaml").summary.working_prefill_bytes
    assert whole == CONFIG["num_experts"] * one
    monkeypatch.setattr(working, "CHUNK_BYTES", 3 * one)
    chunked = load_plan(make_plan(tmp_path, checkpoints[kind], body, name="chunked")).summary
    assert chunked.working_prefill_bytes == 3 * one
