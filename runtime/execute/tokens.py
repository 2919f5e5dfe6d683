"""Prompts in, tokens out, for generation.py: a batch of prompts left-padded to one length (with the mask of its
real tokens), the attention mask transformers builds from it made capturable, the next token picked from logits
(argmax, or a seeded sample), and stop tokens."""
from __future__ import annotations

from collections.abc import Sequence

import torch


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


def capturable_eager_mask() -> None:
    """Let a CUDA graph capture the attention mask of a model with eager attention (gpt-oss: its attention sinks
    need it). transformers' `eager_mask` (masking_utils) casts sdpa's boolean mask to 0 and the dtype's minimum,
    taking its 0 from a host scalar (`torch.tensor(0.0, device=...)`): a copy from pageable memory, which a capture
    refuses. `_eager_mask`, registered in its place under "eager" (AttentionMaskInterface.register, transformers'
    extension point for mask functions), builds the same mask, bit for bit, its 0 filled on the device. The registry
    is process-wide: every model with eager attention gets it, the same values either way. Idempotent."""
    from transformers.masking_utils import AttentionMaskInterface
    AttentionMaskInterface.register("eager", _eager_mask)


def _eager_mask(*args, dtype: torch.dtype = torch.float32, **kwargs) -> torch.Tensor | None:
    from transformers.masking_utils import sdpa_mask
    kwargs.pop("allow_is_causal_skip", None)  # as eager_mask: an eager mask is never skipped as causal
    mask = sdpa_mask(*args, allow_is_causal_skip=False, **kwargs)
    return None if mask is None else torch.where(mask, mask.new_zeros((), dtype=dtype), torch.finfo(dtype).min)
