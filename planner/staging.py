"""Prefill staging: the layers whose uva tensors are copied to the GPU before a forward over many tokens.

Why (issue 13): a GEMM that reads a weight in place through a zero-copy view
re-reads it over the host link once per output tile, so at prefill reading in
place costs a multiple of the weight's bytes (on the H100: 2.1x a copy at 512
tokens, 24x at 8192). So when a forward carries more than `above_tokens`
tokens (the hardware profile's `stage_above_tokens`), the runtime
(runtime/prefill.py) copies each staged layer's uva tensors into one of
`slots` GPU buffers before the layer runs, the next layer's copy overlapping
this one's compute, as prefetch does. At or below it (decode) nothing changes:
they are read in place.

What is staged (`stageable`): the tensors of the layer graph's LAYER, MODULE
and HEAD layers (graph.py) that are no member of a fused expert group
(groups.py: `FusedGroups.group_of`; `is_expert` is False exactly for those,
by name alone, as the runtime tells them apart from a plan's names):
- never an embedding (EMBED): a lookup reads one row per token, and staging
  would copy the whole table;
- never a routed expert, stored one expert a tensor or already fused
  (prefused.py): offplan's experts implementation already reads each
  touched expert once per forward, through a gather;
- never a quantized tensor or its scales (quantized.py): dequantizing reads
  each byte once, whatever the number of tokens;
- never a multi-token-prediction layer (graph.py `Runs.MTP`): it runs in no
  forward of plain generation, so a slot for it would hold GPU memory for
  nothing (DeepSeek-V3's layer 61 holds a 1.7 GiB head of its own, which
  would size both slots). Vision towers run at prefill, over an image's many
  tokens, and are staged.
A staged layer holds at least one such tensor on uva. Its `bytes` are those
tensors' bytes, each rounded up to ALIGN (256, slots.py) as they lie back to
back in a slot; `slot_bytes` is the largest layer's, `slots` = min(2, staged
layers), and the pool (`slots x slot_bytes`) is GPU memory that the plan's
footprint counts (footprint.py), like the prefetch pool.

Example: Llama-3.1-8B with the MLP of layers 0-17 on uva stages 18 layers of
336 MiB (gate, up and down: 3 x 14336 x 4096 x 2 bytes) through 2 slots: 672 MiB.

`uva.stage_prefill: false` plans no staging (`Plan.prefill` is None): the
runtime then reads uva tensors in place at prefill too, and the pool costs nothing.
"""
from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from .checkpoint import TensorInfo
from .graph import Layer, LayerGraph
from .groups import is_expert
from .quantized import partners
from .plan import LayerKind, Placement, PrefillStaging, Runs, StagedLayer
from .slots import align

STAGE_SLOTS = 2  # one slot runs while the next layer's copy fills the other


def stageable(layers: Iterable[Layer], quantized: Collection[str] = ()) -> frozenset[str]:
    """The tensors of `layers` (a layer graph's) that prefill stages when they are on uva (module doc);
    `quantized`: the quantized tensors and their scales (quantized.py `partners`), never staged."""
    return frozenset(n for l in layers if l.kind is not LayerKind.EMBED and l.runs is not Runs.MTP
                     for n in l.params if not is_expert(n) and n not in quantized)


def staged_bytes(names: Iterable[str], tensors: Mapping[str, TensorInfo]) -> int:
    """A staged layer's bytes in its slot: each tensor rounded up to ALIGN."""
    return sum(align(tensors[n].nbytes) for n in names)


def make_staging(graph: LayerGraph, place: Mapping[str, Placement], tensors: Mapping[str, TensorInfo],
                 above_tokens: int, names: frozenset[str] | None = None) -> PrefillStaging | None:
    """The plan's `prefill:` section for `place`, or None when no layer holds a stageable uva tensor.
    `names`: `stageable(graph.layers, partners(tensors))`, when the caller has it."""
    names = stageable(graph.layers, partners(tensors)) if names is None else names
    layers = []
    for l in graph.layers:
        staged = [n for n in l.params if n in names and place[n] is Placement.UVA]
        if staged:
            layers.append(StagedLayer(l.name, l.module, staged_bytes(staged, tensors)))
    if not layers:
        return None
    return PrefillStaging(above_tokens, min(STAGE_SLOTS, len(layers)), max(l.bytes for l in layers), tuple(layers))
