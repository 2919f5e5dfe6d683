"""Experts on cpu on CUDA (marked `gpu`): the host computes its experts beside the GPU (native.cpp, or the engine's
worker, while the GPU computes its own), eagerly and in replayed CUDA graphs; the logits are transformers' within the tolerance
of test_host_experts.py, and so are the greedy tokens up to near ties; replayed and eager generation agree token
for token (the same kernels on both sides).

On CUDA the host's GEMVs and cuBLAS's sum in different orders, so a pair's output may be a unit in the last place
off (on the CPU the two agree bitwise, and the tokens are equal: test_host_experts.py). Greedy decoding turns
that into another token wherever the reference's two best logits are closer than the logits' difference: on the
tiny model below, whose logits spread by 1.6, such near ties (0.03) come within a few steps. The generation test
therefore checks what holds at any margin: fed the same tokens, every step's logits are within the tolerance,
and the generated tokens are the reference's up to the first step whose margin is within twice the tolerance."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytestmark = pytest.mark.gpu

from runtime.hf import from_pretrained  # noqa: E402
from test_host_experts import LOUD, SPLIT, TOLERANCE, fail, hardware, lockstep, logits, path, uses  # noqa: E402, F401
from tiny_models import make_plan, qwen3_moe_config, reference, save_model, transformers_greedy  # noqa: E402


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return save_model(qwen3_moe_config(num_hidden_layers=3, **LOUD), tmp_path_factory.mktemp("qwen") / "m")


@pytest.mark.parametrize("batch, tokens", [(1, 1), (2, 4)])
def test_eager_forwards_take_the_hosts_outputs(tmp_path, qwen, batch, tokens, monkeypatch, path):
    model, handle = from_pretrained(make_plan(tmp_path, qwen, SPLIT + hardware(tmp_path)), progress=False)
    try:
        engine = handle.host_experts
        uses(engine, path)
        ref = reference(qwen, "cuda")
        ref.set_experts_implementation("batched_mm" if batch * tokens * 2 <= 16 else "grouped_mm")
        if path == "native":  # native.cpp's eager jobs are host functions: this thread never runs one
            monkeypatch.setattr(engine, "_hand_over", lambda index, tokens: pytest.fail("ran on the eager thread"))
        calls = engine.host_calls
        x = logits(model, tokens, batch)
        torch.cuda.synchronize()
        assert engine.host_calls == calls + 3
        theirs = logits(ref, tokens, batch)
        torch.testing.assert_close(x, theirs, **TOLERANCE)
        monkeypatch.setattr(engine, "_hand_over", lambda index, tokens: None)  # the host computes nothing
        monkeypatch.setattr(engine, "_enqueue", lambda index, tokens, capturing: None)
        assert not torch.allclose(logits(model, tokens, batch), theirs, **TOLERANCE)
    finally:
        handle.remove()


def test_generation_replays_graphs_and_gives_transformers_tokens_up_to_near_ties(tmp_path, qwen, path):
    model, handle = from_pretrained(make_plan(tmp_path, qwen, SPLIT + hardware(tmp_path)), progress=False)
    try:
        engine = handle.host_experts
        uses(engine, path)
        prompts = [[5, 17, 99, 3, 41, 7], [8, 8, 200, 31, 2, 6]]
        calls = engine.host_calls
        got = handle.generate(prompts, 12)
        assert got.mode == "graph" and engine.host_calls - calls >= 3 * 11  # every replayed step's 3 layers
        assert engine.kernel.misses == 0, engine.kernel.last_miss
        eager = handle.generate(prompts, 12, eager=True)
        assert eager.mode == "eager" and eager.tokens == got.tokens
        want = transformers_greedy(qwen, prompts, 12, model, device="cuda")
        ref = reference(qwen, "cuda")
        ref.set_experts_implementation(model.config._experts_implementation)
        calls = engine.host_calls
        ours, theirs = lockstep(model, ref, prompts, want)  # the prefill (12 tokens: staged) and 11 steps
        assert engine.host_calls - calls == 3 * 11
        torch.testing.assert_close(ours, theirs, **TOLERANCE)
        top = theirs.topk(2, dim=-1).values
        for b, (tokens, wanted) in enumerate(zip(got.tokens, want)):
            near = (top[:, b, 0] - top[:, b, 1] <= 2 * TOLERANCE["atol"]).nonzero().flatten().tolist()
            until = near[0] if near else len(wanted)  # from the first near tie on, either way
            assert tokens[:until] == wanted[:until], (b, near)
    finally:
        handle.remove()


def test_a_failure_on_the_host_is_raised_and_the_replay_does_not_hang(tmp_path, qwen, monkeypatch, path):
    model, handle = from_pretrained(make_plan(tmp_path, qwen, SPLIT + hardware(tmp_path)), progress=False)
    try:
        prompts = [[5, 17, 99, 3]]
        handle.generate(prompts, 4)  # captured while the host works
        engine = handle.host_experts
        for eager in (False, True):  # the prefill's 3 layers pass, the decode steps' fail: replayed, then eagerly
            error = fail(engine, path, monkeypatch)
            with pytest.raises(RuntimeError, match=f"computing experts on the host CPU failed: {error}"):
                handle.generate(prompts, 4, eager=eager)
            monkeypatch.undo()
            torch.cuda.synchronize()
            assert engine.error is None  # the failed call's later failures went with it: the next call's are its own
        assert handle.generate(prompts, 4).mode == "graph"  # the host goes on
    finally:
        handle.remove()


def test_compiled_generation_replays_with_the_host_computing_every_layer(tmp_path, qwen):
    """Under torch.compile the hand-over's custom ops stay opaque to Inductor, so the captured step holds the host
    node as the plain capture does; Inductor's own kernels round otherwise, so the tokens are the reference's up
    to near ties, as above."""
    model, handle = from_pretrained(make_plan(tmp_path, qwen, SPLIT + hardware(tmp_path)), progress=False)
    try:
        engine = handle.host_experts
        prompts = [[5, 17, 99, 3, 41, 7]]
        calls = engine.host_calls
        got = handle.generate(prompts, 12, compile=True)
        assert got.mode == "compiled-graph" and engine.host_calls - calls >= 3 * 11
        want = transformers_greedy(qwen, prompts, 12, model, device="cuda")
        ref = reference(qwen, "cuda")
        ref.set_experts_implementation(model.config._experts_implementation)
        _, theirs = lockstep(model, ref, prompts, want)
        top = theirs.topk(2, dim=-1).values[:, 0]
        near = (top[:, 0] - top[:, 1] <= 2 * TOLERANCE["atol"]).nonzero().flatten().tolist()
        until = near[0] if near else len(want[0])
        assert got.tokens[0][:until] == want[0][:until], near
    finally:
        torch._dynamo.reset()
        handle.remove()
