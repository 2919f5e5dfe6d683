"""The runtime's generation (runtime/execute/generation.py) on the CPU: greedy tokens equal transformers' own
`generate` on the same model and prompts, for uva, prefetch and mixed plans, one prompt length or several;
stop tokens, the token callback and seeded sampling; the decode step kept and reused across calls."""
from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from runtime.execute.generation import CACHE_QUANTUM  # noqa: E402
from runtime.hf import from_pretrained  # noqa: E402
from tiny_models import make_plan, save_models, transformers_greedy  # noqa: E402


class _NoHostReads(torch.overrides.TorchFunctionMode):
    """Fails on a tensor's value read on the host (`bool`, `item`, `int`, ...): on CUDA a host sync, which a CUDA
    graph capture refuses (how a padded batch's first replay failed on an H200), so a one-token step has none."""
    READS = {torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.__index__, torch.Tensor.__int__,
             torch.Tensor.__float__, torch.Tensor.tolist}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            raise AssertionError(f"a host read in a one-token step: {func.__name__}")
        return func(*args, **(kwargs or {}))


PLANS = {"uva": "budget_gib: 0.0005\n", "prefetch": "prefetch: {group_size: 2, step: 1}\n",
         "mixed": "backend: mixed\nbudget_gib: 0.0005\n"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return save_models(tmp_path_factory.mktemp("gen"), "llama", "moe")


@pytest.mark.parametrize("kind", ["llama", "moe"])
@pytest.mark.parametrize("strategy", sorted(PLANS))
def test_greedy_tokens_equal_transformers_generate(tmp_path, checkpoints, kind, strategy):
    plan = make_plan(tmp_path, checkpoints[kind], PLANS[strategy])
    model, handle = from_pretrained(plan, progress=False)
    try:
        same = [[5, 17, 99, 3, 41, 7], [8, 8, 200, 31, 2, 6]]
        got = handle.generate(torch.tensor(same), 12)
        assert got.tokens == transformers_greedy(checkpoints[kind], same, 12, model)
        assert (got.mode, got.prompt_tokens, got.decode_steps, len(got.tokens[0])) == ("eager", 6, 11, 12)
        assert got.ttft_s > 0 and got.decode_tokens_per_s > 0
        ragged = [[5, 17, 99, 3, 41, 7], [9, 250, 4]]  # left-padded, the pads masked
        assert handle.generate(ragged, 10).tokens == transformers_greedy(checkpoints[kind], ragged, 10, model)
    finally:
        handle.remove()


def test_stop_tokens_the_callback_and_reuse(tmp_path, checkpoints):
    model, handle = from_pretrained(make_plan(tmp_path, checkpoints["moe"], PLANS["uva"]), progress=False)
    try:
        prompts = [[5, 17, 99, 3], [8, 8, 200, 31]]
        handle.generator().prepare(prompts, 16)  # the step of this shape made ahead: the calls below reuse it
        full = handle.generate(prompts, 16).tokens
        stop = full[0][4]  # the fifth token of the first sequence
        seen = []
        got = handle.generate(prompts, 16, stop=[stop], on_token=lambda i, tokens: seen.append((i, tokens)))
        first = full[0].index(stop) + 1
        second = full[1].index(stop) + 1 if stop in full[1] else 16
        assert got.tokens == [full[0][:first], full[1][:second]]
        steps = max(first, second)  # the loop ends when every sequence has stopped
        assert seen == [(i, [full[0][i], full[1][i]]) for i in range(steps)]
        assert list(handle.generators[(False, False)].steps) == [(2, CACHE_QUANTUM, False)]  # one step, reused
    finally:
        handle.remove()
    assert handle.generators == {}


def test_sampling_is_seeded_and_follows_top_k(tmp_path, checkpoints):
    model, handle = from_pretrained(make_plan(tmp_path, checkpoints["llama"], PLANS["prefetch"]), progress=False)
    try:
        prompts = torch.tensor([[5, 17, 99, 3]])
        a = handle.generate(prompts, 8, do_sample=True, temperature=0.7, seed=3).tokens
        assert handle.generate(prompts, 8, do_sample=True, temperature=0.7, seed=3).tokens == a
        assert handle.generate(prompts, 8, do_sample=True, top_k=1).tokens == handle.generate(prompts, 8).tokens
    finally:
        handle.remove()


def test_bad_calls_are_refused(tmp_path, checkpoints):
    model, handle = from_pretrained(make_plan(tmp_path, checkpoints["llama"], PLANS["uva"]), progress=False)
    try:
        for call, message in [(lambda: handle.generate([[1, 2]], 0), "max_new_tokens must be at least 1"),
                              (lambda: handle.generate([], 4), "one or more prompts"),
                              (lambda: handle.generate(torch.tensor([1, 2]), 4), r"a \[batch, tokens\] tensor"),
                              (lambda: handle.generate([[1]], 4, do_sample=True, temperature=0), "above 0")]:
            with pytest.raises(ValueError, match=message):
                call()
    finally:
        handle.remove()


def test_the_prefill_runs_the_head_on_the_last_position_only(tmp_path, checkpoints):
    """A long prompt's logits at every position would take GBs (generation.py): the head sees one row a sequence,
    in the prefill as in each step, and the tokens are transformers' own."""
    model, handle = from_pretrained(make_plan(tmp_path, checkpoints["llama"], PLANS["uva"]), progress=False)
    rows = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: rows.append(tuple(args[0].shape[:2])))
    try:
        prompts = [[5, 17, 99, 3, 41, 7, 12, 80], [8, 8, 200, 31, 2, 6, 1, 9]]
        got = handle.generate(prompts, 4)
        assert len(rows) >= 4 and set(rows) == {(2, 1)}  # the prefill's and each step's (not (2, 8))
        assert got.tokens == transformers_greedy(checkpoints["llama"], prompts, 4, model)
    finally:
        hook.remove()
        handle.remove()


@pytest.mark.parametrize("sliding", [None, 3])
def test_the_capturable_eager_mask_is_transformers_eager_mask_bitwise(sliding):
    """tokens.py's eager mask (a 0 filled on the device, so that a CUDA graph can capture it: gpt-oss) against
    transformers' own, causal or sliding, with a padded row, over a static cache longer than the tokens."""
    from transformers.masking_utils import causal_mask_function, eager_mask, sliding_window_causal_mask_function
    from runtime.execute.tokens import _eager_mask
    pads = torch.tensor([[1] * 12, [0, 0, 0] + [1] * 9]).bool()  # as create_causal_mask passes it
    rule = causal_mask_function if sliding is None else sliding_window_causal_mask_function(sliding)
    for q, offset in ((6, 0), (1, 8)):  # a prefill, then a decode step at position 8 of a cache of 12
        kw = dict(batch_size=2, q_length=q, kv_length=12, q_offset=offset, mask_function=rule, attention_mask=pads,
                  dtype=torch.bfloat16, device="cpu")
        want, got = eager_mask(**kw), _eager_mask(**kw)
        assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape == (2, 1, q, 12)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_a_replay_is_refused_padded_prompts_past_a_sliding_window_or_a_sliding_layer_of_another_kind():
    """tokens.py `replayable`: a cache past a sliding window is replayable for prompts of one length; for prompts of
    several lengths (a padding mask, which transformers lines up with a rolled window in Python) it is refused
    before a capture, naming what to do (a length that fits, where a multiple of the cache quantum does); so is a
    sliding layer of a kind it does not make replayable (a subclass may keep other counts in Python)."""
    from transformers import AutoConfig, StaticCache
    from runtime.execute.tokens import replayable
    from tiny_models import gpt_oss_config
    with pytest.raises(ValueError, match=r"GptOss: its sliding-window attention keeps 8 tokens, .* holds 128 .*"
                                         r"several lengths.*give prompts of one length, or generate eagerly "
                                         r"\(`eager=True`, `plan apply --eager`\)$"):
        replayable(StaticCache(config=gpt_oss_config(), max_cache_len=128), 128, "GptOss", masked=True)
    with pytest.raises(ValueError, match=r"keeps 200 tokens, .* holds 256 .*, or keep the prompt and new tokens "
                                         r"within 128$"):
        replayable(StaticCache(config=gpt_oss_config(sliding_window=200), max_cache_len=256), 256, "GptOss", True)
    replayable(StaticCache(config=gpt_oss_config(), max_cache_len=128), 128, "GptOss")  # one length: past it
    replayable(StaticCache(config=gpt_oss_config(), max_cache_len=8), 8, "GptOss", masked=True)  # within it
    hybrid = AutoConfig.for_model("zaya", num_hidden_layers=2, layer_types=["hybrid_sliding", "hybrid"],
                                  sliding_window=128)  # transformers' LinearAttentionAndStaticSlidingWindow... layer
    with pytest.raises(ValueError, match=r"Zaya: its sliding-window attention caches in transformers' "
                                         r"LinearAttentionAndStaticSlidingWindowAttentionLayer, .* generate eagerly"):
        replayable(StaticCache(config=hybrid, max_cache_len=128), 128, "Zaya")


@pytest.mark.parametrize("family", ["gpt_oss", "gemma2", "gemma3_text", "llama4_text"])
def test_a_replayable_sliding_layer_steps_past_its_window_from_its_device_count_alone(family):
    """tokens.py `_replayed_sliding_layer`: one-token steps past the window (8) write, roll and mask from the count
    on the device, so a replay, which runs no Python, steps right: with the layers' Python count set wrong before
    every step (as a replay leaves it: at its prefill's length, below or past the window), gpt-oss (eager
    attention, sinks), Gemma 2 and 3 (sdpa) and Llama 4 (chunks of 8 in the same layer class) give transformers' own
    logits bitwise, after a prompt shorter than the window and one longer, a batch of two, 14 steps; the cached
    keys and values are transformers' too. Then a prompt after the steps (its count first set from the device's)
    continues as transformers' does."""
    from transformers import AutoModelForCausalLM, StaticCache
    from runtime.execute.tokens import replayable
    import tiny_models
    config = getattr(tiny_models, f"{family}_config")()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager" if family == "gpt_oss" else "sdpa")
    model.eval()
    for prompt in (5, 11):
        plain, counted = (StaticCache(config=config, max_cache_len=32) for _ in range(2))
        replayable(counted, 32, family)
        sliding = [layer for layer, s in zip(counted.layers, counted.is_sliding) if s]
        ids = torch.randint(0, 256, (2, prompt + 16))
        with torch.no_grad():
            steps = [(0, ids[:, :prompt])] + [(t, ids[:, t:t + 1]) for t in range(prompt, prompt + 14)]
            for start, step in steps + [(prompt + 14, ids[:, prompt + 14:])]:  # then a prompt of two tokens
                if step.shape[1] == 1:
                    for layer in sliding:
                        layer.cumulative_length_int = 3 if start % 2 else 20  # stale, below or past the window
                pos = torch.arange(start, start + step.shape[1])
                want = model(step, past_key_values=plain, cache_position=pos).logits
                with _NoHostReads() if step.shape[1] == 1 else contextlib.nullcontext():
                    got = model(step, past_key_values=counted, cache_position=pos).logits
                assert torch.equal(got, want), (prompt, start)
                assert int(counted.get_seq_length(0)) == start + step.shape[1]
        for mine, theirs in zip(counted.layers, plain.layers):
            assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


def test_a_replayable_cache_counts_its_sliding_layers_on_the_device_with_the_same_logits():
    """tokens.py `replayable`: transformers' sliding-window static cache layer gives its masks' query offset from a
    Python count, which a replayed step would keep at its capture's position; made replayable, its layers count on
    the device (a tensor the step advances), and a prefill and decode steps of gpt-oss (sliding and full layers,
    eager attention) give the plain cache's logits bitwise. Its window holding the whole cache, it never rolls: its
    masks' sizes stay Python ints, which transformers compares a padding mask's width with (a tensor there would be
    a host read, which a capture refuses)."""
    from transformers import AutoModelForCausalLM, StaticCache
    from transformers.cache_utils import StaticSlidingWindowLayer
    from runtime.execute.tokens import replayable
    from tiny_models import gpt_oss_config
    config = gpt_oss_config(sliding_window=128)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    plain, counted = (StaticCache(config=config, max_cache_len=128) for _ in range(2))
    replayable(counted, 128, "GptOss")
    assert [type(layer) is StaticSlidingWindowLayer for layer in counted.layers] == [False] * 4
    assert [isinstance(layer, StaticSlidingWindowLayer) for layer in counted.layers] == [True, False, True, False]
    ids = torch.tensor([[5, 17, 99, 3, 41], [9, 250, 7, 7, 1]])
    mask = torch.ones(2, 128, dtype=torch.long)
    mask[1, :2] = 0  # the second prompt left-padded, as generation.py masks a batch of two lengths
    with torch.no_grad():
        for start, step in ((0, ids), (5, ids[:, :1]), (6, ids[:, 1:2]), (7, ids[:, 2:3])):
            pos = torch.arange(start, start + step.shape[1])
            want = model(step, past_key_values=plain, cache_position=pos, attention_mask=mask).logits
            with _NoHostReads() if step.shape[1] == 1 else contextlib.nullcontext():
                got = model(step, past_key_values=counted, cache_position=pos, attention_mask=mask).logits
            assert torch.equal(got, want), start
            length = counted.get_seq_length(0)
            assert isinstance(length, torch.Tensor) and int(length) == start + step.shape[1]
            sizes = counted.layers[0].get_mask_sizes(1)
            assert sizes == (128, 0) and type(sizes[1]) is int
