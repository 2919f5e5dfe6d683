"""Deciding placements: a pure function from (layer graph, tensor sizes, policy) to placements.

Order. Everything walks the layer graph's execution order, and within a layer
the natural order of tensor names (`graph.natural_key`): that is the
"stable order" in which vLLM's per-parameter UVA walk is reproduced.

Steps:
1. Rules, first match wins, fix a tensor's placement before anything else;
   rules that part a quantized weight from its scales (quantized.py) are an error.
2. Candidates for the backend are the remaining tensors of the layer stacks;
   embeddings, final norms and the head stay on the GPU unless a rule moves them.
   Fused expert groups (groups.py) move by prefetch whole, by vLLM's uva walk
   one fused parameter (w13, w2) at a time, by a budget one expert of one
   fused parameter at a time; a rule or pattern that splits an expert, or
   prefetches part of a group, is an error. A tensor holding every expert at
   once (prefused.py: GPT-OSS, Llama 4) is one unit for all three; a weight
   and its scales always move together. Where a budget drives the placement
   (not vLLM's own knobs, which keep vLLM's order), what runs in no decode
   step (vision towers and their projectors, MTP layers) goes to uva first,
   stacks or not: it costs a decode step nothing wherever it lives.
3. The backend: `auto` is prefetch if `prefetch.group_size > 0`, else uva if
   `uva.offload_gib > 0` or a budget is set, else nothing. `mixed` chooses per
   tensor by predicted step time (mixed.py).
4. If a budget is set and the plan fits it with the rules' placements alone
   (the whole checkpoint, when no rule offloads), the backend offloads
   nothing and the plan says so: offloading more would only cost speed.
5. uva: walk the candidates (only those matching `uva.params`, if given) and
   offload each one while the offloaded total is below `offload_gib` GiB (so
   the last one may overshoot, as in vLLM); with no amount, offload until the
   GPU footprint is within the budget, rarely-run layers first.
6. prefetch: stack position i (counted over the stack layers that run in
   every decode step, in order) is offloaded
   iff `i % group_size >= group_size - num_in_group`; within it, the tensors
   matching `prefetch.params` (all, if none given). With no group_size,
   rarely-run layers go to uva first; then the fewest layers that run every
   step, spread evenly over those that have candidates, stream such that GPU
   bytes plus the buffer pool fit the budget; if no count fits, the count
   with the smallest footprint, which the error quotes.
   Only layers that run in every forward stream (the slots rotate in one
   order, which a text prompt skipping a vision tower would break); a rule
   that prefetches another is an error (placement_errors.check_streamed_runs).
   A backend asked to offload that cannot is an error naming the key to set:
   `backend: uva` or `prefetch` with no amount, group and budget; a group_size
   larger than the stack; `params` or rules that leave the backend no tensor.
7. The prefetch pool: the k-th prefetched layer uses slot k mod S, where
   S = min(step, prefetched layers) (vLLM allocates `step` slots; extra ones
   would never be used). A slot holds the largest prefetched layer, each
   laid out in it as slots.py says. A layer's copy starts after the
   forward of the previous user of its slot, cyclically; for step | layers
   that is the layer `step` positions earlier, exactly vLLM's schedule.
8. Prefill staging (staging.py): the layers holding uva tensors other than
   embeddings and routed experts copy them through 2 GPU slots at prefill,
   unless `uva.stage_prefill: false`. The slots count in the footprint like
   the prefetch pool, so every budget-driven walk sees them grow as it moves
   tensors to uva (footprint.py `fit`).
9. A budget that the result exceeds is an error quoting the smallest
   budget_gib that this policy fits (exact to the byte: see
   `smallest_budget_gib`), and what is pinned to the GPU outside the stacks.
   It is the real minimum because whether a policy fits is monotonic in the
   budget: the fixed amounts (offload_gib, group_size) do not depend on it,
   and the budget-driven walks only decide where to stop. The footprint is not
   monotonic in what they move (each prefetch slot adds a layer, each staging
   slot grows with the largest staged layer), so a walk that never fits
   leaves the smallest footprint it passed (`Footprint.fit`), the count
   search the smallest of every count tried (schedule.fewest_layers), and
   mixed quotes the smallest of its strategies.
10. The cost model (cost.py) predicts every plan's bytes over the link, step
   time and prefill, per layer and in total, whatever the backend: from the
   routing profile (`workload.routing`, routing.py) where the policy names
   one, which must count every MoE layer of the checkpoint, else assuming
   uniform routing.
11. The notes are computed from the final placements (notes.py).

Example: group_size 8, num_in_group 2 over 61 layers offloads layers
6, 7, 14, 15, 22, 23, 30, 31, 38, 39, 46, 47, 54, 55.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import chain

from .checkpoint import TensorInfo
from .cost import CostModel
from .errors import BudgetError, PolicyError
from .footprint import Footprint
from .graph import Layer, LayerGraph
from .groups import FusedGroups, experts_map, whole_groups
from .hardware import H100, Hardware
from .mixed import place_mixed
from .notes import Outcome, notes
from .patterns import Names
from .plan import Backend, Cost, LayerBytes, Placement, PrefetchSchedule, PrefillStaging, Role, Runs, Summary
from .policy import Policy, resolve_backend
from .routing import RoutingProfile, check_fits
from .schedule import fewest_layers, make_schedule
from .staging import make_staging
from .quantized import check_rules
from .placement_errors import check_groups, check_roles, check_streamed_runs, layer_list, nothing_left, over_budget
from .prefused import prefused_key
from .units import GIB, plural

GPU, UVA, PREFETCH = Placement.GPU, Placement.UVA, Placement.PREFETCH


@dataclass(frozen=True)
class Decision:
    """Everything a plan says about placements; `build` adds the file facts (paths, fingerprints)."""

    backend: Backend  # what ran: none, uva, prefetch or mixed
    params: dict[str, Placement]  # execution order
    prefetch: PrefetchSchedule | None
    layers: tuple[LayerBytes, ...]
    notes: tuple[str, ...]
    summary: Summary
    cost: Cost
    prefill: PrefillStaging | None = None


def decide(graph: LayerGraph, tensors: Mapping[str, TensorInfo], policy: Policy,
           hardware: Hardware = H100, top_k: int | None = None, routing: RoutingProfile | None = None,
           checkpoint_fingerprint: str | None = None, num_experts: int | None = None) -> Decision:
    """Placements for every tensor (see the module doc); `hardware`, `top_k` (experts per
    token, from the workload or config.json) and `routing` (the policy's routing profile,
    which must fit the checkpoint's MoE layers) feed the cost model that every plan reports
    and that `backend: mixed` decides with. `checkpoint_fingerprint` tells the notes whether
    the profile was recorded on this checkpoint; `num_experts` (config.json's) checks the
    first dimension of experts stored already fused (prefused.py).

    A pipeline over one state: the placement and its `Footprint`, which every step
    moves tensors through, and the fused groups, found once.
    """
    place = {n: GPU for layer in graph.layers for n in layer.params}
    names = Names(place)
    fixed: set[str] = set()
    won: list[set[str]] = []  # per rule, the tensors it places (first match wins)
    as_experts: list[set[str]] = []  # per rule, the tensors it calls experts (`role: expert`)
    roles = {}
    for rule in policy.rules:
        matched = names.select(rule.patterns)
        as_experts.append(matched if rule.role is Role.EXPERT else set())
        if rule.role is not None:
            for n in matched:
                roles.setdefault(n, rule.role)
        mine = matched - fixed if rule.place is not None else set()
        won.append(mine)
        fixed |= mine
        for n in mine:
            place[n] = rule.place
    check_rules(policy.path, place, fixed, tensors)
    stack = graph.stack_layers()
    stacked = [n for l in stack for n in l.params]
    groups = FusedGroups.find(stacked, {n: tensors[n].shape for n in stacked if prefused_key(n)}, num_experts)
    selected = {"uva": names.select(policy.uva.params) if policy.uva.params else None,
                "prefetch": names.select(policy.prefetch.params) if policy.prefetch.params else None}
    check_groups(groups, won, selected, policy)
    check_roles(groups, as_experts, policy)
    check_streamed_runs(graph, won, policy)
    in_step = {n for l in graph.layers if l.runs is Runs.STEP for n in l.params}
    moe = {g: count for g, members in groups.members.items()
           if members[0] in in_step and (count := groups.experts(g))}
    if routing is not None:
        check_fits(routing, moe, top_k, policy.where("workload.routing"), policy.checkpoint)
    work, stage = policy.workload, policy.uva.stage_prefill
    model = CostModel(graph, tensors, hardware, work.batch_size, groups, top_k, roles, routing, work.cuda_graphs,
                      prompt_tokens=work.prompt_tokens, stage=stage)
    backend, reason = resolve_backend(policy)
    budget = policy.budget_bytes
    step = policy.prefetch.step
    if (backend is Backend.PREFETCH or PREFETCH in place.values()) and step < 1:
        raise PolicyError(f"{policy.path}: prefetch.step must be >= 1: rules place tensors on prefetch")
    fp = Footprint(graph, tensors, place, step, stage)
    skipped = None
    prediction = None
    mixed_notes: tuple[str, ...] = ()
    reasons: dict[str, str] = {}

    if backend is not Backend.NONE and budget is not None and fp.total <= budget:
        skipped, backend = backend, Backend.NONE  # offloading more would only cost speed
    elif backend is Backend.UVA:
        _uva(stack, fixed, fp, policy, groups, selected["uva"], graph.rarely_run())
    elif backend is Backend.PREFETCH:
        _prefetch(stack, fixed, fp, policy, graph, selected["prefetch"], groups)
    elif backend is Backend.MIXED:
        choice = place_mixed(graph, policy, fp, fixed, groups, model)
        fp, prediction, mixed_notes, reasons = choice.footprint, choice.prediction, choice.notes, choice.why
    place = fp.place
    if budget is not None and fp.total > budget:
        raise BudgetError(over_budget(policy, backend, fp.total, place, tensors, graph, fp.stage_pool))
    schedule = make_schedule(graph, place, tensors, step)
    staging = make_staging(graph, place, tensors, hardware.stage_above_tokens, fp.stageable) if stage else None
    if (staging.pool_bytes if staging else 0) != fp.stage_pool:  # one rule, two sums: a bug, not an input error
        raise AssertionError(f"staging pool {staging} against the footprint's {fp.stage_pool}")
    prediction = prediction or model.predict(place)
    by = {GPU: 0, UVA: 0, PREFETCH: 0}
    layers = []
    for l, c in zip(graph.layers, prediction.layers):
        mine = {GPU: 0, UVA: 0, PREFETCH: 0}
        for n in l.params:
            mine[place[n]] += tensors[n].nbytes
        for k in by:
            by[k] += mine[k]
        layers.append(LayerBytes(l.name, mine[GPU], mine[UVA], mine[PREFETCH], c.h2d_bytes, c.gpu_us,
                                 reasons.get(l.name), l.runs, experts_map(l.params, place.__getitem__, l.name + ".")))
    summary = Summary(by[GPU], by[UVA], by[PREFETCH], fp.pool, prediction.h2d_bytes, prediction.step_us,
                      fp.stage_pool)
    cost = Cost(hardware.name, prediction.batch_size, prediction.cpu_us, prediction.gpu_us, prediction.link_us,
                work.cuda_graphs, prediction.prompt_tokens, prediction.prefill_us)
    outcome = Outcome(policy, backend, reason, skipped, place, frozenset(fixed), tensors, graph, schedule,
                      mixed_notes, bool(groups.members) and top_k is None and routing is None,
                      routing, bool(moe) and top_k is not None and routing is None, checkpoint_fingerprint, staging,
                      groups.not_experts)
    return Decision(backend, place, schedule, tuple(layers), notes(outcome), summary, cost, staging)


def _rarely_run_first(rare: list[Layer], fixed, fp: Footprint, groups: FusedGroups, selected):
    """The units budget-driven placement offloads to uva first: what does not run in every decode step
    (vision towers, MTP layers: graph.py) costs a decode step nothing, wherever it lives. Lazy: each
    unit is taken from the placement as the walk (`Footprint.fit`) reaches it."""
    for layer in rare:
        for n in layer.params:
            if n not in fixed and fp.place[n] is GPU and (selected is None or n in selected):
                yield groups.expert(n)


def _uva(stack, fixed, fp: Footprint, policy: Policy, groups: FusedGroups, selected, rare: list[Layer]) -> None:
    """The per-tensor walk. With an amount, vLLM's walk over the stacks in order, in vLLM's units (a layer's
    fused w13 or w2 whole); with a budget, rarely-run layers first, then one expert of one fused parameter
    at a time. Neither moves what rules fixed or `uva.params` left out."""
    amount = policy.uva.offload_gib > 0
    if not amount and policy.budget_bytes is None:  # only `backend: uva` gets here
        raise PolicyError(
            f"{policy.path}: backend: uva offloads nothing: set uva.offload_gib (GiB to offload, as vLLM's "
            "cpu_offload_gb) or budget_gib (offload until the GPU footprint fits)"
            + ("; uva.params only narrows which tensors those offload" if selected is not None else ""))
    cands = [n for l in stack for n in l.params if n not in fixed and (selected is None or n in selected)]
    if not cands and (amount or selected is not None):
        raise PolicyError(nothing_left(policy, "uva", stack, selected))
    allowed = set(cands)

    def units(unit):
        """Each unit the walk reaches, less what rules fixed or `uva.params` left out."""
        for n in cands:
            if fp.place[n] is GPU:
                yield [m for m in unit(n) if m in allowed and fp.place[m] is GPU]

    if amount:  # vLLM's walk, in vLLM's units: a fused parameter (w13, w2) whole
        limit = policy.uva.offload_gib * GIB
        done = 0
        for unit in units(groups.param):
            if done >= limit:
                break
            resident = fp.resident
            fp.move(unit, UVA)  # with any quantization scales
            done += resident - fp.resident
        return
    fp.fit(chain(_rarely_run_first(rare, fixed, fp, groups, selected), units(groups.expert)), UVA,
           policy.budget_bytes)


def _prefetch(stack, fixed, fp: Footprint, policy: Policy, graph: LayerGraph, selected, groups: FusedGroups) -> None:
    pre = policy.prefetch

    def chosen(layer: Layer) -> list[str]:
        names = [n for n in layer.params if n not in fixed and (selected is None or n in selected)]
        return whole_groups(names, groups)

    if pre.group_size > 0:
        g, k = pre.group_size, pre.num_in_group
        every = [l for l in stack if l.runs is Runs.STEP]  # a vision tower or MTP layer is never streamed
        if g > len(every):
            rare = f", {len(stack) - len(every)} more run in no decode step" if len(every) < len(stack) else ""
            raise PolicyError(
                f"{policy.path}: prefetch.group_size {g} is larger than the {plural(len(every), 'layer')} of "
                f"the layer stacks ({', '.join(graph.stacks) or 'none detected'}{rare}): layer i streams iff "
                f"i % {g} >= {g - k}, so the groups never repeat; set prefetch.group_size to at most "
                f"{len(every)} (or use budget_gib and let the planner choose the layers)")
        picked = [layer for i, layer in enumerate(every) if i % g >= g - k]
        if not any(chosen(l) for l in picked):
            raise PolicyError(nothing_left(policy, "prefetch", picked, selected,
                                            f"prefetch.group_size {g} / num_in_group {k} streams layers "
                                            f"{layer_list(picked)}, but "))
        for layer in picked:
            fp.move(chosen(layer), PREFETCH)
        return
    if policy.budget_bytes is None:  # only `backend: prefetch` gets here
        raise PolicyError(
            f"{policy.path}: backend: prefetch offloads nothing: set prefetch.group_size (with "
            "num_in_group: stream the last num_in_group layers of every group, as vLLM's "
            "offload_group_size) or budget_gib (stream the fewest layers that fit)")
    eligible = [(l, c) for l, c in ((l, chosen(l)) for l in stack if l.runs is Runs.STEP) if c]
    rare = graph.rarely_run()
    if not eligible and not rare and selected is not None:
        raise PolicyError(nothing_left(policy, "prefetch", stack, selected))
    if not fp.fit(_rarely_run_first(rare, fixed, fp, groups, selected), UVA, policy.budget_bytes):
        for layer, names in fewest_layers(eligible, fp, policy.budget_bytes):
            fp.move(names, PREFETCH)
