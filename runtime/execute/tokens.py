"""Prompts in, tokens out, for generation.py: a batch of prompts left-padded to one length (with the mask of its
real tokens), the attention mask transformers builds from it made capturable, a static cache that a replay
would corrupt refused (and its sliding layers' length counted on the device), the next token picked from logits
(argmax, or a seeded sample), and stop tokens."""
from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

CACHE_QUANTUM = 128  # cache lengths are rounded up to a multiple of this, so nearby calls share a captured step


def batch_prompts(prompts, pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """([B, T] ids, left-padded to the longest prompt; [B, T] mask of the real tokens, None without pads)."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2 or prompts.shape[1] < 1:
            raise ValueError(f"prompts: a [batch, tokens] tensor of token ids, not shape {tuple(prompts.shape)}")
        return prompts.to(device=device, dtype=torch.long), None
    rows = [list(p) for p in prompts]
    if not rows or not all(rows):
        raise ValueError("prompts: one or more prompts of one or more token ids each")
    length = max(map(len, rows))
    ids = torch.tensor([[pad_id] * (length - len(r)) + r for r in rows], dtype=torch.long, device=device)
    if all(len(r) == length for r in rows):
        return ids, None
    mask = torch.tensor([[0] * (length - len(r)) + [1] * len(r) for r in rows], dtype=torch.long, device=device)
    return ids, mask


def sampler(do_sample: bool, temperature: float, top_k: int | None, seed: int, device):
    """logits [B, V] -> tokens [B]: argmax, or a sample at `temperature` among the `top_k` likeliest."""
    if not do_sample:
        return lambda logits: logits.argmax(dim=-1)
    if temperature <= 0:
        raise ValueError(f"temperature must be above 0, not {temperature}")
    generator = torch.Generator(device=device).manual_seed(seed)

    def sample(logits: torch.Tensor) -> torch.Tensor:
        scores = logits.float() / temperature
        if top_k is not None:
            kth = scores.topk(min(top_k, scores.shape[-1]), dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        return torch.multinomial(scores.softmax(dim=-1), 1, generator=generator).view(-1)
    return sample


def hit_stop(token: torch.Tensor, stops: torch.Tensor | None, done: torch.Tensor | None) -> torch.Tensor:
    hit = torch.isin(token, stops) if stops is not None else torch.zeros_like(token, dtype=torch.bool)
    return hit if done is None else done | hit


def until_stop(tokens: list[int], stop: Sequence[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[:i + 1]
    return tokens


def replayable(cache, cache_len: int, model_name: str) -> None:
    """What a decode step captured in a CUDA graph needs of transformers, before its capture.

    The attention mask of a model with eager attention (gpt-oss: its attention sinks need it): transformers'
    `eager_mask` (masking_utils) casts sdpa's boolean mask to 0 and the dtype's minimum, taking its 0 from a host
    scalar (`torch.tensor(0.0, device=...)`), a copy from pageable memory that a capture refuses. `_eager_mask`,
    registered in its place under "eager" (AttentionMaskInterface.register, transformers' extension point for mask
    functions), builds the same mask, bit for bit, its 0 filled on the device. The registry is process-wide: every
    model with eager attention gets it, the same values either way.

    The cache: a replay repeats the branches its capture took. transformers' sliding-window static cache layer
    (StaticSlidingWindowLayer: Gemma 2 and 3, gpt-oss, Llama 4's chunks) counts its tokens in a Python int and rolls
    its buffer once that count reaches its window, so a captured step never rolls it: replayed past the window, its
    attention would read stale keys. Below the window it never rolls. So a cache longer than a sliding layer's
    window is refused (ValueError, naming the lengths and what to do). Below it, one more fact of the layer is kept
    in Python: its sequence length (`get_seq_length`), the query's offset in its layers' masks, which a captured
    mask would keep at the capture's position (the full layers' StaticLayer returns its count on the device, which
    the replay advances: transformers 5.17). Each sliding layer is made a `_ReplayedSlidingLayer` (its class swapped,
    as dequant.py swaps modules'), which returns that count on the device too: below the window the two counts are
    equal, so eager forwards give the same masks, and replayed ones the replay's own. A sliding layer of another
    class (a subclass: it may keep more in Python) is refused."""
    from transformers.cache_utils import StaticSlidingWindowLayer
    from transformers.masking_utils import AttentionMaskInterface
    check_window(cache, cache_len, model_name)
    AttentionMaskInterface.register("eager", _eager_mask)
    for layer in cache.layers:
        if type(layer) is StaticSlidingWindowLayer:
            layer.__class__ = _replayed_sliding_layer()


def check_window(cache, cache_len: int, model_name: str) -> None:
    """`replayable`'s check of the cache alone (ValueError), which `plan apply` also runs before its prefill: no
    sliding layer of another kind than StaticSlidingWindowLayer (a subclass, such as transformers' layers for hybrid
    linear and sliding attention, may keep other counts in Python: not made replayable here), and none whose window
    is shorter than the cache."""
    from transformers.cache_utils import StaticSlidingWindowLayer
    sliding = [layer for layer, is_sliding in zip(cache.layers, cache.is_sliding) if is_sliding]
    eager = "generate eagerly (`eager=True`, `plan apply --eager`)"
    known = (StaticSlidingWindowLayer, _replayed_sliding_layer())
    if odd := sorted({type(layer).__name__ for layer in sliding if type(layer) not in known}):
        raise ValueError(f"{model_name}: its sliding-window attention caches in transformers' {', '.join(odd)}, whose "
                         f"state a decode step replayed from a CUDA graph could leave as at its capture: {eager}")
    window = min((layer.max_cache_len for layer in sliding), default=cache_len)
    if window < cache_len:
        fits = window // CACHE_QUANTUM * CACHE_QUANTUM
        raise ValueError(f"{model_name}: its sliding-window attention keeps {window} tokens, and a decode step "
                         f"replayed from a CUDA graph cannot roll that window (transformers' static sliding-window "
                         f"cache counts in Python); this call's cache holds {cache_len} (prompt and new tokens, "
                         f"rounded up to a multiple of {CACHE_QUANTUM}): {eager}"
                         + (f", or keep the prompt and new tokens within {fits}" if fits else ""))


@functools.cache
def _replayed_sliding_layer() -> type:
    """StaticSlidingWindowLayer whose sequence length is its count on the device (`replayable`): in step with its
    Python count below its window, which `check_window` keeps a replayed cache within."""
    from transformers.cache_utils import StaticSlidingWindowLayer

    class _ReplayedSlidingLayer(StaticSlidingWindowLayer):
        def get_seq_length(self):
            return self.cumulative_length if self.is_initialized else 0
    return _ReplayedSlidingLayer


def _eager_mask(*args, dtype: torch.dtype = torch.float32, **kwargs) -> torch.Tensor | None:
    from transformers.masking_utils import sdpa_mask
    kwargs.pop("allow_is_causal_skip", None)  # as eager_mask: an eager mask is never skipped as causal
    mask = sdpa_mask(*args, allow_is_causal_skip=False, **kwargs)
    return None if mask is None else torch.where(mask, mask.new_zeros((), dtype=dtype), torch.finfo(dtype).min)
