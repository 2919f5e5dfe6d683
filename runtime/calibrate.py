"""`plan calibrate`: measure what the cost model needs on this machine, write a hardware profile.

- H2D copy: a 1 GiB pinned host tensor copied to the GPU (what prefetch does);
- UVA read: bf16 GEMVs over eight [14336, 4096] weights (an LLM's MLP shape,
  0.9 GiB in all) in pinned host memory, read through the runtime's zero-copy
  view, one after another as a model's layers would (what uva does);
- HBM read: the same GEMVs with the weights in GPU memory;
- CPU overheads: decode steps of transformers Llamas with tiny tensors (so
  bytes cost nothing) and 2 and 10 layers, at batch 1: the slope is what
  launching one decoder layer's kernels costs through the framework, eagerly;
  the intercept is the per-step cost outside the layers.
Each figure is the median of repeated runs timed with CUDA events.
"""
from __future__ import annotations

import statistics
import time

import torch

from planner.hardware import Hardware

from .arena import PinnedArena, typed


def _median_ms(fn, repeat: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def h2d_copy_gbps(nbytes: int = 2**30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    src.random_()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    ms = _median_ms(lambda: dst.copy_(src, non_blocking=True))
    return nbytes / ms / 1e6


def gemv_gbps(where: str, rows: int = 14336, cols: int = 4096, count: int = 8) -> float:
    """GB/s of bf16 GEMVs reading `count` [rows, cols] weights from `where` ("uva" or "hbm")."""
    one = rows * cols * 2
    x = torch.randn(1, cols, dtype=torch.bfloat16, device="cuda")
    arena = None
    if where == "uva":
        arena = PinnedArena(one * count, cuda=True)
        arena.host(0, one * count).random_()
        ws = [typed(arena.device(i * one, one), torch.bfloat16, (rows, cols)) for i in range(count)]
    else:
        ws = [torch.randn(rows, cols, dtype=torch.bfloat16, device="cuda") for _ in range(count)]

    def run():
        for w in ws:
            torch.nn.functional.linear(x, w)
    ms = _median_ms(run)
    ws = None  # the views must go before the arena is unregistered
    if arena is not None:
        arena.release()
    return one * count / ms / 1e6


def step_time_us(layers: int, steps: int = 20) -> float:
    """Eager decode step time of a transformers Llama with tiny tensors, batch 1."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    ids = torch.ones(1, 4, dtype=torch.long, device="cuda")

    def run(n_new: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    run(4)
    # The difference between two lengths removes prefill and generate's fixed cost.
    return (statistics.median(run(steps * 2) for _ in range(3)) -
            statistics.median(run(steps) for _ in range(3))) / steps * 1e6


def overheads_us(few: int = 2, many: int = 10) -> tuple[float, float]:
    """(per step, per layer) CPU overhead: a line through step times at two layer counts."""
    t_few, t_many = step_time_us(few), step_time_us(many)
    per_layer = max(0.0, (t_many - t_few) / (many - few))
    return max(0.0, t_few - few * per_layer), per_layer


def calibrate() -> Hardware:
    if not torch.cuda.is_available():
        from planner.errors import OffplanError
        raise OffplanError("plan calibrate measures a GPU: no CUDA device here")
    name = torch.cuda.get_device_name()
    h2d = h2d_copy_gbps()
    uva = gemv_gbps("uva")
    hbm = gemv_gbps("hbm")
    per_step, per_layer = overheads_us()
    return Hardware(name, round(h2d, 1), round(uva, 1), round(hbm), round(per_layer, 1), round(per_step, 1),
                    f"plan calibrate, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
