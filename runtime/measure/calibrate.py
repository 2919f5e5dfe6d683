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
  forwards above it (runtime/execute/prefill.py), and below it decode keeps its
  zero-copy reads;
- CPU overhead: eager HF `generate` of tiny transformers Llamas (tensors so
  small that the GPU always waits for the CPU) with 2, 4, 8, 16 and 32 layers.
  The wall time of every decode step is taken inside `generate` (a stopping
  criterion is called once per step). The models take turns over 14 short
  rounds; each one's fastest round's median step is fitted by least squares
  to `step = per_step + per_layer x layers` (the fastest, since this host's
  CPU runs in slower phases that only add time: steps.fastest; the profile's
  eager_median_ratio says how much slower the median round was, which the
  cost model's eager steps take on). `per_layer` is the CPU time
  to launch one decoder layer's kernels through the framework; `per_step` is
  what a step costs outside the layers (embedding, head, sampling, cache
  bookkeeping). The line must explain the times (R^2 >= 0.95), or
  calibration fails: the CPU was busy with something else;
- CPU overhead of a layer with routed experts (`moe_layer_overhead_us`): eager
  steps of the runtime's own generation (what `plan apply --eager` runs) over
  tiny Qwen3-MoE models with 2 to 16 layers whose experts run offplan's
  experts implementation as for experts in pinned memory, fitted the same way
  (the slope, through each count's fastest of 10 rounds). Such a layer launches
  a router, top-k and the gathers besides attention: about twice a dense
  layer's CPU time on the H100 machine;
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

- experts on cpu (host.py): the rate of the runtime's host kernel beside
  the GPU's UVA reads and alone, its fixed cost per call, and a layer's
  hand-over (`cpu_expert_gbps`, `cpu_expert_alone_gbps`,
  `cpu_expert_sync_us`), with `cpu_threads` threads: those asked
  (`plan calibrate --cpu-threads N`), else the cores less one. They are
  measured in rounds, one after each of the measurements above, so that the
  rounds span the calibration's minute and the host CPU's slow phases (which
  last seconds) cannot take them all: each point keeps its fastest round
  (host.py). Where the kernel is not built, the built-in figures, and the
  profile says so.

Limits: the per-layer figures are a Llama layer's and a Qwen3-MoE layer's at
batch 1; a layer that launches more kernels (transformers' eager MoE expert
loop, shared experts) costs more per layer, and larger batches run larger
kernels.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from planner.errors import OffplanError
from planner.inputs.hardware import H100, Hardware

from ..execute.host import native

from .bandwidth import h2d_copy_gbps, hbm_gbps, matmul_tflops, stage_above, stage_crossover, uva_gbps, warm_up
from .host import HostRounds, check_threads
from .steps import (fit_line, generator_step_us_by_layers, replay_us_by_layers, step_us_by_layers, tiny_llama,
                    tiny_moe, tiny_moe_offloaded)

MIN_R2 = 0.95


@dataclass(frozen=True)
class Calibration:
    hardware: Hardware
    step_us_by_layers: dict[int, float]  # eager decode step of the tiny Llamas, their fastest round's median
    r2: float  # of the per-layer line through them
    stage_ms: dict[int, tuple[float, float]]  # tokens -> (uva GEMMs in place, copied first), ms (stage_crossover)
    replay_us_by_layers: dict[str, dict[int, float]]  # "dense" / "moe" -> layers -> replayed decode step, us
    moe_step_us_by_layers: dict[int, float]  # eager step of the runtime's generation over the tiny MoE models


def calibrate(cpu_threads: int | None = None) -> Calibration:
    """Measure (module doc); `cpu_threads`: the host kernel's threads (None: the cores this process may run on,
    less one); more than those cores is an error before anything is measured."""
    check_threads(cpu_threads)
    if not torch.cuda.is_available():
        raise OffplanError("plan calibrate measures a GPU: no CUDA device here")
    name = torch.cuda.get_device_name()
    warm_up()
    rounds = HostRounds.start(cpu_threads)
    host_round = rounds.round if rounds is not None else lambda: None
    h2d = h2d_copy_gbps()
    host_round()
    uva = uva_gbps()
    hbm = hbm_gbps()
    host_round()
    tflops = matmul_tflops()
    crossover = stage_crossover()
    host_round()
    steps, slow = step_us_by_layers()
    host_round()
    per_step, per_layer, r2 = fit_line(list(steps), list(steps.values()))
    moe_steps, moe_slow = generator_step_us_by_layers(tiny_moe_offloaded)
    host_round()
    _, moe_per_layer, r2_moe_cpu = fit_line(list(moe_steps), list(moe_steps.values()))
    slowdown = max(slow, moe_slow)  # the eager rounds' median against their fastest (steps.fastest)
    replayed = {"dense": replay_us_by_layers(tiny_llama)}
    host_round()
    replayed["moe"] = replay_us_by_layers(tiny_moe)
    host_round()
    gpu_step, gpu_layer, r2_dense = fit_line(list(replayed["dense"]), list(replayed["dense"].values()))
    _, gpu_moe_layer, r2_moe = fit_line(list(replayed["moe"]), list(replayed["moe"].values()))
    for what, times, fit, slope in (("eager decode step", steps, r2, per_layer),
                                    ("eager MoE decode step", moe_steps, r2_moe_cpu, moe_per_layer),
                                    ("replayed dense decode step", replayed["dense"], r2_dense, gpu_layer),
                                    ("replayed MoE decode step", replayed["moe"], r2_moe, gpu_moe_layer)):
        if fit < MIN_R2 or slope <= 0:
            measured = ", ".join(f"{n} layers {us:.0f} us" for n, us in times.items())
            raise OffplanError(f"calibration failed: {what} times do not grow linearly with the layer "
                               f"count ({measured}; R^2 {fit:.3f} < {MIN_R2}); something else is loading this "
                               "machine's CPU or GPU: run `plan calibrate` again when it is idle")
    in_place = ", ".join(f"{m}: {a / b:.2f}" for m, (a, b) in crossover.items())
    host = rounds.figures() if rounds is not None else None
    cpu = {} if host is None else host.profile_fields()
    cpu_note = (f"experts on cpu: the host kernel's {host.threads} threads ({host.isa}) read {host.gbps:.1f} GB/s "
                f"beside UVA reads (fit R^2 {host.r2:.3f}), {host.alone_gbps:.1f} GB/s with the GPU idle, "
                f"{host.fixed_us:.0f} us a call + {host.handover_us:.0f} us a layer's hand-over (each point's "
                f"fastest of {host.rounds} rounds; the median round {host.slowdown:.2f}x slower)"
                if host is not None else
                f"experts on cpu: built-in figures ({native.why_not})")
    hw = Hardware(name, round(h2d, 1), round(uva, 1), round(hbm), round(per_layer, 1), round(max(per_step, 0.0), 1),
                  matmul_tflops=round(tflops, 1), stage_above_tokens=stage_above(crossover),
                  layer_gpu_us=round(gpu_layer, 1), moe_layer_gpu_us=round(gpu_moe_layer, 1),
                  step_gpu_us=round(max(gpu_step, 0.0), 1), moe_layer_overhead_us=round(moe_per_layer, 1),
                  eager_median_ratio=round(max(slowdown, 1.0), 2),  # a typical eager step: hardware.py
                  # one GPU measured: its copies while others copy too scaled as the built-in figures' are;
                  # the all-reduce figures stay the built-in ones
                  parallel_h2d_copy_gbps=round(h2d * H100.parallel_h2d_copy_gbps / H100.h2d_copy_gbps, 1), **cpu,
                  measured=f"plan calibrate, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; "
                           "all-reduce and several-GPU copy figures built in, not measured; "
                           f"CPU lines R^2 {r2:.4f} (dense) and {r2_moe_cpu:.4f} (MoE) through each layer count's "
                           f"fastest round (the median round {slowdown:.2f}x slower), replayed GPU lines "
                           f"R^2 "
                           f"{r2_dense:.4f} (dense), {r2_moe:.4f} (MoE); uva GEMM in place / copied "
                           f"first, by tokens: {in_place}; {cpu_note}")
    return Calibration(hw, steps, r2, crossover, replayed, moe_steps)
