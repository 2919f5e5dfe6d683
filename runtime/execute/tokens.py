"""Prompts in, tokens out, for generation.py: a batch of prompts left-padded to one length (with the mask of its
real tokens), the next token picked from logits (argmax, or a seeded sample), and stop tokens."""
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
