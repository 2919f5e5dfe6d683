"""Routers of random-weight checkpoints made to route like trained ones (skewed, or spread over tokens), and what
a decode step's routing touches (moe.py, moe_kernels.py, moe_predict.py, prefill.py)."""
from __future__ import annotations

import statistics
from pathlib import Path

import torch


class RouterSkew:
    """Skewed routing for a random-weight checkpoint, fixed per layer and the same in every run.

    Each MoE layer's router sees its input plus a vector v with W v = b (W: the router's
    [experts, hidden] weight, v = W^T (W W^T)^-1 b), so expert e's logit moves by
    b_e = -strength x sigma x ln(rank_e): rank 1..E in a random order per layer, sigma the
    layer's logit scale (the mean norm of W's rows: the router's input is RMS-normalised).
    Simulated over Gaussian logits at 128 experts, top-8, strength 0.7 gives 90% of the hits
    to 56 experts (44%), about what published counts for Qwen3-30B-A3B show (58 of 128 on a
    narrow workload). Only the router sees v: the experts get the layer's own input.
    """

    def __init__(self, ckpt: Path, info, layers: int, strength: float, device: str):
        from safetensors import safe_open
        g = torch.Generator().manual_seed(7)
        self.vectors: dict[int, torch.Tensor] = {}
        for i in range(layers):
            name = f"model.layers.{i}.mlp.gate.weight"
            with safe_open(ckpt / info.tensors[name].shard, "pt") as f:
                w = f.get_tensor(name).double()
            rank = torch.empty(w.shape[0], dtype=torch.float64)
            rank[torch.randperm(w.shape[0], generator=g)] = torch.arange(1, w.shape[0] + 1, dtype=torch.float64)
            b = -strength * w.norm(dim=1).mean() * rank.log()
            v = w.T @ torch.linalg.solve(w @ w.T, b)
            self.vectors[i] = v.to(device, torch.bfloat16)

    def install(self, model) -> None:
        for i, layer in enumerate(model.model.layers):
            layer.mlp.gate.register_forward_pre_hook(lambda module, args, v=self.vectors[i]: (args[0] + v,))


class RouterSpread:
    """Token-dependent routing for a random-weight checkpoint, the same in every run (prefill.py and moe.py
    --spread).

    A random-weight model's hidden states collapse with depth: one prompt's tokens, and one sequence's decode
    steps, reach the routers as nearly the same vector, so each routes to a few experts of its own, where a
    trained model's tokens spread over many. So each MoE layer's router sees its input plus one row of a fixed
    random matrix [rows, hidden] (Gaussian, `strength` times the RMS of the router's RMS-normalised input, 1),
    picked by the input row's content (its sum, scaled and taken modulo `rows`): a different row for each token
    and decode step, the same for the same hidden state in every plan (their logits are bitwise equal), and no
    host synchronisation, so a decode step replays from a CUDA graph. Only the router sees it: the experts get
    the layer's own input.
    """

    SEED = 11

    def __init__(self, layers: int, hidden: int, rows: int, strength: float, device: str):
        g = torch.Generator().manual_seed(self.SEED)
        self.noise = [(strength * torch.randn(rows, hidden, generator=g)).to(device, torch.bfloat16)
                      for _ in range(layers)]

    @staticmethod
    def _hook(noise: torch.Tensor):
        def add(module, args):
            x = args[0]
            row = torch.remainder((x.float().sum(-1) * 4099).long(), noise.shape[0])
            return (x + noise[row],)
        return add

    def install(self, model) -> None:
        for i, layer in enumerate(model.model.layers):
            layer.mlp.gate.register_forward_pre_hook(self._hook(self.noise[i]))


def hit_shares(counts: list[int]) -> dict:
    """How skewed one layer's decode hits are: experts for 90% of them, share of the top quarter and half."""
    ranked = sorted(counts, reverse=True)
    total, run, need = sum(ranked), 0, None
    for n, c in enumerate(ranked, 1):
        run += c
        if need is None and run >= 0.9 * total:
            need = n
    quarter, half = round(len(ranked) / 4), round(len(ranked) / 2)
    return {"experts_for_90pct": need, "top_quarter_share": sum(ranked[:quarter]) / total,
            "top_half_share": sum(ranked[:half]) / total}


def _stored_row_bytes(module, name: str) -> int:
    """One expert's bytes of the fused parameter `name` as pinned memory holds them: an FP8 weight's bytes and
    its scales' (runtime/place/quant.py keeps them as stored), else the parameter's. Not MXFP4's: its slots are
    bound under `<name>_blocks`, which the caller does not look for, so the floor counts no host bytes for it."""
    data = getattr(module, name)
    scale = dict(module.named_buffers(recurse=False)).get(name + "_scale_inv")
    return data[0].nbytes + (scale[0].nbytes if scale is not None else 0)


def touched_experts(model, ids: torch.Tensor, batch: int, new: int) -> tuple[float, float]:
    """(unique experts per MoE layer per decode step, bytes of them read from pinned memory per decode step),
    counted in one untimed greedy `generate` of `new` tokens after the first `batch` prompts."""
    from runtime.execute.experts import fused_params, supports
    unique: list[int] = []
    host = [0]

    def count(module, args):
        if args[1].shape[0] != batch:  # one token per sequence: a decode step, not a prefill
            return
        hit = args[1].unique()
        unique.append(hit.numel())
        for p in fused_params(module):
            slot = getattr(module, f"offplan_slot_{p}", None)  # bound by the runtime: -1 for a host expert
            if slot is not None:
                host[0] += int((slot[hit] < 0).sum()) * _stored_row_bytes(module, p)
    modules = [m for m in model.modules() if supports(m)]
    hooks = [m.register_forward_pre_hook(count) for m in modules]
    x = ids[:batch]
    try:
        with torch.no_grad():
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new + 1, min_new_tokens=new + 1,
                           do_sample=False, pad_token_id=0)
    finally:
        for h in hooks:
            h.remove()
    return statistics.fmean(unique), host[0] * len(modules) / len(unique)
