"""A long forward's experts staged a chunk at a time (runtime/execute/grouped.py), on the CPU: outputs bitwise those
of the whole forward (and so of transformers' grouped_mm), in bf16 and block-scaled FP8, and the plan's prefill
working memory is one chunk's rows as the runtime counts them. The chunk is made small here (CHUNK_BYTES patched)
so that these tiny models' forwards run in several."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from planner.decide import working  # noqa: E402
from planner.planfile import load_plan  # noqa: E402
from runtime.execute import experts, grouped  # noqa: E402
from runtime.hf import from_pretrained  # noqa: E402
from quantized_models import write_fp8  # noqa: E402
from tiny_models import make_plan, qwen3_moe_config, reference, save_model  # noqa: E402

CONFIG = dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2)
PLANS = {"split": "rules:\n  - {match: ['re:experts\\.[0246]\\.'], place: uva}\n",
         "uva": "rules:\n  - {match: [experts], place: uva}\n",
         "gpu": ""}
TOKENS = 12  # 2 sequences x 12 tokens x top-2: 48 pairs, above BATCHED_PAIRS: grouped_mm's arithmetic


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("chunks")
    bf16 = save_model(qwen3_moe_config(**CONFIG), root / "bf16")
    return {"bf16": bf16, "fp8": write_fp8(bf16, root / "fp8", block=16)}


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


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
@pytest.mark.parametrize("plan", list(PLANS))
def test_chunked_forwards_equal_the_whole_one_bitwise(tmp_path, checkpoints, kind, plan, monkeypatch):
    if kind == "bf16" and plan == "gpu":
        pytest.skip("bf16 experts all in HBM run transformers' own implementation: nothing is staged")
    model, handle = from_pretrained(make_plan(tmp_path, checkpoints[kind], PLANS[plan]), progress=False, device="cpu")
    try:
        whole = logits(model)
        module = model.get_submodule("model.layers.0.mlp.experts")
        one = grouped.expert_bytes(module, experts.fused_params(module))
        monkeypatch.setattr(working, "CHUNK_BYTES", 3 * one)  # 3 experts a chunk: 8 slots in 3 chunks
        seen = counted(monkeypatch)
        assert torch.equal(logits(model), whole)
        assert seen == [3] * CONFIG["num_hidden_layers"], seen
    finally:
        handle.remove(restore=False)
    if kind == "bf16":  # and so transformers' grouped_mm's, which the whole forward reproduces (test_experts.py)
        ref = reference(checkpoints[kind])
        ref.set_experts_implementation("grouped_mm")
        assert torch.equal(whole, logits(ref))


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
    """CHUNK_BYTES (1 GiB) holds every tiny expert; one token's pairs run batched_mm's arithmetic, never chunked."""
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
