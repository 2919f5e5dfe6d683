"""`backend: mixed`: gpu, uva or prefetch per tensor, for the lowest predicted step time within the budget.

Why per tensor: UVA moves only the bytes a decode step touches, so for sparse
tensors (MoE experts at small batch, embedding rows) it is nearly free, while
prefetch would copy them whole. Dense tensors are read whole every step; for
them prefetch wins, because its copies overlap compute, until the link is
saturated, and then UVA and prefetch cost the same link time.

Algorithm. Candidates are the tensors of the layer stacks and of embedding
modules that no rule placed; a fused expert group is one unit. Four strategies
each build a placement that fits the budget:

1. sparse -> uva, then dense -> prefetch: sparse units, least-touched first,
   move to UVA until the plan fits; if that is not enough, the fewest stack
   layers, spread evenly, stream their dense tensors;
2. sparse -> uva, then dense -> uva: the same, then dense units in execution
   order to UVA;
3. prefetch only: the fewest stack layers, spread evenly, stream every candidate;
4. uva only: units in execution order to UVA (vLLM's walk).

The cost model (cost.py) predicts each; the fastest wins, ties going to fewer
bytes over the link. The plan's notes give every strategy's prediction, and
each offloaded layer says what it holds and why.

Limits: each strategy is greedy (no search over arbitrary subsets), and the
prediction is only as good as the hardware profile and the uniform-routing
assumption (see cost.py).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .checkpoint import TensorInfo
from .cost import CostModel
from .graph import Layer, LayerGraph
from .plan import LayerKind, Placement
from .policy import Policy
from .schedule import fewest_layers, footprint

GPU, UVA, PREFETCH = Placement.GPU, Placement.UVA, Placement.PREFETCH


@dataclass(frozen=True)
class Unit:
    names: tuple[str, ...]  # one tensor, or a whole fused expert group
    layer: Layer
    frac: float  # of its bytes read per step
    nbytes: int


@dataclass(frozen=True)
class MixedChoice:
    place: dict[str, Placement]
    notes: tuple[str, ...]
    why: dict[str, str]  # layer -> what it offloads and why


def place_mixed(graph: LayerGraph, tensors: Mapping[str, TensorInfo], policy: Policy,
                place: dict[str, Placement], fixed: set[str], groups: Mapping[str, list[str]],
                model: CostModel) -> MixedChoice:
    budget = policy.budget_bytes
    step = max(1, policy.prefetch.step)
    group_of = {m: tuple(ms) for ms in groups.values() for m in ms}
    units: list[Unit] = []
    seen: set[str] = set()
    for layer in graph.layers:
        if layer.kind not in (LayerKind.LAYER, LayerKind.EMBED):
            continue
        for n in layer.params:
            if n in fixed or n in seen:
                continue
            members = group_of.get(n, (n,))
            seen.update(members)
            units.append(Unit(members, layer, model.frac[n],
                              sum(tensors[m].nbytes for m in members)))
    sparse = sorted((u for u in units if u.frac < 1), key=lambda u: u.frac)
    dense = [u for u in units if u.frac >= 1]

    def to_uva(p, seq) -> None:
        gpu = footprint(graph, p, tensors, step)
        for u in seq:
            if gpu <= budget:
                return
            for n in u.names:
                p[n] = UVA
            gpu -= u.nbytes

    def to_prefetch(p, seq) -> None:
        by_layer: dict[str, list[str]] = {}
        for u in seq:
            if u.layer.kind is LayerKind.LAYER and p[u.names[0]] is GPU:
                by_layer.setdefault(u.layer.name, []).extend(u.names)
        eligible = [(l, by_layer[l.name]) for l in graph.stack_layers() if l.name in by_layer]
        for _, names in fewest_layers(eligible, p, tensors, graph, step, budget):
            for n in names:
                p[n] = PREFETCH

    strategies = {}
    p = dict(place)
    to_uva(p, sparse)
    if footprint(graph, p, tensors, step) > budget:
        to_prefetch(p, dense)
    strategies["sparse->uva, dense->prefetch"] = p
    p = dict(place)
    to_uva(p, sparse + dense)
    strategies["sparse->uva, dense->uva"] = p
    p = dict(place)
    to_prefetch(p, units)
    strategies["prefetch only"] = p
    p = dict(place)
    to_uva(p, units)
    strategies["uva only"] = p

    sizes = {k: footprint(graph, p, tensors, step) for k, p in strategies.items()}
    fitting = [k for k in strategies if sizes[k] <= budget]
    if not fitting:  # decide() raises the budget error with the smallest footprint
        k = min(sizes, key=sizes.get)
        return MixedChoice(strategies[k], (), {})
    preds = {k: model.predict(strategies[k]) for k in fitting}
    best = min(fitting, key=lambda k: (preds[k].step_us, preds[k].h2d_bytes))
    others = ", ".join(f"{k} {preds[k].step_us / 1e3:.3f} ms" for k in fitting if k != best)
    notes = (f"mixed chose {best!r}: predicted {preds[best].step_us / 1e3:.3f} ms per step at batch "
             f"{model.batch}" + (f" (others: {others})" if others else ""),)
    return MixedChoice(strategies[best], notes, explain(graph, strategies[best], model))


def explain(graph: LayerGraph, place: Mapping[str, Placement], model: CostModel) -> dict[str, str]:
    """Per offloaded layer: which roles went where, and the fraction a step reads."""
    why = {}
    for layer in graph.layers:
        parts: dict[tuple[str, Placement], list[float]] = {}
        for n in layer.params:
            if place[n] is not GPU:
                parts.setdefault((model.role[n], place[n]), []).append(model.frac[n])
        if parts:
            why[layer.name] = "; ".join(
                f"{role.value} -> {p.value} ({max(fr):.1%} read per step)" if p is UVA else f"{role.value} -> {p.value}"
                for (role, p), fr in sorted(parts.items(), key=lambda kv: (kv[0][0].value, kv[0][1].value)))
    return why
