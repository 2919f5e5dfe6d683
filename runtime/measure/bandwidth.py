"""Bandwidths for `plan calibrate` (calibrate.py says what each measures, and how): H2D copy, UVA and HBM
reads by GEMVs, the GEMM rate, and where prefill's in-place GEMMs start re-reading their weights.

Each figure is the median of repeats timed with CUDA events (`median_ms`), after a warm-up pass.
"""
from __future__ import annotations

import statistics
import time

import torch

from ..place.arena import PinnedArena, typed


def median_ms(fn, repeat: int = 20, warmup: int = 2) -> float:
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


def warm_up(seconds: float = 1.0) -> None:
    """Large matrix products until `seconds` have passed: GPU clocks up from idle."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def random_bytes(nbytes: int) -> torch.Tensor:
    """`nbytes` (even) of normally distributed bf16 values, as uint8 on the GPU: real weights, not zeros."""
    return torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda").view(torch.uint8)


def h2d_copy_gbps(nbytes: int = 2**30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    src.copy_(random_bytes(nbytes))
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    ms = median_ms(lambda: dst.copy_(src, non_blocking=True))
    return nbytes / ms / 1e6


def gemv_gbps(weights: list[torch.Tensor], batch: int = 1, repeat: int = 20) -> float:
    """GB/s of bf16 GEMVs (`batch` rows of activations) reading `weights` one after another."""
    x = torch.randn(batch, weights[0].shape[1], dtype=weights[0].dtype, device="cuda")

    def run():
        for w in weights:
            torch.nn.functional.linear(x, w)
    return sum(w.nbytes for w in weights) / median_ms(run, repeat) / 1e6


def mlp_weights(flat: torch.Tensor, rows: int = 14336, cols: int = 4096, count: int = 8) -> list[torch.Tensor]:
    """`count` bf16 [rows, cols] weights (an LLM's MLP shape) over a flat uint8 buffer of their bytes."""
    one = rows * cols * 2
    return [typed(flat[i * one:(i + 1) * one], torch.bfloat16, (rows, cols)) for i in range(count)]


def uva_gbps(nbytes: int = 8 * 14336 * 4096 * 2) -> float:
    """GEMVs over weights in the runtime's own pinned arena, read through its zero-copy view."""
    arena = PinnedArena(nbytes, cuda=True)
    arena.host_view(0, nbytes).copy_(random_bytes(nbytes))
    try:
        return gemv_gbps(mlp_weights(arena.device_view(0, nbytes)))
    finally:
        arena.release()  # the views died with gemv_gbps's frame


def hbm_gbps(nbytes: int = 8 * 14336 * 4096 * 2) -> float:
    """GEMVs over weights in GPU memory, replayed from a CUDA graph: each takes some 45 us on the H100, so
    launched one by one from Python a stall of the CPU leaves the GPU idle between them (two calibrations in a
    row measured 2614 and 2343 GB/s that way); a replay launches them without the CPU."""
    weights = mlp_weights(random_bytes(nbytes))
    x = torch.randn(1, weights[0].shape[1], dtype=weights[0].dtype, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the default stream, as capture requires
        for w in weights:
            torch.nn.functional.linear(x, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            torch.nn.functional.linear(x, w)
    return sum(w.nbytes for w in weights) / median_ms(graph.replay, repeat=50) / 1e6


STAGE_TOKENS = (32, 64, 128, 192, 256, 384, 512, 1024)


def matmul_tflops(tokens: int = 4096, nbytes: int = 8 * 14336 * 4096 * 2) -> float:
    """bf16 GEMMs of `tokens` rows over weights in GPU memory, 10^12 FLOP/s."""
    weights = mlp_weights(random_bytes(nbytes))
    x = torch.randn(tokens, weights[0].shape[1], dtype=torch.bfloat16, device="cuda")
    ms = median_ms(lambda: [torch.nn.functional.linear(x, w) for w in weights], repeat=10)
    return 2 * tokens * sum(w.numel() for w in weights) / ms / 1e9


def stage_crossover(counts=STAGE_TOKENS, nbytes: int = 8 * 14336 * 4096 * 2) -> dict[int, tuple[float, float]]:
    """Per token count: (ms reading the pinned weights in place, ms copying each to the GPU and then multiplying)."""
    arena = PinnedArena(nbytes, cuda=True)
    arena.host_view(0, nbytes).copy_(random_bytes(nbytes))
    try:
        pinned = mlp_weights(arena.device_view(0, nbytes))
        hosts = mlp_weights(arena.host_view(0, nbytes))
        buffer = torch.empty_like(pinned[0])
        out = {}
        for m in counts:
            x = torch.randn(m, pinned[0].shape[1], dtype=torch.bfloat16, device="cuda")

            def copied():
                for w in hosts:
                    buffer.copy_(w, non_blocking=True)
                    torch.nn.functional.linear(x, buffer)
            in_place = median_ms(lambda: [torch.nn.functional.linear(x, w) for w in pinned], repeat=7)
            out[m] = (in_place, median_ms(copied, repeat=7))
        return out
    finally:
        arena.release()


REREAD = 1.10  # in place slower than at the fewest tokens by more than this: the tiles re-read the weight


def stage_above(times: dict[int, tuple[float, float]]) -> int:
    """The largest token count before the in-place GEMMs' time jumps (module doc): at every count up to it,
    reading in place takes at most REREAD x its time at the fewest tokens."""
    counts = sorted(times)
    above = counts[0]
    for m in counts[1:]:
        if times[m][0] > REREAD * times[counts[0]][0]:
            break
        above = m
    return above
