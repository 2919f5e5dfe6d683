"""`backend: mixed`: gpu, uva or prefetch per tensor, for the lowest predicted request time within the budget.

Why per tensor: UVA moves only the bytes a decode step touches, so for sparse
tensors (MoE experts at small batch, embedding rows) it is nearly free, while
prefetch would copy them whole. Dense tensors are read whole every step; for
them prefetch wins, because its copies overlap compute, until the link is
saturated, and then UVA and prefetch cost the same link time.

Algorithm. Candidates are the tensors of the layer stacks, of embedding
modules, and of whatever runs in no decode step (vision towers, MTP layers),
that no rule placed; a routed expert is a unit (below). What runs in no decode
step reads nothing per step, so it counts as the sparsest and goes to uva first. Five strategies
each build a placement that fits the budget:

1. sparse -> uva, then dense -> prefetch: sparse units, least-touched first
   (ties in execution order), move to UVA until the plan fits; if that is
   not enough, the fewest stack layers, spread evenly, stream their dense tensors;
2. the same with ties taken round the layers (below), where that places otherwise;
3. sparse -> uva, then dense -> uva: as 1, then dense units in execution
   order to UVA;
4. prefetch only: the fewest stack layers, spread evenly, stream every candidate;
5. uva only: units in execution order to UVA (vLLM's walk).

The cost model (cost.py) predicts each; the fastest request wins: the lowest
prefill of `workload.prompt_tokens` plus `workload.new_tokens` decode steps,
ties going to fewer bytes over the link. So a placement that reads dense
tensors in place, cheap per step, loses to one that streams them when its
prefill costs more than the steps save (uva tensors are staged at prefill, but
a routed expert on uva is read in place by every forward). The plan's notes
give every strategy's step and prefill, and each offloaded layer says what it
holds and why.

Routed experts are units of one expert of one fused parameter (groups.py),
or of one whole tensor where the checkpoint stores every expert in it
(prefused.py: the plan places a tensor whole), ranked by the fraction a step
reads: with a routing profile
(`workload.routing`), the experts its decode tokens never or rarely took go
to uva first and the most-hit ones stay on the GPU; without one, every
expert reads alike. Ties are taken in execution order (strategy 1), or round
the layers (2: each layer's first unit, then its second...). Round the
layers, each layer's host experts are a share that prefill copies
(staging.py) while other layers compute, where whole layers of them, the
first ones first, wait on the link; but every layer with an expert in
pinned memory gathers its touched experts into HBM in each decode step
(runtime/execute/experts.py), which at large batches costs more HBM traffic. The
cost model weighs the two.

With `cpu_experts: true` in the policy, each strategy's placement is tried again
with a share of each layer's routed experts on uva moved to cpu, where the
host computes them beside the GPU (cost.py): a tenth, two tenths, ... all,
the least-read ones of each layer first (the host reads an expert once
per pair routed to it, the GPU once per step however many). The fastest
request of every strategy with its best share wins, where a share is predicted
faster than none; a note gives both. So under uniform routing the experts
kept off the GPU may fill the first layers whole (strategy 1), as llama.cpp's
`--n-cpu-moe` keeps whole layers' experts on the host, rather than spread round
the layers: each layer with one on cpu pays the hand-over (cpu_expert_sync_us),
and each with one off the GPU gathers its resident experts.
cpu needs no GPU memory but the host engine's output buffer (working.py), and a share is
tried only where that fits the budget. Whole experts only (the host computes an
expert whole), block-scaled FP8 (E4M3) ones with their scales (the runtime's
host kernel converts them as it reads them, at a bf16 element's cost a byte:
cost.py), never MXFP4 ones (the host does not compute them). With several GPUs
each GPU's process computes its share of those experts with its share of the
host's cores (hardware.py `one_of`).

Limits: each strategy is greedy (no search over arbitrary subsets), and the
prediction is only as good as the hardware profile and the routing (a
profile's prompts, or uniform: see cost.py).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..inputs.policy import Policy
from ..inputs.quantized import host_computes
from ..layers.graph import Layer, LayerGraph
from ..layers.groups import FusedGroups, whole_groups
from ..plan import LayerKind, Placement, Runs
from .cost import CostModel, Prediction
from .footprint import Footprint
from .schedule import fewest_layers
from .working import within

GPU, UVA, PREFETCH, CPU = Placement.GPU, Placement.UVA, Placement.PREFETCH, Placement.CPU
CPU_SHARES = tuple(i / 10 for i in range(1, 11))  # of each layer's uva experts, tried on cpu (`cpu_experts`)


@dataclass(frozen=True)
class Unit:
    names: tuple[str, ...]  # one tensor (a pre-fused one too), or one expert of one fused parameter (groups.py)
    layer: Layer
    frac: float  # of its bytes read per step
    nbytes: int


@dataclass(frozen=True)
class MixedChoice:
    footprint: Footprint  # over the chosen placement
    prediction: Prediction | None  # None when no strategy fits (the caller raises the budget error)
    notes: tuple[str, ...]
    why: dict[str, str]  # layer -> what it offloads and why


def place_mixed(graph: LayerGraph, policy: Policy, fp: Footprint, fixed: set[str], groups: FusedGroups,
                model: CostModel, budget: int, room: Callable[[Mapping[str, Placement]], int], most: int
                ) -> MixedChoice:
    """Try the five strategies of the module doc on copies of `fp`; keep the fastest request that fits
    `budget` with its own working memory, `room(place)` (working.py `within`: at most `most`)."""
    units: list[Unit] = []
    seen: set[str] = set()
    for layer in graph.layers:
        if layer.kind not in (LayerKind.LAYER, LayerKind.EMBED) and layer.runs is Runs.STEP:
            continue
        for n in layer.params:
            if n in fixed or n in seen:
                continue
            members = groups.expert(n)
            seen.update(members)
            units.append(Unit(members, layer, model.frac[n], sum(fp.tensors[m].nbytes for m in members)))
    sparse = sorted((u for u in units if u.frac < 1), key=lambda u: u.frac)
    # ties (every expert under uniform routing) round the layers: each layer's n-th unit, then its n+1-th
    rank, seen_in = {}, {}
    for u in units:
        rank[id(u)] = seen_in[u.layer.name] = seen_in.get(u.layer.name, -1) + 1
    spread = sorted(sparse, key=lambda u: (u.frac, rank[id(u)]))
    dense = [u for u in units if u.frac >= 1]

    def to_uva(f: Footprint, seq, b: int) -> Footprint:
        f.fit((u.names for u in seq), UVA, b)
        return f

    def to_prefetch(f: Footprint, seq, b: int) -> Footprint:
        by_layer: dict[str, list[str]] = {}
        for u in seq:
            if u.layer.kind is LayerKind.LAYER and u.layer.runs is Runs.STEP and f.place[u.names[0]] is GPU:
                by_layer.setdefault(u.layer.name, []).extend(u.names)
        eligible = [(l, names) for l in graph.stack_layers() if l.name in by_layer
                    for names in [whole_groups(by_layer[l.name], groups, l)] if names]
        for layer, names in fewest_layers(eligible, f, b):
            f.move(names, PREFETCH, layer)
        return f

    def then_prefetch(f: Footprint, b: int) -> Footprint:
        return f if f.total <= b else to_prefetch(f, dense, b)

    walks = {
        "sparse->uva, dense->prefetch": lambda b: then_prefetch(to_uva(fp.copy(), sparse, b), b),
        "sparse round the layers->uva, dense->prefetch": lambda b: then_prefetch(to_uva(fp.copy(), spread, b), b),
        "sparse->uva, dense->uva": lambda b: to_uva(fp.copy(), sparse + dense, b),
        "prefetch only": lambda b: to_prefetch(fp.copy(), units, b),
        "uva only": lambda b: to_uva(fp.copy(), units, b),
    }
    strategies = {k: within(walk, budget, room, most) for k, walk in walks.items()}  # each with its own room
    first, around = (strategies[k][0] for k in list(walks)[:2])
    if around.place == first.place:  # no ties to take otherwise (a dense model's)
        del strategies["sparse round the layers->uva, dense->prefetch"]
    fitting = [k for k, (f, need) in strategies.items() if f.total + need <= budget]
    if not fitting:  # decide() raises the budget error with the smallest footprint
        return MixedChoice(min((f for f, _ in strategies.values()), key=lambda f: f.total + room(f.place)), None, (),
                           {})
    strategies = {k: f for k, (f, _) in strategies.items()}
    preds = {k: model.predict(strategies[k].place) for k in fitting}
    new = policy.workload.new_tokens
    best = min(fitting, key=lambda k: (preds[k].request_us(new), preds[k].h2d_bytes))

    def said(k: str) -> str:
        p = preds[k]
        return f"step {p.step_us / 1e3:.3f} ms, prefill {p.prefill_us / 1e3:.3f} ms, request {p.request_us(new) / 1e3:.3f} ms"

    others = "; ".join(f"{k}: {said(k)}" for k in fitting if k != best)
    notes = (f"mixed chose {best!r}: predicted {said(best)} (prefill of {preds[best].prompt_tokens} tokens + "
             f"{new} steps at batch {model.batch})" + (f"; others: {others}" if others else ""),)
    chosen, prediction = strategies[best], preds[best]
    if policy.cpu_experts:  # each strategy's placement with its best share on cpu: the fastest request of those
        fits = lambda f: f.total + room(f.place) <= budget  # noqa: E731
        tried = [k for i, k in enumerate(fitting)  # a placement two strategies reached: once
                 if not any(strategies[k].place == strategies[j].place for j in fitting[:i])]
        shared = {k: on_cpu(strategies[k], preds[k], groups, model, new, fits) for k in tried}
        pick = min(tried, key=lambda k: (shared[k][1].request_us(new), shared[k][1].h2d_bytes))
        moved = shared[pick][0] is not strategies[pick]  # on_cpu gives the placement itself back when none pays
        chosen, prediction, note = shared[pick] if moved else (chosen, prediction, shared[pick][2])
        notes += (note + (f", on the placement of {pick!r}: the fastest request with its share on cpu"
                          + ("" if pick == best else f" ({best!r} was without)") if moved else ""),)
    return MixedChoice(chosen, prediction, notes, explain(graph, chosen.place, model))


def on_cpu(fp: Footprint, prediction: Prediction, groups: FusedGroups, model: CostModel,
           new: int, fits: Callable[[Footprint], bool]) -> tuple[Footprint, Prediction, str]:
    """`fp` with the best share of each layer's uva experts on cpu (module doc) that `fits` the budget, or `fp`
    itself, and a note."""
    # per experts module, its whole experts on uva (an FP8 one's weights and scales; no MXFP4 one), least read first
    candidates: list[list[tuple[str, ...]]] = []
    q = model.quantized
    for group in groups.members:
        whole = [ns for ns in groups.by_expert(group).values()
                 if all(fp.place[n] is UVA and host_computes(n, fp.tensors, model.quantized) for n in ns)
                 and fp.layers[fp.layer_name[ns[0]]].runs is Runs.STEP]
        if whole:
            candidates.append(sorted(whole, key=lambda ns: model.frac[ns[0]]))
    if not candidates:
        return fp, prediction, ("cpu_experts: the model has no routed experts" if not groups.members else
                                "cpu_experts: no whole routed expert of a decode layer on uva to compute on cpu")
    tried = {}
    for share in CPU_SHARES:
        f = fp.copy()
        f.move([n for experts in candidates for ns in experts[:math.ceil(len(experts) * share)] for n in ns], CPU)
        if fits(f):
            tried[share] = f, model.predict(f.place)
    if not tried:
        return fp, prediction, ("cpu_experts: no expert on cpu: the host engine's output buffer (working memory) "
                                "does not fit the budget")
    share = min(tried, key=lambda k: (tried[k][1].request_us(new), tried[k][1].h2d_bytes))
    f, p = tried[share]
    ms = lambda p: f"{p.request_us(new) / 1e3:.3f} ms"  # noqa: E731
    if p.request_us(new) >= prediction.request_us(new):  # strictly faster only: fewer link bytes at the same time
        # (an eager step bound by its launches) is no gain, and moves the experts to where eager decode is slower
        return fp, prediction, (f"cpu_experts: no expert on cpu: predicted request {ms(prediction)}, against "
                                f"{ms(p)} at best with {share:.0%} of each layer's uva experts there (the host's "
                                "figures: cpu_expert_gbps and cpu_expert_sync_us, as plan show's \"host CPU\" line gives "
                                "them)")
    return f, p, (f"cpu_experts: {share:.0%} of each layer's uva experts on cpu, the least read first: predicted "
                  f"request {ms(p)}, against {ms(prediction)} with none")


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
