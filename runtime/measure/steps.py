"""Time per decode step by layer count, for `plan calibrate` (calibrate.py says why): eager `generate` of tiny
transformers Llamas and eager steps of the runtime's generation over tiny Qwen3-MoE models whose experts run
offplan's experts implementation (the CPU's launch cost), graph-replayed steps of tiny Llamas and Qwen3-MoE
models (the GPU's time per kernel beyond reading weights), and the least-squares line through them.
"""
from __future__ import annotations

import statistics
import time

import torch

from ..execute import experts
from ..execute.generation import PlainHandle
from .bandwidth import median_ms

LAYER_COUNTS = (2, 4, 8, 16, 32)


class _StepClock:
    """A stopping criterion that never stops: it notes the wall time of every decode step."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def tiny_llama(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()


def tiny_moe(layers: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_experts=8, num_experts_per_tok=2, num_hidden_layers=layers, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, decoder_sparse_step=1,
                            mlp_only_layers=[])
    model = Qwen3MoeForCausalLM(config).to("cuda", torch.bfloat16).eval()
    model.set_experts_implementation("batched_mm")
    return model


def tiny_moe_offloaded(layers: int):
    """`tiny_moe` whose experts run offplan's experts implementation as they do for experts in pinned memory:
    each bound with no resident rows, so every forward gathers its experts' rows (experts.py), here from HBM
    (the same kernels and CPU time; the rows are so small that the link would not matter)."""
    model = tiny_moe(layers)
    experts.register()
    for module in model.modules():
        if experts.supports(module):
            for name in experts.fused_params(module):
                full = getattr(module, name)
                experts.bind(module, name, full[:0], torch.full((module.num_experts,), -1, dtype=torch.int32,
                                                                  device=full.device))
    model.set_experts_implementation("offplan")
    return model


def generator_step_us_by_layers(make, counts=LAYER_COUNTS[:4], rounds: int = 10, steps: int = 12
                                ) -> tuple[dict[int, float], float]:
    """Eager decode step (µs) of the runtime's generation (what `plan apply --eager` runs) over the tiny
    models `make(layers)`, by layer count: each call's mean step, the fastest of the rounds that the models take
    in turn, and how much slower the median round ran (`fastest`)."""
    generators = {n: PlainHandle(make(n)).generator(eager=True) for n in counts}
    prompt = [[1, 2, 3, 4]]
    for generator in generators.values():
        generator.prepare(prompt, steps + 1)
    per_round: dict[int, list[float]] = {n: [] for n in counts}
    for _ in range(rounds):
        for n, generator in generators.items():
            got = generator(prompt, steps + 1)
            per_round[n].append(got.decode_s / got.decode_steps * 1e6)
    return fastest(per_round)


def fastest(per_round: dict[int, list[float]]) -> tuple[dict[int, float], float]:
    """Each layer count's fastest round, and the largest ratio of a count's median round to its fastest.

    Why the fastest: the eager figures are the CPU's time to launch kernels, and the H100 machine's host
    CPU runs in phases, seconds to a minute long, in which all of it is about 1.4-1.9x slower (eager steps, the
    host kernel and the hand-over alike; docs/calibration/). Four probes' medians of rounds gave a per-layer
    launch cost 64% apart, their fastest rounds 29% (and the MoE layer's 37% and 15%): noise only ever adds
    time, so the fastest round is the figure a calibration repeats. The ratio says how slow the phases were.
    """
    best = {n: min(v) for n, v in per_round.items()}
    return best, max(statistics.median(v) / best[n] for n, v in per_round.items())


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
        return median_ms(replays, repeat=repeat) * 1e3 / 5


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


def step_us_by_layers(counts=LAYER_COUNTS, rounds: int = 14, steps: int = 16) -> tuple[dict[int, float], float]:
    """Eager decode step (µs) of tiny transformers Llamas with `counts` layers: each round's median step, the
    fastest round per count, and the median round's slowdown (`fastest`).

    The models take turns, round after round, so that a slow spell of the
    machine touches every count a little rather than one count a lot (which
    would bend the line), and short rounds, so that each count has some
    rounds outside it.
    """
    models = {n: tiny_llama(n) for n in counts}
    for model in models.values():
        _median_step_us(model, 4)  # warm-up
    per_round: dict[int, list[float]] = {n: [] for n in counts}
    for _ in range(rounds):
        for n, model in models.items():
            per_round[n].append(_median_step_us(model, steps))
    return fastest(per_round)


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least squares y = a + b x: (a, b, R^2)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    total = sum((y - my) ** 2 for y in ys)
    residual = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys))
    return a, b, 1 - residual / total if total else 1.0
