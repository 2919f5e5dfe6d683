"""Prefill staging on CUDA (marked `gpu`): exact against all-GPU, eagerly, under torch.compile, and with a
decode step captured in a CUDA graph that stays zero-copy. Run on the H100: pytest -m gpu -v."""
from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch._inductor.config as inductor_config  # noqa: E402

from planner.inputs.hardware import H100, dumps_hardware  # noqa: E402
from runtime.hf import from_pretrained  # noqa: E402
from tiny_models import check_ring, make_plan, reference, save_models  # noqa: E402

pytestmark = pytest.mark.gpu

ABOVE = 8  # a [2, 9] prompt (18 tokens) is staged, a decode step of 2 tokens is not
POLICIES = {
    "uva": "backend: uva\nuva: {offload_gib: 100}",
    "uva+prefetch": "rules:\n  - {match: [self_attn], place: uva}\n"
                    "prefetch: {group_size: 2, num_in_group: 1, step: 2, params: [mlp]}",
    "mixed": "backend: mixed\nbudget_gib: {budget}\nprefetch: {step: 2}\nworkload: {cuda_graphs: false}",
    # routed experts streamed through the ring too (the llama has none): all, and experts 0 and 2 (1 and 3 on
    # the GPU, gathered from HBM)
    "uva+experts": "backend: uva\nuva: {offload_gib: 100, stage_experts: true}",
    "split experts": "uva: {stage_experts: true}\nrules:\n  - {match: [self_attn], place: uva}\n"
                     "  - {match: ['re:experts\\.[02]\\.'], place: uva}\n",
}
# budgets under which mixed, weighing eager steps' launches, puts dense tensors on uva (the MoE's experts go first,
# through the ring; the budget holds their working memory too: 208,000 bytes at the least)
MIXED_BUDGET_GIB = {"llama": 0.0003, "moe": 0.0002}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return save_models(tmp_path_factory.mktemp("models"), "llama", "moe")


def plan_with(tmp_path, checkpoint, body: str):
    hw = tmp_path / "hw.yaml"
    hw.write_text(dumps_hardware(dataclasses.replace(H100, stage_above_tokens=ABOVE)))
    return make_plan(tmp_path, checkpoint, f"hardware: {hw}\n{body}")


@pytest.mark.parametrize("kind, policy", [(k, p) for p in POLICIES for k in ("llama", "moe")
                                          if k == "moe" or p != "split experts"])  # the llama has no experts
def test_staged_prefill_and_in_place_decode_equal_all_gpu(tmp_path, checkpoints, kind, policy):
    plan = plan_with(tmp_path, checkpoints[kind], POLICIES[policy].replace("{budget}", str(MIXED_BUDGET_GIB[kind])))
    model, handle = from_pretrained(plan, progress=False)
    ref = reference(checkpoints[kind], "cuda")
    torch.manual_seed(5)
    prompt = torch.randint(0, 256, (2, 9), device="cuda")
    try:
        assert handle.prefill is not None, "the policy puts dense tensors on uva: the plan stages them"
        filled = check_ring(handle) if handle.plan.prefill.experts else []  # each fill's rows against the parameters
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(model(prompt).logits, ref(prompt).logits)
            staged = handle.stats().prefill_staged_layers
            assert staged == 2 * len(handle.plan.prefill.layers)
            ring = handle.prefill.ring
            if handle.plan.prefill.experts:  # every unit filled in both forwards, every chunk consumed, the ring freed
                assert filled == list(range(len(handle.prefill.ring_modules))) * 2
                assert ring.buffer is None and ring.consumed == len(ring.chunks) > 0
            out = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
            want = ref.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert out.tolist() == want.tolist()
        assert handle.stats().prefill_staged_layers == staged + len(handle.plan.prefill.layers)  # the prefill only
    finally:
        handle.remove(restore=False)


@pytest.mark.parametrize("kind, policy", [("llama", "uva"), ("moe", "uva"), ("moe", "split experts")])
def test_compiled_staged_prefill_has_no_graph_break_and_is_exact(tmp_path, checkpoints, kind, policy):
    plan = plan_with(tmp_path, checkpoints[kind], POLICIES[policy])
    model, handle = from_pretrained(plan, progress=False)
    torch.manual_seed(1)
    prefill, step = torch.randint(0, 256, (2, 9), device="cuda"), torch.randint(0, 256, (2, 1), device="cuda")
    try:
        with torch.no_grad():
            eager = {x.shape[1]: model(x).logits for x in (prefill, step)}
            explained = torch._dynamo.explain(model)(prefill)
            assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
            torch._dynamo.reset()
            staged = handle.stats().prefill_staged_layers
            with inductor_config.patch(emulate_precision_casts=True):
                compiled = torch.compile(model, dynamic=False)  # one graph per shape, as a server would warm up
                for _ in range(2):
                    for x in (prefill, step, prefill):
                        assert torch.equal(compiled(x).logits, eager[x.shape[1]]), x.shape
            # four compiled prefills staged every layer, the two decode steps none
            assert handle.stats().prefill_staged_layers - staged == 4 * len(handle.plan.prefill.layers)
    finally:
        torch._dynamo.reset()
        handle.remove(restore=False)


def test_captured_decode_step_stays_zero_copy(tmp_path, checkpoints):
    from transformers import StaticCache
    plan = plan_with(tmp_path, checkpoints["llama"], POLICIES["uva"])
    model, handle = from_pretrained(plan, progress=False)
    cfg = model.config
    graph_cache, eager_cache = StaticCache(config=cfg, max_cache_len=64), StaticCache(config=cfg, max_cache_len=64)
    torch.manual_seed(7)
    prompt = torch.randint(0, 256, (1, 12), device="cuda")  # 12 tokens: staged
    pos = torch.arange(12, device="cuda")
    try:
        with torch.no_grad():
            for cache in (graph_cache, eager_cache):
                model(prompt, past_key_values=cache, cache_position=pos)
            static_ids = torch.zeros(1, 1, dtype=torch.long, device="cuda")
            static_pos = torch.tensor([12], device="cuda")
            staged = handle.stats().prefill_staged_layers
            graph, static_logits = handle.capture(
                lambda: model(static_ids, past_key_values=graph_cache, cache_position=static_pos).logits)
            assert handle.stats().prefill_staged_layers == staged  # warm-up and capture staged nothing
            graph_cache.reset()
            model(prompt, past_key_values=graph_cache, cache_position=pos)
            for i in range(20):
                token = torch.randint(0, 256, (1, 1), device="cuda")
                static_ids.copy_(token)
                static_pos.fill_(12 + i)
                graph.replay()
                want = model(token, past_key_values=eager_cache, cache_position=torch.tensor([12 + i], device="cuda"))
                torch.cuda.synchronize()
                assert torch.equal(static_logits, want.logits), i
    finally:
        handle.remove(restore=False)
