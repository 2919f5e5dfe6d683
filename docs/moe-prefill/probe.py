"""Where does an all-GPU Qwen3-30B-A3B prefill spend its time? (a probe, not a benchmark)

    python docs/moe-prefill/probe.py --out DIR        # on a GPU

8 decoder layers of Qwen3-30B-A3B's shape, random bf16 weights built on the GPU (no checkpoint), every
weight resident. First, at 8192 tokens: the GPU time per CPU-side op (self device time, top 15) under
transformers' grouped_mm and under "offplan_grouped_mm" (its arithmetic less its masks for expert parallelism:
`grouped_mm_without_masks` below, as branch lean-grouped's runtime runs it), and whether their logits are
bitwise equal. Then, for each implementation and
prompt length T: the forward that yields the first token (a fresh static cache, `logits_to_keep=1`), timed with
a synchronize around it (median of 3 after a warm-up), and one profiled forward: the GPU time per kernel name
(top 12), the kernel count, and the forward's wall time under the profiler. Appends to DIR/probe.jsonl.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from harness.checkpoints import config_for  # noqa: E402


def forward(model, ids):
    from transformers import StaticCache
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 8)
    with torch.no_grad():
        return model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits


def timed(model, ids, n=3):
    forward(model, ids)
    torch.cuda.synchronize()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        forward(model, ids)
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def profiled(model, ids):
    from torch.profiler import ProfilerActivity, profile
    forward(model, ids)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        forward(model, ids)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) * 1e3
    kernels = {}
    count = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            count += 1
            k = kernels.setdefault(e.name[:90], [0, 0.0])
            k[0] += 1
            k[1] += e.device_time / 1e3
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:12]
    return wall, count, sum(v[1] for v in kernels.values()), [(n, c, round(ms, 3)) for n, (c, ms) in top]


def grouped_mm_without_masks(self, hidden_states, top_k_index, top_k_weights):
    """transformers' grouped_mm arithmetic less its three masks for expert parallelism's sentinel ids (none here):
    the same kernels on the same values otherwise, as branch lean-grouped's runtime/execute/experts.py
    `grouped_mm_forward` runs it. Qwen3-MoE's experts: gated, no bias, not transposed."""
    num_tokens, k = top_k_index.shape
    ids, weights = top_k_index.reshape(-1), top_k_weights.reshape(-1)
    ids_sorted, perm = torch.sort(ids)
    x = hidden_states[perm // k]
    counts = torch.histc(ids_sorted.int(), bins=self.num_experts, min=0, max=self.num_experts - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    up = torch.nn.functional.grouped_mm(x, self.gate_up_proj.transpose(-2, -1), offs=offsets)
    up = self._apply_gate(up)
    out = torch.nn.functional.grouped_mm(up, self.down_proj.transpose(-2, -1), offs=offsets)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    out = out[inverse]  # pair order, then weighted: the same products as weighting first, then reordering
    return (out * weights.unsqueeze(-1)).view(num_tokens, k, -1).sum(dim=1).to(hidden_states.dtype)


def by_op(model, ids):
    """GPU time per CPU-side op (self device time), top 15, of one forward."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        forward(model, ids)
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)[:15]
    return [(e.key[:60], e.count, round(e.self_device_time_total / 1e3, 3), round(e.self_cpu_time_total / 1e3, 3))
            for e in rows]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 2048, 8192])
    ap.add_argument("--implementations", nargs="+", default=["grouped_mm", "offplan_grouped_mm"])
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from transformers import AutoModelForCausalLM
    config = config_for("qwen3-30b-a3b", 8)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    g = torch.Generator().manual_seed(1)
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    ALL_EXPERTS_FUNCTIONS.register("offplan_grouped_mm", grouped_mm_without_masks)
    ids = torch.randint(0, config.vocab_size, (1, 8192), generator=g).cuda()
    model.set_experts_implementation("grouped_mm")
    ref = forward(model, ids)
    for r in by_op(model, ids):
        print("by-op grouped_mm 8192", r, flush=True)
    model.set_experts_implementation("offplan_grouped_mm")
    lean = forward(model, ids)
    print("offplan_grouped_mm equal bitwise:", torch.equal(ref, lean), flush=True)
    for r in by_op(model, ids):
        print("by-op offplan_grouped_mm 8192", r, flush=True)
    for impl in args.implementations:
        model.set_experts_implementation(impl)
        for T in args.tokens:
            if impl == "batched_mm" and T > 128:
                continue  # it copies every pair's weights: T*8 x 9.4 MB
            ids = torch.randint(0, config.vocab_size, (1, T), generator=g).cuda()
            ms = timed(model, ids)
            wall, count, gpu_ms, top = profiled(model, ids)
            row = {"implementation": impl, "tokens": T, "ms": round(ms, 2), "profiled_wall_ms": round(wall, 2),
                   "kernels": count, "kernel_ms": round(gpu_ms, 2), "top": top}
            print(json.dumps(row), flush=True)
            with open(args.out / "probe.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
