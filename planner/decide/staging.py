"""Prefill staging: the layers whose uva tensors are copied to the GPU before a forward over many tokens.

Why (issue 13): a GEMM that reads a weight in place through a zero-copy view
re-reads it over the host link once per output tile, so at prefill reading in
place costs a multiple of the weight's bytes (on the H100: 2.1x a copy at 512
tokens, 24x at 8192). So when a forward carries more than `above_tokens`
tokens (the hardware profile's `stage_above_tokens`), the runtime
(runtime/execute/prefill.py) copies each staged layer's uva tensors into one of
`slots` GPU buffers before the layer runs, the next layer's copy overlapping
this one's compute, as prefetch does. At or below it (decode) nothing changes:
they are read in place.

What is staged (`stageable`): the tensors of the layer graph's LAYER, MODULE
and HEAD layers (graph.py), except:
- never an embedding (EMBED): a lookup reads one row per token, and staging
  would copy the whole table;
- a routed expert (a member of a fused expert group, stored one expert a
  tensor or already fused: groups.py `is_expert`, by name alone, as the
  runtime tells them apart from a plan's names) only when the plan stages
  experts (`experts`, below). Otherwise offplan's experts implementation
  reads each touched expert once per forward, through a gather, after the
  router has picked them: nothing overlaps that read;
- never a quantized tensor or its scales (quantized.py): dequantizing reads
  each byte once, whatever the number of tokens;
- never a multi-token-prediction layer (graph.py `Runs.MTP`): it runs in no
  forward of plain generation, so a slot for it would hold GPU memory for
  nothing (DeepSeek-V3's layer 61 holds a 1.7 GiB head of its own, which
  would size both slots). Vision towers run at prefill, over an image's many
  tokens, and are staged.

Experts (`stage_experts`): copying a layer's host experts ahead of it
overlaps the copy with earlier layers' compute, but moves the experts no
token is routed to as well; gathering the touched ones moves only those, on
the critical path. Copying costs no more when the prompt touches at least
UVA read / H2D copy bandwidth (0.92 on the H100) of the expert bytes,
overlap aside, so the planner stages experts when the routing it assumes
(the profile's prefill counts, or uniform: a layer reads E x (1 - (1 -
k/E)^T) of its E experts) touches that share at the workload's prompt length
T (cost.py). Under uniform routing that holds from a few dozen tokens for
every MoE model known to us (Qwen3-30B-A3B: 128 experts, top 8, 99.8% at 100
tokens): a long prompt touches every expert. Under a budget, `backend: mixed`
places the experts both ways and keeps the faster request, since the ring's
GPU memory could hold experts instead (placement.py; at the equal-memory
budgets of README's "Beside llama.cpp", unstaged won).

Staged experts do not go through the slots. Offplan's experts implementation
gathers a forward's expert rows into a tensor of its own (runtime/execute/experts.py),
so a host row is free again once gathered: the rows stream through a ring of
`ring_bytes` (runtime/execute/ring.py) that each staged forward allocates and frees,
prefill working memory (with the gathered rows, which hold all of a layer's
experts), which working.py sizes and the plan's footprint counts. It holds
one layer's host experts (the largest staged layer's: the copies then run a
whole layer ahead), up to RING_BYTES: 1 GiB streams 19.5 ms of the H100's
link, more than twice what a layer of Qwen3-30B-A3B computes at 8192 tokens
(58 ms for 8 layers, measured), so the link need not wait on compute for want
of room. (512 MiB left the link idle for part of each layer at 8192 tokens:
1.16x the floor where whole-layer slots reached 1.09x.)

Routed experts on cpu are staged as uva ones are: the host computes them for
a few tokens (decode), but over a long prompt it would read each expert once
per token routed to it (a GEMV per pair), where the copy moves it once, so
above `above_tokens` they go through the ring too (the cost model predicts
the prefill so).

A staged layer holds at least one such tensor on uva (or a routed expert on
cpu). Its `bytes` are those
tensors' bytes but the routed experts', each rounded up to ALIGN (256,
slots.py) as they lie back to back in a slot; `slot_bytes` is the largest
layer's, `slots` = min(2, staged layers with such bytes), and the pool (`slots x slot_bytes`)
is GPU memory held from load on, which the plan's footprint counts
(footprint.py), like the prefetch pool.

Example: Llama-3.1-8B with the MLP of layers 0-17 on uva stages 18 layers of
336 MiB (gate, up and down: 3 x 14336 x 4096 x 2 bytes) through 2 slots: 672 MiB.

`uva.stage_prefill: false` plans no staging (`Plan.prefill` is None): the
runtime then reads uva tensors in place at prefill too, and the pool costs nothing.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from functools import cached_property
from itertools import compress, filterfalse

from ..inputs.checkpoint import TensorInfo
from ..inputs.hardware import Hardware
from ..layers.alike import applies
from ..layers.graph import Layer, LayerGraph
from ..layers.slots import align
from ..plan import LayerKind, Placement, PrefillStaging, Runs, StagedLayer

STAGE_SLOTS = 2  # one slot runs while the next layer's copy fills the other
RING_BYTES = 2**30  # the expert ring's most (module doc)
UVA, CPU = Placement.UVA, Placement.CPU
_STAGED = frozenset({UVA, CPU})  # cpu: routed experts only (a rule puts nothing else there)


def stageable(layers: Iterable[Layer], quantized: Collection[str] = (), experts: bool = False) -> frozenset[str]:
    """The tensors of `layers` (a layer graph's) that prefill stages when they are on uva (module doc);
    `quantized`: the quantized tensors and their scales (quantized.py `partners`), never staged;
    `experts`: routed experts staged too, but not in a layer whose experts are quantized (their biases
    alone would gain nothing)."""
    return stageables(layers, quantized)[experts]


def stageables(layers: Iterable[Layer], quantized: Collection[str] = ()) -> tuple[frozenset[str], frozenset[str]]:
    """`stageable` without routed experts and with them, from one look at each tensor (the cost model
    needs both)."""
    without: set[str] = set()
    extra: set[str] = set()  # the routed experts staged with `experts`
    for l in layers:
        if l.kind is LayerKind.EMBED or l.runs is Runs.MTP:
            continue
        routed = l.expert_tensors
        mine = list(filterfalse(quantized.__contains__, l.params))  # a set or dict: looked up, not walked
        without.update(filterfalse(routed.__contains__, mine))
        if not any(map(quantized.__contains__, routed)):
            extra.update(filter(routed.__contains__, mine))
    return frozenset(without), frozenset(without | extra)


class Stageables:
    """`stageables(layers, quantized)`, worked out when first asked for (`both`): a placement with nothing on uva
    or cpu stages nothing, so a prefetch plan never asks. `routed`: whether routed experts add any, from a look at
    each layer's experts that stops at the first quantized one."""

    def __init__(self, layers: Sequence[Layer], quantized: Collection[str] = ()):
        self.layers, self.quantized = layers, quantized

    @cached_property
    def both(self) -> tuple[frozenset[str], frozenset[str]]:
        return stageables(self.layers, self.quantized)

    @cached_property
    def routed(self) -> bool:
        return any(_unquantized_experts(l, self.quantized)
                   for l in self.layers if l.kind is not LayerKind.EMBED and l.runs is not Runs.MTP)


def _unquantized_experts(layer: Layer, quantized: Collection[str]) -> bool:
    """Whether `layer` holds routed experts and none of them is quantized. Where its template applies (alike.py),
    read from the template's marks over its tensors, stopping at the first quantized one: its `expert_tensors`, a
    set of 1,536 names on a MoE layer of DeepSeek-V3, are not made for this question (a prefetch plan asks no other)."""
    t = layer.template
    if t is None or not applies(layer.name):
        return bool(layer.expert_tensors) and not any(map(quantized.__contains__, layer.expert_tensors))
    return True in t.experts and not any(map(quantized.__contains__, compress(layer.params, t.experts)))


def stage_experts(touched: float, hw: Hardware) -> bool:
    """Whether prefill stages routed experts, given the share of their bytes the prompt touches (module doc)."""
    return touched >= hw.uva_read_gbps / hw.h2d_copy_gbps


def staged(layer: Layer, names: Collection[str], place: Mapping[str, Placement],
           tensors: Mapping[str, TensorInfo] | None) -> tuple[list[str], int | None]:
    """`layer`'s staged tensors (those of `names`, stageable, on uva; routed experts on cpu too) and the bytes
    those other than routed experts take in a slot, each rounded up to ALIGN (module doc); None without
    `tensors`."""
    params = layer.params
    mine = [n for n in compress(params, map(_STAGED.__contains__, layer.values(place))) if n in names]
    if tensors is None or not mine:
        return mine, None if tensors is None else 0
    routed = layer.expert_tensors
    return mine, sum(align(tensors[n].nbytes) for n in mine if n not in routed)


def ring_bytes(host_experts: Iterable[int]) -> int:
    """The expert ring for staged layers holding these bytes of routed experts on uva or cpu (module doc)."""
    return min(RING_BYTES, max(host_experts, default=0))


def make_staging(graph: LayerGraph, place: Mapping[str, Placement], tensors: Mapping[str, TensorInfo],
                 above_tokens: int, names: Callable[[], frozenset[str]]) -> PrefillStaging | None:
    """The plan's `prefill:` section for `place`, or None when no layer holds a stageable uva tensor.
    `names()`: `stageable(graph.layers, partners(tensors), experts)`, asked for where a tensor is on uva or cpu."""
    held = set(place.values())  # the placements held, in one pass (not one look for each over 90k tensors)
    if UVA not in held and CPU not in held:  # no layer has a tensor to stage
        return None
    names = names()
    layers, host = [], []
    for l in graph.layers:
        mine, size = staged(l, names, place, tensors)
        if mine:
            layers.append(StagedLayer(l.name, l.module, size))
            host.append(sum(tensors[n].nbytes for n in mine if n in l.expert_tensors))
    if not layers:
        return None
    return PrefillStaging(above_tokens, min(STAGE_SLOTS, sum(1 for l in layers if l.bytes)),
                          max(l.bytes for l in layers), tuple(layers), ring_bytes(host))
