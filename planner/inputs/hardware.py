"""Hardware profiles: the bandwidths and overheads the cost model predicts with.

`plan calibrate` measures them on a GPU and writes a profile YAML; a policy
names one with `hardware: h100.yaml`. Without one, the H100 figures below are
used: the copy and UVA bandwidths given for this project's H100 (PCIe Gen5)
machine, and its GEMM rate, staging threshold and GPU time per layer as `plan
calibrate` measured them there (665 TFLOP/s at 4096 tokens; in-place GEMMs
1.06x a copy up to 192 tokens, 2.1x at 256; replayed decode steps of tiny
models: 76.4 us per dense layer, 120.9 us per MoE layer, 45.9 us per step);
the HBM and CPU figures are estimates (`plan calibrate`
there measured 2470-2750 GB/s HBM reads and 590-1520 us of CPU time per layer,
run to run), and so are the figures of experts on cpu, from the host's read
rates measured there with 15 threads (`plan calibrate` measures them on its
own machine, with its cores less one).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ..errors import HardwareProfileError
from . import yamlio
from .schema import validate


# The host kernel's rate with host memory to itself over its rate while the GPU reads over uva: the 22 calibrations
# on record that measured both (H100 and H200 machines; docs/calibration/, benchmarks/results/) gave 1.09-1.40,
# median 1.2
CPU_ALONE = 1.2


@dataclass(frozen=True)
class Hardware:
    name: str
    h2d_copy_gbps: float  # pinned host -> GPU copies (prefetch)
    uva_read_gbps: float  # kernels reading pinned host memory in place (uva)
    hbm_read_gbps: float  # kernels reading resident weights
    layer_overhead_us: float  # CPU time (launches, framework) per decoder layer per step
    step_overhead_us: float = 0.0  # CPU time per step outside the layers (sampling, cache bookkeeping)
    matmul_tflops: float = 665.0  # bf16 GEMM rate at prefill (large M), for the prefill prediction
    stage_above_tokens: int = 192  # GEMM tokens above which a GEMM re-reads an in-place uva weight per tile
    # GPU time per prompt token per decoder layer at prefill besides its GEMMs and attention (eager norms, rotary
    # embeddings, activations; with routed experts, their sorts, gathers and masks), dense and MoE: what a Llama-3.1-8B
    # prefill of 8192 tokens on an H100 took beyond the rest of its prediction, and what a profile of a Qwen3-30B-A3B
    # one on an H200 spent in those kernels (planner/decide/cost.py); `plan calibrate` does not measure them
    prefill_token_ns: float = 357.0
    moe_prefill_token_ns: float = 335.0
    # GPU time per decode step beyond reading weights (kernel launch latency, tiny grids), at batch 1:
    layer_gpu_us: float = 0.0  # per dense decoder layer
    moe_layer_gpu_us: float = 0.0  # per decoder layer with routed experts
    step_gpu_us: float = 0.0  # per step, outside the layers
    # CPU time per decoder layer with routed experts in an eager step of the runtime's generation (0: a dense
    # layer's): a router, top-k and the experts' forward launch two to three times a dense layer's kernels
    moe_layer_overhead_us: float = 0.0
    # the calibration's eager rounds, their median over their fastest: the launch figures above are the fastest
    # round's (the figure a calibration repeats: runtime/measure/steps.py `fastest`), and a typical eager step runs
    # this much slower, the host's slower phases included (1.22 on the H100 machine); the cost model's eager CPU
    # time is the launch figures times this. 1: figures of a median round (profiles before it)
    eager_median_ratio: float = 1.0
    # several GPUs (tensor parallelism): one all-reduce of a few tokens' activations in a replayed graph, the
    # bandwidth of large ones (bytes summed per us beyond the latency), each GPU's H2D copies while all copy
    allreduce_us: float = 9.7
    allreduce_gbps: float = 240.0
    parallel_h2d_copy_gbps: float = 49.0
    # routed experts on cpu, as the runtime computes them (runtime/execute/host/native.cpp): the touched experts'
    # bytes per second while the GPU reads others over uva, its threads, and a cost per MoE layer's call (the
    # hand-over: copies, host node, the outputs' copy). Fitted on the H100 machine's 16-core host, 15 threads
    # (benchmarks/results/moe-cpu-qwen3-30b-a3b-run3.jsonl, docs/host-experts/predict_recorded.py): the host's
    # time per call 16 us + bytes at 75 GB/s; 100 us per call puts 11 of the 12 rows' steps within 20%. `plan
    # calibrate` measures all three on the machine it runs on (runtime/measure/host.py).
    cpu_expert_gbps: float = 75.0
    cpu_threads: int = 15
    cpu_expert_sync_us: float = 100.0
    # the GPU's UVA reads while the host's cores read host memory too (a layer split between uva and cpu): 0 takes
    # uva_read_gbps x 47.0/50.3, as the H100 machine read with and without 16 cores reading beside (issue 24)
    uva_read_beside_cpu_gbps: float = 0.0
    # the host kernel's rate in a layer with no expert on uva (every one of its experts off the GPU on cpu), where
    # the cores have host memory to themselves: 0 takes cpu_expert_gbps x CPU_ALONE (profiles before `plan calibrate`
    # measured it, and the built-in one)
    cpu_expert_alone_gbps: float = 0.0
    # the host threads the three cpu figures above were measured with (`plan calibrate`: its cpu_threads; the built-in
    # figures: 15), written in every profile. 0 at construction: cpu_threads. A profile whose cpu_threads was changed
    # after keeps this, and a plan with experts on cpu warns (decide/build.py `threads_warning`)
    cpu_rates_threads: int = 0
    measured: str = ""

    def __post_init__(self):
        if not self.cpu_rates_threads:
            object.__setattr__(self, "cpu_rates_threads", self.cpu_threads)

    @property
    def uva_beside_cpu_gbps(self) -> float:
        """`uva_read_beside_cpu_gbps`, or its default: uva_read_gbps x 47.0/50.3 (the field's comment)."""
        return self.uva_read_beside_cpu_gbps or self.uva_read_gbps * 47.0 / 50.3

    @property
    def cpu_alone_gbps(self) -> float:
        """`cpu_expert_alone_gbps`, or its default: cpu_expert_gbps x CPU_ALONE (the field's comment)."""
        return self.cpu_expert_alone_gbps or self.cpu_expert_gbps * CPU_ALONE

    def one_of(self, gpus: int) -> "Hardware":
        """One GPU's process of `gpus` that share one host (tensor parallelism): its link copies at
        `parallel_h2d_copy_gbps` while the others copy too, and its experts on cpu get its share of the host:
        `cpu_threads // gpus` threads, which read the profile's rates (`cpu_expert_gbps`, `cpu_expert_alone_gbps`)
        times their share of its threads, since every process's threads read the one host memory at once. Limits:
        the host's share is even, not measured per process count; with fewer threads than GPUs a process gets
        none, and build refuses experts on cpu then (decide/build.py)."""
        if gpus <= 1:
            return self
        threads = self.cpu_threads // gpus
        share = threads / self.cpu_threads if self.cpu_threads else 0.0
        return dataclasses.replace(self, h2d_copy_gbps=self.parallel_h2d_copy_gbps, cpu_threads=threads,
                                   cpu_rates_threads=threads, cpu_expert_gbps=self.cpu_expert_gbps * share,
                                   cpu_expert_alone_gbps=self.cpu_expert_alone_gbps * share)


H100 = Hardware(
    name="NVIDIA H100 80GB HBM3 (PCIe Gen5 host link)",
    h2d_copy_gbps=55.0,
    uva_read_gbps=50.8,
    hbm_read_gbps=2900.0,
    layer_overhead_us=800.0,
    step_overhead_us=0.0,
    layer_gpu_us=76.4,
    moe_layer_gpu_us=120.9,
    step_gpu_us=45.9,
    moe_layer_overhead_us=1900.0,
    measured="built-in defaults: H2D copy, UVA GEMV, GPU time per layer and CPU time per MoE layer measured on "
             "the project's H100; HBM and the other CPU overheads are estimates until `plan calibrate` runs; "
             "all-reduce latency and bandwidth and H2D copies of two GPUs at once measured on two NVLinked H200s "
             "of the same kind of host",
)


_CORE = ("h2d_copy_gbps", "uva_read_gbps", "hbm_read_gbps", "layer_overhead_us")  # every calibrated profile's


def load_hardware(path: str | Path) -> Hardware:
    """Read and validate a profile written by `plan calibrate`, or by hand with some figures only (each left out
    is the built-in H100 profile's: a machine without a GPU to calibrate sets `cpu_threads`, say); errors name
    file:line:column."""
    path = Path(path)
    doc = yamlio.parse(path, yamlio.read(path, HardwareProfileError, "hardware profile"), HardwareProfileError)
    wrong = yamlio.wrong_kind(path, doc.data, "hardware profile")
    if wrong:
        raise HardwareProfileError(wrong)
    validate(doc, "hardware.schema.json", HardwareProfileError, f"{path}: the hardware profile is invalid")
    d = doc.data
    if not all(k in d for k in _CORE):  # written by hand, some figures only: the built-in ones with those in place
        given = {k: type(getattr(H100, k))(v) for k, v in d.items()  # an int or a float, as the built-in one's
                 if hasattr(H100, k) and k not in ("name", "measured")}
        measured = d.get("measured", f"{path.name}: {', '.join(given) or 'no figure'}; the rest {H100.measured}")
        derived = {}  # figures that go with a given one, as a calibrated profile's do (its loading, below)
        if "h2d_copy_gbps" in given and "parallel_h2d_copy_gbps" not in given:  # shared as the built-in figures are
            derived["parallel_h2d_copy_gbps"] = given["h2d_copy_gbps"] * (H100.parallel_h2d_copy_gbps
                                                                          / H100.h2d_copy_gbps)
        if "layer_overhead_us" in given and "moe_layer_overhead_us" not in given:  # 0: a dense layer's, the given
            derived["moe_layer_overhead_us"] = 0.0
        if "cpu_rates_threads" not in given and "cpu_expert_gbps" in given:  # the rate given: its threads'
            derived["cpu_rates_threads"] = given.get("cpu_threads", H100.cpu_threads)
        return dataclasses.replace(H100, name=d["name"], **given, **derived, measured=measured)
    return Hardware(d["name"], float(d["h2d_copy_gbps"]), float(d["uva_read_gbps"]),
                    float(d["hbm_read_gbps"]), float(d["layer_overhead_us"]),
                    step_overhead_us=float(d.get("step_overhead_us", 0.0)),
                    matmul_tflops=float(d.get("matmul_tflops", H100.matmul_tflops)),
                    stage_above_tokens=int(d.get("stage_above_tokens", H100.stage_above_tokens)),
                    prefill_token_ns=float(d.get("prefill_token_ns", H100.prefill_token_ns)),
                    moe_prefill_token_ns=float(d.get("moe_prefill_token_ns", H100.moe_prefill_token_ns)),
                    layer_gpu_us=float(d.get("layer_gpu_us", H100.layer_gpu_us)),
                    moe_layer_gpu_us=float(d.get("moe_layer_gpu_us", H100.moe_layer_gpu_us)),
                    step_gpu_us=float(d.get("step_gpu_us", H100.step_gpu_us)),
                    moe_layer_overhead_us=float(d.get("moe_layer_overhead_us", 0.0)),
                    eager_median_ratio=float(d.get("eager_median_ratio", 1.0)),
                    allreduce_us=float(d.get("allreduce_us", H100.allreduce_us)),
                    allreduce_gbps=float(d.get("allreduce_gbps", H100.allreduce_gbps)),
                    # absent: the profile's own copy bandwidth, shared as the built-in figures share it
                    parallel_h2d_copy_gbps=float(d.get("parallel_h2d_copy_gbps", float(d["h2d_copy_gbps"])
                                                       * H100.parallel_h2d_copy_gbps / H100.h2d_copy_gbps)),
                    cpu_expert_gbps=float(d.get("cpu_expert_gbps", H100.cpu_expert_gbps)),
                    cpu_threads=int(d.get("cpu_threads", H100.cpu_threads)),
                    cpu_expert_sync_us=float(d.get("cpu_expert_sync_us", H100.cpu_expert_sync_us)),
                    uva_read_beside_cpu_gbps=float(d.get("uva_read_beside_cpu_gbps", 0.0)),
                    cpu_expert_alone_gbps=float(d.get("cpu_expert_alone_gbps", 0.0)),
                    # absent: its cpu_threads where it gives the rate (as `plan calibrate` wrote profiles before
                    # the key), else the built-in rate's 15
                    cpu_rates_threads=int(d.get("cpu_rates_threads", 0 if "cpu_expert_gbps" in d
                                                else H100.cpu_threads)),
                    measured=d.get("measured", ""))


def dumps_hardware(hw: Hardware) -> str:
    return (f"# offplan hardware profile, written by `plan calibrate`\nformat_version: 1\n"
            f"name: {yamlio.quote(hw.name)}\nh2d_copy_gbps: {hw.h2d_copy_gbps:.1f}\n"
            f"uva_read_gbps: {hw.uva_read_gbps:.1f}\nhbm_read_gbps: {hw.hbm_read_gbps:.0f}\n"
            f"layer_overhead_us: {hw.layer_overhead_us:.1f}\nstep_overhead_us: {hw.step_overhead_us:.1f}\n"
            f"matmul_tflops: {hw.matmul_tflops:.1f}\nstage_above_tokens: {hw.stage_above_tokens}\n"
            f"layer_gpu_us: {hw.layer_gpu_us:.1f}\nmoe_layer_gpu_us: {hw.moe_layer_gpu_us:.1f}\n"
            f"step_gpu_us: {hw.step_gpu_us:.1f}\nmoe_layer_overhead_us: {hw.moe_layer_overhead_us:.1f}\n"
            f"allreduce_us: {hw.allreduce_us:.1f}\nallreduce_gbps: {hw.allreduce_gbps:.1f}\n"
            f"parallel_h2d_copy_gbps: {hw.parallel_h2d_copy_gbps:.1f}\n"
            f"cpu_expert_gbps: {hw.cpu_expert_gbps:.1f}\ncpu_threads: {hw.cpu_threads}\n"
            f"cpu_expert_sync_us: {hw.cpu_expert_sync_us:.1f}\n"
            + (f"uva_read_beside_cpu_gbps: {hw.uva_read_beside_cpu_gbps:.1f}\n" if hw.uva_read_beside_cpu_gbps else "")
            + (f"cpu_expert_alone_gbps: {hw.cpu_expert_alone_gbps:.1f}\n" if hw.cpu_expert_alone_gbps else "")
            + f"cpu_rates_threads: {hw.cpu_rates_threads}\n"
            + (f"eager_median_ratio: {hw.eager_median_ratio:.2f}\n" if hw.eager_median_ratio != 1.0 else "")
            + (f"prefill_token_ns: {hw.prefill_token_ns:.1f}\n" if hw.prefill_token_ns != H100.prefill_token_ns else "")
            + (f"moe_prefill_token_ns: {hw.moe_prefill_token_ns:.1f}\n"
               if hw.moe_prefill_token_ns != H100.moe_prefill_token_ns else "")
            + f"measured: {yamlio.quote(hw.measured)}\n")
