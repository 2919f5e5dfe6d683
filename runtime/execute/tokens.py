"""Prompts in, tokens out, for generation.py: a batch of prompts left-padded to one length (with the mask of its
real tokens), the attention mask transformers builds from it made capturable, a static cache's sliding layers
made to count on the device (or refused where a replay could not), the next token picked from logits
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


def replayable(cache, cache_len: int, model_name: str, masked: bool = False) -> None:
    """What a decode step captured in a CUDA graph needs of transformers, before its capture. `masked`: the batch's
    prompts are padded (a 2D mask of their tokens goes with each step).

    The attention mask of a model with eager attention (gpt-oss: its attention sinks need it): transformers'
    `eager_mask` (masking_utils) casts sdpa's boolean mask to 0 and the dtype's minimum, taking its 0 from a host
    scalar (`torch.tensor(0.0, device=...)`), a copy from pageable memory that a capture refuses. `_eager_mask`,
    registered in its place under "eager" (AttentionMaskInterface.register, transformers' extension point for mask
    functions), builds the same mask, bit for bit, its 0 filled on the device. The registry is process-wide: every
    model with eager attention gets it, the same values either way.

    The cache: a replay repeats the branches its capture took, and reads no Python value again. transformers'
    sliding-window static cache layer (StaticSlidingWindowLayer: Gemma 2 and 3, gpt-oss, Llama 4's chunked
    attention) counts its tokens in a Python int, by which it rolls its buffer once full and sizes its masks (the
    query's offset, the keys' first position), so a replayed step would write and attend as at its capture. Each
    such layer is made a `_ReplayedSlidingLayer` (its class swapped, as dequant.py swaps modules'), whose one-token
    steps use its count on the device only: the same writes, by `torch.where` over the rolled buffer, and the same
    masks, their offsets tensors (module `_replayed_sliding_layer`). A layer whose window holds the whole cache never
    rolls: it only counts on the device, its masks sized as transformers sizes them (Python ints, which a padding
    mask's width is compared with: a tensor there would be a host read, refused in a capture). Refused (ValueError,
    naming what to do, `check_window`): a sliding layer of another class (a subclass: it may keep more in Python),
    and with `masked`, a cache longer than a window (transformers compares the keys' offset with the padding mask's
    width in Python)."""
    from transformers.cache_utils import StaticSlidingWindowLayer
    from transformers.masking_utils import AttentionMaskInterface
    check_window(cache, cache_len, model_name, masked)
    AttentionMaskInterface.register("eager", _eager_mask)
    for layer in cache.layers:
        if type(layer) is StaticSlidingWindowLayer:
            layer.__class__ = _replayed_sliding_layer(rolls=layer.max_cache_len < cache_len)


def check_window(cache, cache_len: int, model_name: str, masked: bool = False) -> None:
    """`replayable`'s check of the cache alone (ValueError), which `plan apply` also runs before loading (as for one
    prompt) and before its prefill: no sliding layer of another kind than StaticSlidingWindowLayer (a subclass, such
    as transformers' layers for hybrid linear and sliding attention, may keep other counts in Python: not made
    replayable here), and, for prompts of several lengths (`masked`), none whose window is shorter than the cache."""
    from transformers.cache_utils import StaticSlidingWindowLayer
    sliding = [layer for layer, is_sliding in zip(cache.layers, cache.is_sliding) if is_sliding]
    eager = "generate eagerly (`eager=True`, `plan apply --eager`)"
    known = (StaticSlidingWindowLayer, _replayed_sliding_layer(False), _replayed_sliding_layer(True))
    if odd := sorted({type(layer).__name__ for layer in sliding if type(layer) not in known}):
        raise ValueError(f"{model_name}: its sliding-window attention caches in transformers' {', '.join(odd)}, whose "
                         f"state a decode step replayed from a CUDA graph could leave as at its capture: {eager}")
    window = min((layer.max_cache_len for layer in sliding), default=cache_len)
    if masked and window < cache_len:
        fits = window // CACHE_QUANTUM * CACHE_QUANTUM
        raise ValueError(f"{model_name}: its sliding-window attention keeps {window} tokens, and this call's cache "
                         f"holds {cache_len} (prompt and new tokens, rounded up to a multiple of {CACHE_QUANTUM}) for "
                         f"prompts of several lengths, whose padding mask transformers lines up with a rolled window "
                         f"in Python, which a decode step replayed from a CUDA graph would not redo: give prompts of "
                         f"one length, or {eager}" + (f", or keep the prompt and new tokens within {fits}" if fits
                                                      else ""))


@functools.cache
def _replayed_sliding_layer(rolls: bool) -> type:
    """StaticSlidingWindowLayer whose one-token steps read no Python count (`replayable`). Without `rolls` (its window
    holds the whole cache), only its sequence length is its count on the device: below its window transformers'
    writes already take the count on the device, and its masks' sizes never change (the window, from position 0).

    transformers' layer, at one token: below its window it writes the new key at its count (already a tensor) and
    its masks take the keys from position 0; once full it rolls its buffer left by one and writes the new key last,
    and the keys start at count - window + 1. Both are chosen by its Python count. Here the count on the device
    chooses: the buffer is rolled where full (`torch.where`, so a copy of the window's keys and values each step: 256
    KiB a layer and sequence for gpt-oss-120b, 8 MiB for Gemma 3 27B's window of 1024), the key written at min(count,
    window - 1), and `get_mask_sizes` gives the keys' offset as a tensor, max(count - window + 1, 0), which the masks
    add to their key positions (masking_utils `sdpa_mask`). The same values as transformers', bit for bit. A prompt
    (more than one token) runs transformers' own update and sizes, eagerly, its Python count first set from the
    device's and the device's from it after."""
    from transformers.cache_utils import StaticSlidingWindowLayer

    class _CountedSlidingLayer(StaticSlidingWindowLayer):
        def get_seq_length(self):
            return self.cumulative_length if self.is_initialized else 0

    if not rolls:
        return _CountedSlidingLayer

    class _ReplayedSlidingLayer(_CountedSlidingLayer):
        def get_mask_sizes(self, query_length: int):
            if query_length > 1 or not self.is_initialized:  # a prompt, eager: transformers' sizes
                self._count_in_python()
                return super().get_mask_sizes(query_length)
            return self.max_cache_len, (self.cumulative_length - (self.max_cache_len - 1)).clamp(min=0)

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            if key_states.shape[-2] > 1 or not self.is_initialized:
                self._count_in_python()
                out = super().update(key_states, value_states, *args, **kwargs)
                self.cumulative_length.fill_(self.cumulative_length_int)  # its full branches leave it behind
                return out
            count, window = self.cumulative_length, self.max_cache_len
            full, at = count >= window, count.clamp(max=window - 1).view(1)
            for cached, new in ((self.keys, key_states), (self.values, value_states)):
                cached.copy_(torch.where(full, cached.roll(-1, dims=-2), cached))
                cached.index_copy_(2, at, new)
            count.add_(1)
            return self.keys, self.values

        def _count_in_python(self) -> None:
            if self.is_initialized:
                self.cumulative_length_int = int(self.cumulative_length)  # a host sync, eager only
    return _ReplayedSlidingLayer


def _eager_mask(*args, dtype: torch.dtype = torch.float32, **kwargs) -> torch.Tensor | None:
    from transformers.masking_utils import sdpa_mask
    kwargs.pop("allow_is_causal_skip", None)  # as eager_mask: an eager mask is never skipped as causal
    mask = sdpa_mask(*args, allow_is_causal_skip=False, **kwargs)
    return None if mask is None else torch.where(mask, mask.new_zeros((), dtype=dtype), torch.finfo(dtype).min)
