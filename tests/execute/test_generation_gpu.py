"""The runtime's generation on CUDA (marked `gpu`): each decode step replayed from a CUDA graph gives transformers'
own greedy tokens (plain model, same static cache), for uva, prefetch and mixed plans, one prompt length or
several; the captured step is kept and replayed by later calls."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytestmark = pytest.mark.gpu

from runtime.hf import from_pretrained  # noqa: E402
from test_generation import PLANS  # noqa: E402
from tiny_models import make_plan, save_models, transformers_greedy  # noqa: E402


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return save_models(tmp_path_factory.mktemp("gen-gpu"), "llama", "moe")


@pytest.mark.parametrize("kind", ["llama", "moe"])
@pytest.mark.parametrize("strategy", sorted(PLANS))
def test_replayed_greedy_tokens_equal_transformers_generate(tmp_path, checkpoints, kind, strategy):
    model, handle = from_pretrained(make_plan(tmp_path, checkpoints[kind], PLANS[strategy]), progress=False)
    try:
        same = [[5, 17, 99, 3, 41, 7], [8, 8, 200, 31, 2, 6]]
        got = handle.generate(torch.tensor(same), 12)
        assert got.mode == "graph" and got.decode_steps == 11
        assert got.tokens == transformers_greedy(checkpoints[kind], same, 12, model, device="cuda")
        generator = handle.generators[(False, False)]
        (step,) = generator.steps.values()
        graph = step.graph
        again = handle.generate(torch.tensor(same), 12)
        assert again.tokens == got.tokens
        assert list(generator.steps.values())[0].graph is graph  # replayed, not captured again
        ragged = [[5, 17, 99, 3, 41, 7], [9, 250, 4]]
        assert handle.generate(ragged, 10).tokens == transformers_greedy(checkpoints[kind], ragged, 10, model,
                                                                        device="cuda")
        assert handle.generate(ragged, 10, eager=True).tokens == handle.generate(ragged, 10).tokens
    finally:
        handle.remove()
