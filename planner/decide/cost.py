"""The cost model: bytes over the host link and time per decode step, and the prefill, predicted from a placement.

Roles say what fraction of a tensor one decode step (one new token per sequence, batch b) reads:
- expert: a member of a fused expert group (see groups.py). Routing picks expert e for a token with probability p_e, so
  a step of b tokens reads it with probability 1 - (1 - p_e)^b. With a routing profile (routing.py), p_e is the
  expert's share of the profile's decode tokens (decode hits / decode tokens: top-k routing makes them add up to k);
  without one, routing is assumed uniform, p_e = k/E for each of a layer's E experts. A tensor that holds every expert
  at once (prefused.py: GPT-OSS, Llama 4; its first dimension the E experts) reads each expert's row with that
  probability: the mean of 1 - (1 - p_e)^b over its rows, 1 - (1 - k/E)^b of its bytes if uniform (gpt-oss-120b: 1/32);
- embedding: a 2-D tensor of an embedding module: b of its V rows per step (the head reads a tied one whole);
- dense: everything else, read whole every step.
Rules may override a role (`rules: [{match: [lm_head], role: dense}]`).
Only what runs in every decode step counts (graph.py `Runs`): a vision tower runs only in the prefill of a prompt
with images, an MTP layer never in plain decode, so wherever they live they cost a decode step nothing.

Time per step: three resources work at once, and the slowest sets the pace.
    cpu  = (step overhead + stack layers x layer overhead) x eager_median_ratio + host time (experts on cpu, below)
           (eager launches; a MoE layer: its own figure; 0 when steps replay a CUDA graph, its eager figure kept)
    gpu  = step GPU time + stack layers x layer GPU time   (kernel latency: hardware.py)
           + resident and prefetched bytes read / HBM + uva bytes read / UVA
    link = uva bytes read / UVA + prefetched bytes / H2D copy
    step = max(cpu, gpu, link)
The CPU runs ahead of the GPU, so launch overhead overlaps kernels. A layer's GPU time is what its kernels take
beyond reading weights, measured by `plan calibrate` (a decoder layer with routed experts launches more kernels than
a dense one, so it has its own figure); without it a CUDA-graph step of small kernels is predicted several times too
fast. UVA reads sit inside the kernels that need them, so they count as GPU time; prefetch copies run on their own
stream ahead of use, so they do not. Both cross the same PCIe link, so the link term adds them. An experts forward
that stages its touched experts (runtime/execute/experts.py: any expert of the layer in pinned memory, or at most
BATCHED_PAIRS (token, expert) pairs, where batched_mm's arithmetic runs) writes them to HBM and reads them back:
twice their bytes more over HBM, taking twice that time where it gathers them from HBM: a factor fitted to four
recorded runs (front-door a-d: all-GPU Qwen3-30B-A3B decode at batch 1 measured 0.76x its prediction without it on
H200s, 0.84x on H100s; 0.90x and 1.02x with it); over UVA the writes hide behind the link's reads. FP8 experts at
more than one token are staged dequantized wherever they lie (fp8_gather.py): bf16, written and read back, 4x their
bytes (at one token the rule above; MXFP4's is not counted: at one token gemv.py multiplies its stored bytes).

Prefill (the time to first token) of `workload.prompt_tokens` = T tokens, one sequence, over the layers that run
in every step. Reads in place through UVA sit inside the kernels that need them (a layer's touched experts are known
only once its router has run); copies run on their own stream, one layer's after another (schedule.py `pipelined`):
    compute  = (2 x T x (dense elements + each routed expert's elements x its share of the tokens) + causal
               attention's 2 x T^2 x query width + the head's last logits) / matmul_tflops + bytes read / HBM
               + T x (moe_)prefill_token_ns (a decoder layer's other kernels, below) + (uva bytes a GEMM reads in
               place x ceil(T / stage_above_tokens) + touched uva experts' bytes and embedding rows) / UVA
    copies   = prefetched and staged bytes / H2D, each layer's once the link is free and its buffer too: a prefetch
               slot once its last user has run, a staging slot as the staged layer before begins, the ring at once;
               the link carries copies and reads in place in turn, a layer's reads once it runs
    layer    : ends at max(the layer before's end, its copies done) + compute;  prefill = max(the last end, launch)
    launch   = the decoder layers' CPU overheads x eager_median_ratio (the prefill runs eagerly even where decode
               steps replay a graph; not the step's own, which the calibration measures in generate's loop)
(staged routed experts stream through a ring of at most 1 GiB, staging.py: assumed never to hold a copy back
while a layer computes). A routed expert computes its share of the tokens: k/E under uniform routing, or its
share of the routing profile's prefill tokens (its decode share when the profile has none), and is read at all with
probability 1 - (1 - share)^T: a layer reads E x (1 - (1 - k/E)^T) of its experts. offplan's experts implementation
gathers each touched expert once, wherever it lives. An embedding reads T rows and computes nothing. The uva tensors
that prefill stages (staging.py: not embeddings; routed experts only when the touched share computed here reaches
`stage_experts`'s) are copied once when T > stage_above_tokens; otherwise a GEMM reads them in place and re-reads
them once per tile of output rows, which the model approximates as ceil(T / stage_above_tokens) reads: 1 up to the
threshold, 3 at 512 tokens with the default 192 (measured on the H100: 2.1x a copy), 43 at 8192 (measured 24x:
predicted pessimistic). A short prompt is launch-bound (Llama-3.1-8B's at 128 and 512 tokens on the H100: 2.75x and
1.40x their prediction without the launch term, 0.91x and 0.90x with it).

Experts on cpu: the host reads each touched expert once (the share above), beside the GPU, which sums both: layer gpu =
E[max(its GPU time, layer GPU time + host)] as both vary with routing (reads.py `later`), host = those bytes /
cpu_expert_gbps (cpu_expert_alone_gbps where the layer has no expert on uva) + cpu_expert_sync_us (the hand-over and
the host's fixed cost; native.cpp, docs/host-experts/), its uva experts read at uva_read_beside_cpu_gbps. Eager, the
launches add each such layer's host time: the pool's threads and the launching one share the host (8 layers of
Qwen3-30B-A3B, H200: the all-uva eager step + 0.79 ms a layer measured, + 0.66 predicted: docs/front-door). FP8:
native.cpp converts each byte as it reads it, so the cores set the pace: an FP8 byte counts twice at the bf16 rate
(docs/fp8-cpu/). Prefill: staged (staging.py), copied and computed on the GPU; unstaged above the threshold, gathered
over uva as uva experts are (the runtime's host takes at most stage_above_tokens tokens); else host reads add.

Tensor parallelism (layers/shards.py): the tensors are one GPU's share, so every figure above is each GPU's, over its
own link, at once. A layer whose outputs the GPUs sum (an all-reduce: attention's o projection, the MLP or experts) or
gather (the head) waits for each such collective (`collectives`: a layer's count and bytes per token): the profile's
`allreduce_us` plus its bytes over `allreduce_gbps`, for the step's batch in the GPU time, the prompt's in the prefill.

Limits: the GPU time per layer is measured at batch 1 on tiny Llama and Qwen3-MoE layers
(runtime/measure/calibrate.py): a layer that launches more kernels (shared experts, MLA) takes longer, and so do the
larger kernels of larger batches (an all-GPU Qwen3-30B-A3B step at batch 8 measured 0.88x its prediction on the H200,
1.02x on the H100); without a routing profile, expert routing is assumed uniform (real routers are skewed, which
touches fewer experts); with one, the tokens of a batch are assumed routed independently of each other, as the
profile's prompts were; the overlap of prefetch is assumed perfect, so a plan whose offloaded layers sit together
(nothing to overlap with) is predicted optimistic. A decoder layer's other prefill kernels (norms, rotary
embeddings, activations; the experts' sorts and gathers) take (moe_)prefill_token_ns per token: built in, 357 ns (a
Llama-3.1-8B prefill, H100) and 335 (Qwen3-30B-A3B layers, H200: docs/moe-prefill/), not calibrated yet. Attention and
every GEMM run at matmul_tflops whatever their shape, and what runs only with images (vision towers) is left out.
"""
from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from itertools import compress
from operator import add, and_, mul

from ..inputs.checkpoint import TensorInfo
from ..inputs.hardware import Hardware
from ..inputs.quantized import FP8, partners
from ..inputs.routing import RoutingProfile
from ..layers.alike import Shapes
from ..layers.graph import Layer, LayerGraph
from ..layers.groups import BATCHED_PAIRS, FusedGroups
from ..plan import LayerKind, Placement, Role, Runs
from .reads import later, reads
from .schedule import pipelined
from .staging import Stageables, stage_experts

GPU, UVA, PREFETCH, CPU = Placement.GPU, Placement.UVA, Placement.PREFETCH, Placement.CPU


@dataclass(frozen=True)
class LayerCost:
    name: str
    h2d_bytes: int  # over the host link per step
    gpu_us: int  # HBM and UVA reads
    link_us: int
    prefill_us: int = 0  # its share of the prefill


@dataclass(frozen=True)
class Prediction:
    batch_size: int
    h2d_bytes: int
    cpu_us: int
    gpu_us: int
    link_us: int
    layers: tuple[LayerCost, ...]
    prompt_tokens: int = 0
    prefill_us: int = 0  # the time to first token for prompt_tokens
    collectives: int = 0  # all-reduces and all-gathers per step (tensor parallelism)
    collectives_us: int = 0  # their time per step, in gpu_us
    eager_cpu_us: int = 0  # cpu_us were the step eager: its launches (cpu_us itself, for an eager prediction)
    wheres: tuple = field(default=(), repr=False, compare=False)  # each layer's placements (None: in no step)
    step_us = property(lambda self: max(self.cpu_us, self.gpu_us, self.link_us))

    def request_us(self, new_tokens: int) -> int:
        """One request: its prefill, then `new_tokens` decode steps (what `backend: mixed` minimises)."""
        return self.prefill_us + new_tokens * self.step_us


class CostModel:
    """Predicts a placement's per-step traffic and time, and its prefill; built once per plan, asked many times."""

    def __init__(self, graph: LayerGraph, tensors: Mapping[str, TensorInfo], hw: Hardware, batch: int,
                 groups: FusedGroups, top_k: int | None, roles: Mapping[str, Role] | None = None,
                 routing: RoutingProfile | None = None, graphs: bool = False, *, prompt_tokens: int = 512,
                 stage: bool = True, quantized: Mapping[str, str] | None = None,
                 collectives: Mapping[str, tuple[int, int]] | None = None, shapes: Shapes | None = None,
                 prefetch_slots: int = 1):
        """`routing`: a profile that counts every group that runs in decode (routing.mismatches checks it); None:
        uniform routing over `top_k` of each group's experts. `prompt_tokens`: the prefill to predict; `stage`: the
        policy's `uva.stage_prefill`; `prefetch_slots`: its `prefetch.step`, the layers copied ahead (schedule.py);
        `quantized`: quantized.py `partners(tensors)`, when the caller has it; `collectives`: layer -> (collectives,
        bytes they move per token) under tensor parallelism (shards.py `collectives`); `shapes`: alike.py's, over
        `tensors`, when the caller has read them. The per-tensor facts are reads.py's."""
        self.graphs = graphs  # steps replayed from a CUDA graph: no CPU launch time
        self.graph = graph
        self.batched = top_k is not None and batch * top_k <= BATCHED_PAIRS  # batched_mm's: touched ones staged
        self.hw, self.batch, self.tokens, self.groups, self.tensors = hw, batch, prompt_tokens, groups, tensors
        self.facts = facts = reads(graph, tensors, groups, top_k, roles, routing, batch, prompt_tokens, shapes)
        self.shapes = facts.shapes  # each layer's dtypes and shapes, read once (alike.py), for the slot images
        self.experts = facts.experts  # layer -> its routed tensors (staged by the experts forward)
        # prefill: staged tensors are copied once above the threshold; GEMMs re-read in-place ones per tile.
        # Quantized ones are dequantized on access: read once, never staged (quantized.py)
        self.quantized = quantized = partners(tensors) if quantized is None else quantized
        self.stages = stages = stage and prompt_tokens > hw.stage_above_tokens
        self.stageable = Stageables(graph.layers, quantized)  # worked out where a placement stages (staging.py)
        routed, pre = [], []  # the routed tensors prefill may stage (staged_experts' extras), their prefill fractions
        for l in graph.layers if stages and self.stageable.routed else ():
            if l.runs is Runs.STEP and self.experts[l.name]:
                _, got, flags = facts.layers[l.name]
                mask = list(map(and_, flags, map(self.staged_experts.__contains__, l.params)))
                routed += compress(l.params, mask)
                pre += compress(got[2], mask)
        total = sum(sizes := [tensors[n].nbytes for n in routed])
        # the share of the routed bytes the prompt touches: whether prefill streams experts ahead (staging.py)
        touched = sum(map(mul, sizes, pre)) / total if total else 0.0
        self.favours_staged_experts = bool(stages and total and stage_experts(touched, hw))
        self._staging = None if not stages else int(self.favours_staged_experts)  # `staged`: none, or Stageables'
        self.reread = -(-prompt_tokens // hw.stage_above_tokens)
        self._layer_costs: dict[tuple, tuple] = {}  # (kind, placements, staged) -> a layer's cost (`_layer`)
        self.collectives, self.prefetch_slots = collectives or {}, prefetch_slots

    unstaged_experts = property(lambda self: self.stageable.both[0])
    staged_experts = property(lambda self: self.stageable.both[1])
    staged = property(lambda self: frozenset() if self._staging is None else self.stageable.both[self._staging])
    # per tensor, by name (reads.py)
    role = property(lambda self: self.facts.role)
    frac = property(lambda self: self.facts.frac)
    pre_frac = property(lambda self: self.facts.pre_frac)
    flops = property(lambda self: self.facts.flops)

    @cached_property
    def gathered(self) -> set[str]:
        """Read in place once per forward (experts, embedding rows, quantized tensors), not per tile."""
        return self.facts.gathered | self.quantized.keys()

    def staging_experts(self, on: bool) -> "CostModel":
        """This model with prefill staging routed experts (`on`) or reading each touched one in place, whatever
        `favours_staged_experts` says: the policy may force either (placement.py)."""
        other = copy.copy(self)
        other._staging = int(on) if self.stages else None
        return other

    def predict(self, place: Mapping[str, Placement]) -> Prediction:
        hw, rows, timeline = self.hw, [], []  # rows: a LayerCost's fields, the prefill's as its index in the timeline
        total = [0, float(hw.step_gpu_us), 0.0]
        # a replayed CUDA graph launches nothing from the CPU; the prefill's launches count always (module doc)
        typical = hw.eager_median_ratio  # launches at a typical step's pace, not the calibration's fastest round's
        moe_overhead = (hw.moe_layer_overhead_us or hw.layer_overhead_us) * typical
        costs = self._layer_costs
        count = together = launch = waits = 0.0
        wheres = [None] * len(self.graph.layers)
        for i, layer in enumerate(self.graph.layers):
            if layer.runs is not Runs.STEP:
                rows.append((layer.name, 0, 0, 0, None))
                continue
            # a layer of a kind (reads.py) placed and staged alike costs alike: worked out once (uva, cpu: one look)
            wheres[i] = where = layer.values(place)
            key = (self.facts.layers[layer.name][0], where, tuple(map(self.staged.__contains__, layer.params))
                   if self._staging is not None and not {UVA, CPU}.isdisjoint(where) and self.staged else ())
            got = costs.get(key)
            if got is None:
                got = costs[key] = self._layer(layer, place)
            h2d_bytes, gpu, link, (compute, in_place, copies), host = got
            if layer.name in self.collectives:
                n, per_token = self.collectives[layer.name]
                wait = n * hw.allreduce_us + self.batch * per_token / (hw.allreduce_gbps * 1e3)
                gpu, count, together = gpu + wait, count + n, together + wait
                compute += n * hw.allreduce_us + self.tokens * per_token / (hw.allreduce_gbps * 1e3)
            if layer.kind is LayerKind.LAYER:
                overhead = moe_overhead if self.experts[layer.name] else hw.layer_overhead_us * typical
                launch += overhead
            waits += host  # an eager step's launches wait out the host's experts (module doc)
            rows.append((layer.name, h2d_bytes, round(gpu), round(link), len(timeline)))
            timeline.append((compute, in_place, copies))
            total = list(map(add, total, (h2d_bytes, gpu, link)))
        ends = [0, *map(round, pipelined(timeline, ((self.prefetch_slots, False), (1, True), None)))]  # module doc
        layers = tuple(LayerCost(*row[:4], 0 if row[4] is None else ends[row[4] + 1] - ends[row[4]]) for row in rows)
        eager = round(hw.step_overhead_us * typical + launch + waits)  # the step's launches, were it eager
        return Prediction(self.batch, total[0], 0 if self.graphs else eager, round(total[1]), round(total[2]), layers,
                          self.tokens, round(max(ends[-1], launch)), int(count), round(together), eager, tuple(wheres))

    def _layer(self, layer: Layer, place: Mapping[str, Placement]) -> tuple[int, float, float, tuple, float]:
        """One layer's bytes over the link, GPU us and link us per step, its prefill's (compute us, copy us per
        pool), and its host's us per step (experts on cpu) (module doc)."""
        hw = self.hw
        hbm, uva, h2d = hw.hbm_read_gbps * 1e3, hw.uva_read_gbps * 1e3, hw.h2d_copy_gbps * 1e3  # bytes/us
        flops_us = hw.matmul_tflops * 1e6  # FLOPs per us
        read_hbm = read_uva = copied = staged = read_cpu = 0.0
        flops = pre_hbm = pre_uva = pre_cpu = 0.0
        pre_copied = [0, 0, 0]  # prefill copies, per pool: prefetch slots, staging slots, the expert ring
        experts = self.experts[layer.name]
        stages = self.batched or any(place[n] is UVA for n in experts)
        latency, touch, split = 0.0, {}, any(place[n] is CPU for n in experts)  # touch: expert -> [cpu, uva bytes, q]
        if layer.kind is LayerKind.LAYER:
            latency = hw.moe_layer_gpu_us if experts else hw.layer_gpu_us
        _, (_, fracs, pre_fracs, flopses, gathered), flags = self.facts.layers[layer.name]
        for n, frac, pre_frac, f, once, routed in zip(layer.params, fracs, pre_fracs, flopses, gathered, flags):
            p, size = place[n], self.tensors[n].nbytes
            b, pre = size * frac, size * pre_frac
            flops += f
            w = 2 if p is CPU and self.tensors[n].dtype == "F8_E4M3" else 1  # FP8: converted as read (module doc)
            if split and (p is CPU or p is UVA) and routed and n in self.groups.index_of:  # split: its sides vary
                touch.setdefault((self.groups.group_of[n], self.groups.index_of[n]), [0, 0, frac])[p is UVA] += size * w
            if p is CPU:  # the host computes it (module doc); a long prompt: staged, or gathered over uva
                read_cpu += b * w  # each touched expert once (module doc)
                at = 0 if n in self.staged else 1 if self.tokens > hw.stage_above_tokens else 2
                pre_copied[2], pre_hbm = pre_copied[2] + size * (at == 0), pre_hbm + pre * (at == 0)
                pre_uva, pre_cpu = pre_uva + pre * (at == 1), pre_cpu + pre * w * (at == 2)
                continue
            if routed and self.batch > 1 and n in self.quantized and self.tensors[n].dtype in FP8:
                staged += 4 * b  # dequantized into HBM (fp8_gather.py): bf16, twice its bytes, written and read back
            elif stages and routed:
                staged += 2 * b if p is UVA else 4 * b  # written to HBM, read back: gathered from HBM, slower
            if p is UVA:
                read_uva += b
                if n in self.staged:  # through the ring if routed, else the staging slots
                    pre_copied[2 if routed else 1], pre_hbm = pre_copied[2 if routed else 1] + size, pre_hbm + pre
                else:
                    pre_uva += pre if once or n in self.quantized else pre * self.reread
            else:
                read_hbm += b
                pre_hbm += pre
                if p is PREFETCH:
                    copied += size
                    pre_copied[0] += size
        beside = hw.uva_beside_cpu_gbps * 1e3 if read_cpu else uva  # the cores read host memory too (module doc)
        gpu = latency + (read_hbm + staged) / hbm + read_uva / beside
        host_us = 0.0
        if read_cpu:  # the GPU sums the CPU's outputs: the layer ends when the later side does (module doc)
            host = (hw.cpu_expert_gbps if read_uva else hw.cpu_alone_gbps) * 1e3  # bytes/us (FP8 counted twice: doc)
            var = sum(q * (1 - q) * (c / host - u / beside) ** 2 for c, u, q in touch.values())
            host_us = read_cpu / host + hw.cpu_expert_sync_us
            gpu = later(gpu, latency + host_us - gpu, var)
        link = read_uva / uva + copied / h2d
        other = 0.0 if layer.kind is not LayerKind.LAYER else \
            self.tokens * (hw.moe_prefill_token_ns if experts else hw.prefill_token_ns) / 1e3
        compute = flops / flops_us + pre_hbm / hbm + other + pre_uva / uva + pre_cpu / (hw.cpu_expert_gbps * 1e3)
        return int(read_uva + copied), gpu, link, (compute, pre_uva / uva, tuple(b / h2d for b in pre_copied)), host_us
