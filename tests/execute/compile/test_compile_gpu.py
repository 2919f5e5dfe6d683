"""torch.compile and CUDA graphs of offloaded models on CUDA (marked `gpu`). Run: pytest -m gpu -v -s."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch._inductor.config as inductor_config  # noqa: E402

from runtime.hf import from_pretrained  # noqa: E402
from tiny_models import make_plan, save_models  # noqa: E402

pytestmark = pytest.mark.gpu

POLICIES = {
    "prefetch": "prefetch: {group_size: 2, num_in_group: 1, step: 2}",
    "uva": "backend: uva\nuva: {offload_gib: 100}",
    "mixed": "backend: mixed\nbudget_gib: 0.0003\nprefetch: {step: 2}\nworkload: {cuda_graphs: false}",  # experts on uva
    "uva+prefetch": "rules:\n  - {match: [embed_tokens], place: uva}\n  - {match: [self_attn], place: uva}\n"
                    "prefetch: {group_size: 2, num_in_group: 1, step: 2, params: [mlp]}",
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return save_models(tmp_path_factory.mktemp("models"), "llama", "moe")


@pytest.mark.parametrize("kind", ["llama", "moe"])
@pytest.mark.parametrize("policy", ["prefetch", "uva", "mixed"])
def test_compiled_equals_eager_on_cuda(tmp_path, checkpoints, kind, policy):
    plan = make_plan(tmp_path, checkpoints[kind], POLICIES[policy])
    model, handle = from_pretrained(plan, progress=False)
    torch.manual_seed(1)
    x = torch.randint(0, 256, (2, 9), device="cuda")
    try:
        with torch.no_grad():
            eager = model(x).logits
            explained = torch._dynamo.explain(model)(x)
            assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
            torch._dynamo.reset()
            with inductor_config.patch(emulate_precision_casts=True):
                compiled = torch.compile(model)
                for _ in range(3):
                    assert torch.equal(compiled(x).logits, eager)
    finally:
        torch._dynamo.reset()
        handle.remove(restore=False)


@pytest.mark.parametrize("policy", ["prefetch", "uva+prefetch"])
def test_cuda_graph_decode_step_replays_exactly(tmp_path, checkpoints, policy):
    from transformers import StaticCache
    plan = make_plan(tmp_path, checkpoints["llama"], POLICIES[policy])
    model, handle = from_pretrained(plan, progress=False)
    cfg = model.config
    graph_cache, eager_cache = StaticCache(config=cfg, max_cache_len=128), StaticCache(config=cfg, max_cache_len=128)
    torch.manual_seed(2)
    prompt = torch.randint(0, 256, (1, 8), device="cuda")
    with torch.no_grad():
        for cache in (graph_cache, eager_cache):
            model(prompt, past_key_values=cache, cache_position=torch.arange(8, device="cuda"))
            handle.join()
        static_ids = torch.zeros(1, 1, dtype=torch.long, device="cuda")
        static_pos = torch.tensor([8], device="cuda")
        graph, static_logits = handle.capture(
            lambda: model(static_ids, past_key_values=graph_cache, cache_position=static_pos).logits)
        # transformers' StaticCache advances its own position counter on every step: the warm-up
        # moved it, so start the graph's cache over from the same prefill as the eager one.
        graph_cache.reset()
        model(prompt, past_key_values=graph_cache, cache_position=torch.arange(8, device="cuda"))
        handle.join()
        copies = handle.stats().prefetch_copies
        for step in range(100):
            token = torch.randint(0, 256, (1, 1), device="cuda")
            static_ids.copy_(token)
            static_pos.fill_(8 + step)
            graph.replay()
            want = model(token, past_key_values=eager_cache,
                         cache_position=torch.tensor([8 + step], device="cuda")).logits
            handle.join()
            torch.cuda.synchronize()
            assert torch.equal(static_logits, want), step
        # replays ran the captured copies; only the eager steps issued new ones from Python
        assert handle.stats().prefetch_copies - copies == 100 * 2
    handle.remove(restore=False)
