"""Experts on cpu on CUDA (marked `gpu`): the host computes its experts beside the GPU (its worker thread, while
the GPU computes its own); the tokens are transformers' greedy ones and the logits within the tolerance of
test_host_experts.py. Not captured in CUDA graphs yet: generation runs eagerly, and a capture is refused."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytestmark = pytest.mark.gpu

from runtime.hf import from_pretrained  # noqa: E402
from test_generation import transformers_greedy  # noqa: E402
from test_host_experts import LOUD, SPLIT, TOLERANCE, hardware, logits  # noqa: E402
from tiny_models import make_plan, qwen3_moe_config, reference, save_model  # noqa: E402


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return save_model(qwen3_moe_config(num_hidden_layers=3, **LOUD), tmp_path_factory.mktemp("qwen") / "m")


@pytest.mark.parametrize("batch, tokens", [(1, 1), (2, 4)])
def test_eager_forwards_take_the_hosts_outputs(tmp_path, qwen, batch, tokens, monkeypatch):
    model, handle = from_pretrained(make_plan(tmp_path, qwen, SPLIT + hardware(tmp_path)), progress=False)
    try:
        engine = handle.host_experts
        ref = reference(qwen, "cuda")
        ref.set_experts_implementation("batched_mm" if batch * tokens * 2 <= 16 else "grouped_mm")
        calls = engine.host_calls
        x = logits(model, tokens, batch)
        assert engine.host_calls == calls + 3
        theirs = logits(ref, tokens, batch)
        torch.testing.assert_close(x, theirs, **TOLERANCE)
        monkeypatch.setattr(engine, "_compute", lambda *a: None)
        assert not torch.allclose(logits(model, tokens, batch), theirs, **TOLERANCE)
    finally:
        handle.remove()


def test_generation_runs_eagerly_and_gives_transformers_tokens(tmp_path, qwen):
    model, handle = from_pretrained(make_plan(tmp_path, qwen, SPLIT + hardware(tmp_path)), progress=False)
    try:
        engine = handle.host_experts
        assert engine.kernel.compiled, engine.kernel.why_eager
        prompts = [[5, 17, 99, 3, 41, 7], [8, 8, 200, 31, 2, 6]]
        calls = engine.host_calls
        got = handle.generate(prompts, 12)
        assert got.mode == "eager"  # not captured: host_experts.py
        assert engine.host_calls > calls and engine.kernel.misses == 0, engine.kernel.last_miss
        assert got.tokens == transformers_greedy(qwen, prompts, 12, model, device="cuda")
        with pytest.raises(RuntimeError, match="experts on cpu runs eagerly: its steps are not captured"):
            handle.capture(lambda: model(torch.tensor([[5]], device="cuda")))
    finally:
        handle.remove()
