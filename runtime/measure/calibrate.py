"""`plan calibrate`: measure what the cost model needs on this machine, write a hardware profile.

What is measured, and how:
- warm-up first: about a second of large bf16 matrix products, so the GPU has
  left its idle clocks before anything is timed, and one untimed pass of every
  measurement (kernel loading, allocator);
- H2D copy: a 1 GiB pinned host tensor copied to the GPU (what prefetch does);
- UVA read: bf16 GEMVs over eight [14336, 4096] weights (an LLM's MLP shape,
  0.9 GiB in all) in the runtime's own pinned arena, read through its
  zero-copy view, one after another as a model's layers would (what uva does);
- HBM read: the same GEMVs with the weights in GPU memory, replayed from a CUDA graph;
  each bandwidth is the median of 20 or more repeats timed with CUDA events;
- prefill: the GEMM rate over the same weights in GPU memory at 4096 tokens
  (`matmul_tflops`), and the crossover for uva weights: for token counts 32 to
  1024, GEMMs reading the pinned weights in place against copying each weight
  to the GPU first and then multiplying (one after the other, no overlap).
  Reading in place runs at the UVA rate, a few percent under the copy's, until
  the GEMM's tiles start re-reading the weight: then its time jumps (measured
  on the H100: 1.06x the copy up to 192 tokens, 2.1x at 256, 5.2x at 1024).
  `stage_above_tokens` is the largest count before that jump (in place still
  within 10% of its time at the fewest tokens); plans stage uva layers for
  forwards above it (runtime/prefill.py), and below it decode keeps its
  zero-copy reads;
- CPU overhead: eager HF `generate` of tiny transformers Llamas (tensors so
  small that the GPU always waits for the CPU) with 2, 4, 8, 16 and 32 layers.
  The wall time of every decode step is taken inside `generate` (a stopping
  criterion is called once per step). The models take turns over several
  rounds; each one's median step (the median over rounds of each round's
  median) is fitted by least squares to `step = per_step + per_layer x
  layers`. `per_layer` is the CPU time to launch one decoder layer's kernels
  through the framework; `per_step` is what a step costs outside the layers
  (embedding, head, sampling, cache bookkeeping). The line must explain the medians (R^2 >= 0.95),
  or calibration fails: the CPU was busy with something else;
- GPU time per layer: the same tiny Llamas, and tiny Qwen3-MoE models (8
  experts, top-2, transformers' `batched_mm`), with 2 to 32 layers, each
  decode step (batch 1, static cache) captured in a CUDA graph and replayed:
  no CPU in the way, and weights so small that reading them takes no time,
  so what is left is what the GPU spends per kernel (launch latency, tiny
  grids). The median replay is fitted the same way: `layer_gpu_us` and
  `moe_layer_gpu_us` per decoder layer, `step_gpu_us` per step (embedding,
  head, the dense fit's intercept). On the H100 a Qwen3-MoE decode step runs
  about 650 kernels; this is the part of its time that reading weights does
  not explain.

Limits: the per-layer figures are a Llama layer's and a Qwen3-MoE layer's at
batch 1; a layer that launches more kernels (transformers' eager MoE expert
loop, shared experts) costs more per layer, and larger batches run larger
kernels.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from planner.errors import OffplanError
from planner.inputs.hardware import Hardware

from ..place.arena import PinnedArena, typed

LAYER_COUNTS = (2, 4, 8, 16, 32)
MIN_R2 = 0.95


@dataclass(frozen=True)
class Calibration:
    hardware: Hardware
    step_us_by_layers: dict[int, float]  # median eager decode step of the tiny Llamas
    r2: float  # of the per-layer line through them
    stage_ms: dict[int, tuple[float, float]]  # tokens -> (uva GEMMs in place, copied first), ms (stage_crossover)
    replay_us_by_layers: dict[str, dict[int, float]]  # "dense" / "moe" -> layers -> replayed decode step, us


def _median_ms(fn, repeat: int = 20, warmup: int = 2) -> float:
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
    ms = _median_ms(lambda: dst.copy_(src, non_blocking=True))
    return nbytes / ms / 1e6


def gemv_gbps(weights: list[torch.Tensor], batch: int = 1, repeat: int = 20) -> float:
    """GB/s of bf16 GEMVs (`batch` rows of activations) reading `weights` one after another."""
    x = torch.randn(batch, weights[0].shape[1], dtype=weights[0].dtype, device="cuda")

    def run():
        for w in weights:
            torch.nn.functional.linear(x, w)
    return sum(w.nbytes for w in weights) / _median_ms(run, repeat) / 1e6


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
    return sum(w.nbytes for w in weights) / _median_ms(graph.replay, repeat=50) / 1e6


STAGE_TOKENS = (32, 64, 128, 192, 256, 384, 512, 1024)


def matmul_tflops(tokens: int = 4096, nbytes: int = 8 * 14336 * 4096 * 2) -> float:
    """bf16 GEMMs of `tokens` rows over weights in GPU memory, 10^12 FLOP/s."""
    weights = mlp_weights(random_bytes(nbytes))
    x = torch.randn(tokens, weights[0].shape[1], dtype=torch.bfloat16, device="cuda")
    ms = _median_ms(lambda: [torch.nn.functional.linear(x, w) for w in weights], repeat=10)
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
            in_place = _median_ms(lambda: [torch.nn.functional.linear(x, w) for w in pinned], repeat=7)
            out[m] = (in_place, _median_ms(copied, repeat=7))
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


class _StepClock:
    """A stopping criterion that never stops: it notes the wall time of every decode step."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _tiny_llama(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()


def _tiny_moe(layers: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_experts=8, num_experts_per_tok=2, num_hidden_layers=layers, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, decoder_sparse_step=1,
                            mlp_only_layers=[])
    model = Qwen3MoeForCausalLM(config).to("cuda", torch.bfloat16).eval()
    model.set_experts_implementation("batched_mm")
    return model


def _replayed_step_us(model, repeat: int = 20) -> float:
    """A batch-1 decode step with a static cache captured in a CUDA graph: the median replay, µs."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=256)  # each call writes a position: room for all
    token = torch.ones(1, 1, dtype=torch.long, device="cuda")
    pos = torch.tensor([4], device="cuda")

    def step():
        return model(token, past_key_values=cache, cache_position=pos).logits
    with torch.no_grad():
        model(torch.ones(1, 4, dtype=torch.long, device="cuda"), past_key_values=cache,
              cache_position=torch.arange(4, device="cuda"))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capturing stream, as CUDA graphs require
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()

        def replays():
            for _ in range(5):
                graph.replay()
        return _median_ms(replays, repeat=repeat) * 1e3 / 5


def replay_us_by_layers(make, counts=LAYER_COUNTS) -> dict[int, float]:
    """Median graph-replayed decode step (µs) of the tiny models `make(layers)` builds, per layer count."""
    return {n: _replayed_step_us(make(n)) for n in counts}


def _median_step_us(model, steps: int) -> float:
    """One greedy `generate` of `steps` tokens at batch 1: the median wall time between decode steps."""
    from transformers import StoppingCriteriaList

    clock = _StepClock()
    ids = torch.ones(1, 4, dtype=torch.long, device="cuda")
    with torch.no_grad():
        model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0,
                       stopping_criteria=StoppingCriteriaList([clock]))
    return statistics.median(b - a for a, b in zip(clock.times, clock.times[1:])) * 1e6


def step_us_by_layers(counts=LAYER_COUNTS, rounds: int = 7, steps: int = 32) -> dict[int, float]:
    """Median eager decode step (µs) of tiny transformers Llamas with `counts` layers.

    The models take turns, round after round, and each count's figure is the
    median over rounds: a busy spell of the machine then touches every count a
    little rather than one count a lot (which would bend the line).
    """
    models = {n: _tiny_llama(n) for n in counts}
    for model in models.values():
        _median_step_us(model, 4)  # warm-up
    per_round: dict[int, list[float]] = {n: [] for n in counts}
    for _ in range(rounds):
        for n, model in models.items():
            per_round[n].append(_median_step_us(model, steps))
    return {n: statistics.median(v) for n, v in per_round.items()}


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least squares y = a + b x: (a, b, R^2)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    total = sum((y - my) ** 2 for y in ys)
    residual = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys))
    return a, b, 1 - residual / total if total else 1.0


def calibrate() -> Calibration:
    if not torch.cuda.is_available():
        raise OffplanError("plan calibrate measures a GPU: no CUDA device here")
    name = torch.cuda.get_device_name()
    warm_up()
    h2d = h2d_copy_gbps()
    uva = uva_gbps()
    hbm = hbm_gbps()
    tflops = matmul_tflops()
    crossover = stage_crossover()
    steps = step_us_by_layers()
    per_step, per_layer, r2 = fit_line(list(steps), list(steps.values()))
    replayed = {"dense": replay_us_by_layers(_tiny_llama), "moe": replay_us_by_layers(_tiny_moe)}
    gpu_step, gpu_layer, r2_dense = fit_line(list(replayed["dense"]), list(replayed["dense"].values()))
    _, gpu_moe_layer, r2_moe = fit_line(list(replayed["moe"]), list(replayed["moe"].values()))
    for what, times, fit, slope in (("eager decode step", steps, r2, per_layer),
                                    ("replayed dense decode step", replayed["dense"], r2_dense, gpu_layer),
                                    ("replayed MoE decode step", replayed["moe"], r2_moe, gpu_moe_layer)):
        if fit < MIN_R2 or slope <= 0:
            measured = ", ".join(f"{n} layers {us:.0f} us" for n, us in times.items())
            raise OffplanError(f"calibration failed: {what} times do not grow linearly with the layer "
                               f"count ({measured}; R^2 {fit:.3f} < {MIN_R2}); something else is loading this "
                               "machine's CPU or GPU: run `plan calibrate` again when it is idle")
    in_place = ", ".join(f"{m}: {a / b:.2f}" for m, (a, b) in crossover.items())
    hw = Hardware(name, round(h2d, 1), round(uva, 1), round(hbm), round(per_layer, 1), round(max(per_step, 0.0), 1),
                  matmul_tflops=round(tflops, 1), stage_above_tokens=stage_above(crossover),
                  layer_gpu_us=round(gpu_layer, 1), moe_layer_gpu_us=round(gpu_moe_layer, 1),
                  step_gpu_us=round(max(gpu_step, 0.0), 1),
                  measured=f"plan calibrate, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; "
                           f"CPU line R^2 {r2:.4f} over {len(steps)} layer counts, replayed GPU lines R^2 "
                           f"{r2_dense:.4f} (dense), {r2_moe:.4f} (MoE); uva GEMM in place / copied "
                           f"first, by tokens: {in_place}")
    return Calibration(hw, steps, r2, crossover, replayed)
