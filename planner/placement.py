"""Deciding placements: a pure function from (layer graph, tensor sizes, policy) to placements.

Order. Everything walks the layer graph's execution order, and within a layer
the natural order of tensor names (`graph.natural_key`): that is the
"stable order" in which vLLM's per-parameter UVA walk is reproduced.

Steps:
1. Rules, first match wins, fix a tensor's placement before anything else.
2. Candidates for the backend are the remaining tensors of the layer stacks;
   embeddings, final norms and the head stay on the GPU unless a rule moves them.
   Fused expert groups (groups.py) move whole; selecting part of one is an error.
3. The backend: `auto` is prefetch if `prefetch.group_size > 0`, else uva if
   `uva.offload_gib > 0` or a budget is set, else nothing. `mixed` chooses per
   tensor by predicted step time (mixed.py).
4. If a budget is set and the whole checkpoint fits it, the backend offloads
   nothing and the plan says so.
5. uva: walk the candidates (only those matching `uva.params`, if given) and
   offload each one while the offloaded total is below `offload_gib` GiB (so
   the last one may overshoot, as in vLLM); with no amount, offload until the
   GPU footprint is within the budget.
6. prefetch: stack position i (counted over all stacks, in order) is offloaded
   iff `i % group_size >= group_size - num_in_group`; within it, the tensors
   matching `prefetch.params` (all, if none given). With no group_size, the
   fewest layers (possibly none), spread evenly over the layers that have
   candidates, such that GPU bytes plus the buffer pool fit the budget; if no
   count fits, the count with the smallest footprint, which the error quotes.
7. The prefetch pool: the k-th prefetched layer uses slot k mod S, where
   S = min(step, prefetched layers) (vLLM allocates `step` slots; extra ones
   would never be used). Each slot holds one buffer per distinct
   (name within the layer, dtype, shape). A layer's copy starts after the
   forward of the previous user of its slot, cyclically; for step | layers
   that is the layer `step` positions earlier, exactly vLLM's schedule.
8. A budget that the result exceeds is an error quoting the smallest
   budget_gib (two decimals) that this policy would fit, and what is pinned
   to the GPU outside the stacks.
9. The cost model (cost.py) predicts every plan's bytes over the link and
   step time, per layer and in total, whatever the backend.

Example: group_size 8, num_in_group 2 over 61 layers offloads layers
6, 7, 14, 15, 22, 23, 30, 31, 38, 39, 46, 47, 54, 55.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .checkpoint import TensorInfo
from .errors import BudgetError, PolicyError
from .cost import CostModel, Prediction
from .graph import Layer, LayerGraph
from .hardware import H100, Hardware
from .mixed import place_mixed
from .groups import fused_groups, split_groups
from .patterns import Names
from .plan import LayerBytes, PrefetchSchedule
from .schedule import fewest_layers, make_schedule
from .policy import GIB, Backend, Placement, Policy
from .report import human

GPU, UVA, PREFETCH = Placement.GPU, Placement.UVA, Placement.PREFETCH


@dataclass(frozen=True)
class Decision:
    backend: str  # "none" | "uva" | "prefetch" | "mixed"
    params: dict[str, Placement]  # execution order
    prefetch: PrefetchSchedule | None
    layers: tuple[LayerBytes, ...]
    notes: tuple[str, ...]
    cost: Prediction | None = None


def gib(n: float) -> str:
    """Bytes for a message: GiB to two places, or MiB/KiB/B below 1 GiB."""
    return human(int(n))


def _ceil_gib(n: int) -> float:
    """The smallest budget_gib with two decimals whose bytes hold `n`."""
    return -(-n * 100 // GIB) / 100


def resolve_backend(policy: Policy) -> tuple[str, str]:
    """The backend that will run, and why (for the plan's notes)."""
    b = policy.backend
    if b is Backend.MIXED:
        return "mixed", "backend: mixed (per tensor, by predicted step time)"
    if b is Backend.PREFETCH:
        return "prefetch", "backend: prefetch"
    if b is Backend.UVA:
        return "uva", "backend: uva"
    if policy.prefetch.group_size > 0:
        return "prefetch", "backend auto chose prefetch: prefetch.group_size is set"
    if policy.uva.offload_gib > 0:
        return "uva", "backend auto chose uva: uva.offload_gib is set"
    if policy.budget_gib is not None:
        return "uva", "backend auto chose uva: budget_gib is set"
    return "none", "backend auto offloads nothing: no offload amount or budget is set"


def decide(graph: LayerGraph, tensors: Mapping[str, TensorInfo], policy: Policy,
           hardware: Hardware = H100, top_k: int | None = None) -> Decision:
    """Placements for every tensor (see the module doc); `hardware` and `top_k` (experts per
    token, from the workload or config.json) feed the cost model that every plan reports
    and that `backend: mixed` decides with."""
    size = {n: t.nbytes for n, t in tensors.items()}
    place = {n: GPU for layer in graph.layers for n in layer.params}
    names = Names(place)
    fixed: set[str] = set()
    won: list[set[str]] = []  # per rule, the tensors it places (first match wins)
    roles: dict[str, str] = {}
    for rule in policy.rules:
        matched = names.select(rule.patterns)
        if rule.role is not None:
            for n in matched:
                roles.setdefault(n, rule.role)
        mine = matched - fixed if rule.place is not None else set()
        won.append(mine)
        fixed |= mine
        for n in mine:
            place[n] = rule.place
    stack = graph.stack_layers()
    groups = fused_groups(n for l in stack for n in l.params)
    selected = {"uva": names.select(policy.uva.params) if policy.uva.params else None,
                "prefetch": names.select(policy.prefetch.params) if policy.prefetch.params else None}
    _check_groups(groups, won, selected, policy)
    model = CostModel(graph, tensors, hardware, policy.workload.batch_size, groups, top_k, roles)
    backend, why = resolve_backend(policy)
    notes = [why]
    reasons: dict[str, str] = {}
    if groups and top_k is None:
        notes.append("the checkpoint has MoE experts but no experts-per-token (config.json or "
                     "workload.experts_per_token): the cost model assumes each step reads every expert")
    budget = policy.budget_bytes
    step = policy.prefetch.step
    total = sum(size.values())

    if backend != "none" and budget is not None and total <= budget:
        notes.append(f"the whole checkpoint ({gib(total)}) fits budget_gib {policy.budget_gib}: "
                     "nothing offloaded (offloading would only cost speed)")
        backend = "none"
    elif backend == "uva":
        _uva(stack, fixed, place, size, tensors, policy, graph, groups, selected["uva"])
    elif backend == "prefetch":
        _prefetch(stack, fixed, place, size, tensors, policy, graph, selected["prefetch"])
    elif backend == "mixed":
        choice = place_mixed(graph, tensors, policy, place, fixed, groups, model)
        place = choice.place
        notes += choice.notes
        reasons = choice.why

    schedule = make_schedule(graph, place, tensors, step)
    if schedule is not None and step < 1:
        raise PolicyError(f"{policy.path}: prefetch.step must be >= 1: rules place tensors on prefetch")
    footprint = sum(size[n] for n, p in place.items() if p is GPU) + (schedule.pool_bytes if schedule else 0)
    if budget is not None and footprint > budget:
        raise BudgetError(_over_budget_message(policy, backend, footprint, place, size, graph))
    if graph.tied_embeddings:
        notes.append("tied embeddings: the checkpoint has no lm_head tensor; the head reuses the embedding")
    prediction = model.predict(place)
    layers = []
    for l, c in zip(graph.layers, prediction.layers):
        by = {GPU: 0, UVA: 0, PREFETCH: 0}
        for n in l.params:
            by[place[n]] += size[n]
        layers.append(LayerBytes(l.name, by[GPU], by[UVA], by[PREFETCH], c.h2d_bytes, c.gpu_us,
                                 reasons.get(l.name)))
    return Decision(backend, place, schedule, tuple(layers), tuple(notes), prediction)


def _check_groups(groups, won, selected, policy) -> None:
    """Rules and `params` patterns must select fused expert groups whole (see groups.py)."""
    problems = []
    for i, (rule, mine) in enumerate(zip(policy.rules, won)):
        if rule.place is not None:
            problems += split_groups(groups, mine, f"rules[{i}] (place: {rule.place.value})")
    for key in ("uva", "prefetch"):
        if selected[key] is not None:
            problems += split_groups(groups, selected[key], f"{key}.params")
    if problems:
        raise PolicyError(f"{policy.path}: the policy splits fused expert groups", problems)


def _uva(stack, fixed, place, size, tensors, policy, graph, groups, selected) -> None:
    """The per-tensor walk; a fused expert group is offloaded whole when the walk reaches it."""
    cands = [n for l in stack for n in l.params if n not in fixed and (selected is None or n in selected)]
    group_of = {m: ms for ms in groups.values() for m in ms}

    def units():
        for n in cands:
            if place[n] is GPU:
                yield group_of.get(n, (n,))

    if policy.uva.offload_gib > 0:
        limit = policy.uva.offload_gib * GIB
        done = 0
        for unit in units():
            if done >= limit:
                break
            for n in unit:
                place[n] = UVA
                done += size[n]
        return
    if policy.budget_bytes is None:
        return
    sched = make_schedule(graph, place, tensors, policy.prefetch.step)
    gpu = sum(size[n] for n, p in place.items() if p is GPU) + (sched.pool_bytes if sched else 0)
    for unit in units():
        if gpu <= policy.budget_bytes:
            break
        for n in unit:
            place[n] = UVA
            gpu -= size[n]


def _prefetch(stack, fixed, place, size, tensors, policy, graph, selected) -> None:
    pre = policy.prefetch

    def chosen(layer: Layer) -> list[str]:
        return [n for n in layer.params if n not in fixed and (selected is None or n in selected)]

    if pre.group_size > 0:
        g, k = pre.group_size, pre.num_in_group
        for i, layer in enumerate(stack):
            if i % g >= g - k:
                for n in chosen(layer):
                    place[n] = PREFETCH
        return
    if policy.budget_bytes is None:
        return
    eligible = [(l, c) for l, c in ((l, chosen(l)) for l in stack) if c]
    for layer, names in fewest_layers(eligible, place, tensors, graph, pre.step, policy.budget_bytes):
        for n in names:
            place[n] = PREFETCH


def _over_budget_message(policy: Policy, backend: str, footprint: int, place, size, graph) -> str:
    pinned: dict[str, int] = {}
    stack_names = {l.name for l in graph.stack_layers()}
    for l in graph.layers:
        b = sum(size[n] for n in l.params if place[n] is GPU and l.name not in stack_names)
        if b:
            pinned[l.name] = b
    top = sorted(pinned.items(), key=lambda kv: -kv[1])[:5]
    pinned_text = ", ".join(f"{n} {gib(b)}" for n, b in top) or "nothing"
    head = (f"{policy.path}: the plan needs {gib(footprint)} of GPU memory but budget_gib is "
            f"{policy.budget_gib}; budget_gib: {_ceil_gib(footprint)} is the smallest that fits this policy.")
    if backend == "uva" and policy.uva.offload_gib > 0:
        fix = (f"uva.offload_gib: {policy.uva.offload_gib} offloads too little: raise it, or remove it "
               "and let budget_gib decide how much to offload.")
    elif backend == "prefetch" and policy.prefetch.group_size > 0:
        fix = (f"prefetch.group_size {policy.prefetch.group_size} / num_in_group "
               f"{policy.prefetch.num_in_group} offloads too few layers: raise num_in_group, or remove "
               "group_size and let budget_gib decide.")
    else:
        fix = ("No choice of offloaded layers fits. Move more to host memory with a rule "
               "(for example `rules: [{match: [embed_tokens], place: uva}]`), or raise budget_gib.")
    return f"{head}\n  Pinned to the GPU outside the layer stacks: {pinned_text}.\n  {fix}"
