"""The cost model: bytes over the host link and time per decode step, predicted from a placement.

Roles say what fraction of a tensor one decode step (one new token per
sequence, batch b) reads:
- expert: a member of a fused expert group (see groups.py). Routing picks
  expert e for a token with probability p_e, so a step of b tokens reads it
  with probability 1 - (1 - p_e)^b. With a routing profile (routing.py), p_e
  is the expert's share of the profile's decode tokens (decode hits / decode
  tokens: top-k routing makes them add up to k); without one, routing is
  assumed uniform, p_e = k/E for each of a layer's E experts;
- embedding: a 2-D tensor of an embedding module: b of its V rows per step
  (unless the embedding is tied to the head, which reads it whole);
- dense: everything else, read whole every step.
Rules may override a role (`rules: [{match: [lm_head], role: dense}]`).
Only what runs in every decode step counts (graph.py `Runs`): a vision tower
runs only in the prefill of a prompt with images, an MTP layer never in plain
decode, so wherever they live they cost a decode step nothing.

Time per step: three resources work at once, and the slowest sets the pace.
    cpu  = step overhead + stack layers x layer overhead   (launching kernels, eagerly;
                                                            0 when steps replay a CUDA graph)
    gpu  = resident and prefetched bytes read / HBM + uva bytes read / UVA
    link = uva bytes read / UVA + prefetched bytes / H2D copy
    step = max(cpu, gpu, link)
The CPU runs ahead of the GPU, so launch overhead overlaps kernels. UVA reads
sit inside the kernels that need them, so they count as GPU time; prefetch
copies run on their own stream ahead of use, so they do not. Both cross the
same PCIe link, so the link term adds them.

Limits: decode only (prefill is not modelled); without a routing profile,
expert routing is assumed uniform (real routers are skewed, which touches
fewer experts); with one, the tokens of a batch are assumed routed
independently of each other, as the profile's prompts were; the overlap of
prefetch is assumed perfect, so a plan whose offloaded layers sit together
(nothing to overlap with) is predicted optimistic.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .checkpoint import TensorInfo
from .graph import LayerGraph
from .groups import FusedGroups
from .hardware import Hardware
from .plan import LayerKind, Placement, Role, Runs
from .routing import RoutingProfile

GPU, UVA, PREFETCH = Placement.GPU, Placement.UVA, Placement.PREFETCH


@dataclass(frozen=True)
class LayerCost:
    name: str
    h2d_bytes: int  # over the host link per step
    gpu_us: int  # HBM and UVA reads
    link_us: int


@dataclass(frozen=True)
class Prediction:
    batch_size: int
    h2d_bytes: int
    cpu_us: int
    gpu_us: int
    link_us: int
    layers: tuple[LayerCost, ...]

    @property
    def step_us(self) -> int:
        return max(self.cpu_us, self.gpu_us, self.link_us)


class CostModel:
    """Predicts a placement's per-step traffic and time; built once per plan, asked many times."""

    def __init__(self, graph: LayerGraph, tensors: Mapping[str, TensorInfo], hw: Hardware, batch: int,
                 groups: FusedGroups, top_k: int | None, roles: Mapping[str, Role] | None = None,
                 routing: RoutingProfile | None = None, graphs: bool = False):
        """`routing`: a profile that counts every group that runs in decode (routing.mismatches
        checks it); None: uniform routing over `top_k` of each group's experts."""
        self.graphs = graphs  # steps replayed from a CUDA graph: no CPU launch time
        self.graph = graph
        self.hw = hw
        self.batch = batch
        counts = {g: groups.experts(g) for g in groups.members}
        group_of = groups.group_of
        chance = {g: routing.probabilities(g) for g in groups.members if g in routing.layers} if routing else {}
        # A tied embedding is also the head, which reads all of it every step: dense, not sparse.
        embed = set() if graph.tied_embeddings else {
            n for l in graph.layers if l.kind is LayerKind.EMBED for n in l.params if len(tensors[n].shape) == 2}
        self.role: dict[str, Role] = {}
        self.frac: dict[str, float] = {}
        for layer in graph.layers:
            for n in layer.params:
                role = (roles or {}).get(n) or (
                    Role.EXPERT if n in group_of else Role.EMBEDDING if n in embed else Role.DENSE)
                if layer.runs is not Runs.STEP:
                    frac = 0.0  # not in a decode step at all
                elif role is Role.EXPERT and group_of.get(n) in chance:
                    frac = 1 - (1 - chance[group_of[n]][groups.index_of[n]]) ** batch
                elif role is Role.EXPERT and (top_k is None or n not in group_of):
                    frac = 1.0  # unknown routing, or an override without a group: read it all
                elif role is Role.EXPERT:
                    e = counts[group_of[n]]
                    frac = 1 - (1 - min(top_k, e) / e) ** batch
                elif role is Role.EMBEDDING:
                    frac = min(1.0, batch / max(1, tensors[n].shape[0]))
                else:
                    frac = 1.0
                self.role[n] = role
                self.frac[n] = frac
        self.size = {n: t.nbytes for n, t in tensors.items()}

    def predict(self, place: Mapping[str, Placement]) -> Prediction:
        hw = self.hw
        hbm, uva, h2d = hw.hbm_read_gbps * 1e3, hw.uva_read_gbps * 1e3, hw.h2d_copy_gbps * 1e3  # bytes/us
        layers = []
        total = [0, 0.0, 0.0]
        # a replayed CUDA graph launches nothing from the CPU
        cpu, per_layer = (0.0, 0.0) if self.graphs else (hw.step_overhead_us, hw.layer_overhead_us)
        for layer in self.graph.layers:
            if layer.runs is not Runs.STEP:
                layers.append(LayerCost(layer.name, 0, 0, 0))
                continue
            read_hbm = read_uva = copied = 0.0
            for n in layer.params:
                p, b = place[n], self.size[n] * self.frac[n]
                if p is UVA:
                    read_uva += b
                else:
                    read_hbm += b
                    if p is PREFETCH:
                        copied += self.size[n]
            gpu = read_hbm / hbm + read_uva / uva
            link = read_uva / uva + copied / h2d
            cpu += per_layer if layer.kind is LayerKind.LAYER else 0
            h2d_bytes = int(read_uva + copied)
            layers.append(LayerCost(layer.name, h2d_bytes, round(gpu), round(link)))
            total[0] += h2d_bytes
            total[1] += gpu
            total[2] += link
        return Prediction(self.batch, total[0], round(cpu), round(total[1]), round(total[2]), tuple(layers))
