"""Deciding placements: a pure function from (layer graph, tensor sizes, policy) to placements.

Order. Everything walks the layer graph's execution order, and within a layer
the natural order of tensor names (natural.py `natural_key`): that is the
"stable order" in which vLLM's per-parameter UVA walk is reproduced.

Steps:
1. Rules, first match wins, fix a tensor's placement before anything else;
   rules that part a quantized weight from its scales (quantized.py) are an error,
   and so is `place: cpu` on anything but whole routed experts (of the backends only mixed
   chooses cpu, with `cpu_experts: true`: mixed.py).
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
   embeddings copy them through 2 GPU slots at prefill, unless
   `uva.stage_prefill: false`; routed experts only when the workload's prompt
   is predicted to touch most of them (cost.py `favours_staged_experts`),
   through the expert ring, which each staged forward allocates; under a
   budget, `backend: mixed` also places without staging them (the ring's GPU
   memory then holds experts) and keeps the faster request, unless
   `uva.stage_experts` says which. The slots
   count in the footprint like the prefetch pool, so every budget-driven walk
   sees them grow as it moves tensors to uva (footprint.py `fit`).
9. The experts' working memory (working.py: their touched rows per forward,
   the ring, the lookahead's and the host engine's buffers) is in the
   plan's footprint, and the budget walks leave room for it: the walk is
   repeated with the room its last placement needs kept free, the last
   time with the room of every movable expert on uva (working.py `within`;
   mixed.py per strategy). A budget that the result exceeds is an error
   quoting the smallest budget_gib that this policy fits (exact to the byte
   where no working memory moves with the walk: see `smallest_budget_gib`),
   and what is pinned to the GPU outside the stacks.
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
import dataclasses
from dataclasses import dataclass
from itertools import chain, repeat

from ..errors import BudgetError, PolicyError
from ..inputs.checkpoint import TensorInfo
from ..inputs.hardware import H100, Hardware
from ..inputs.patterns import Names
from ..inputs.policy import Policy, resolve_backend
from ..inputs.quantized import check_rules, partners
from ..inputs.routing import RoutingProfile, check_fits
from ..layers.alike import Shapes, applies, select
from ..layers.graph import LayerGraph
from ..layers.expert_map import experts_map
from ..layers.groups import FusedGroups
from ..layers.selection import Selection
from ..plan import Backend, Cost, LayerBytes, Placement, PrefetchSchedule, PrefillStaging, Role, Summary
from .backends import place_backend
from .cost import CostModel
from .footprint import bytes_by_placement
from .notes import Outcome, notes
from .placement_errors import check_cpu, check_groups, check_roles, check_streamed_runs, over_budget
from .schedule import make_schedule
from .staging import make_staging
from .working import GroupFacts, within, working

GPU, UVA, PREFETCH, CPU = Placement.GPU, Placement.UVA, Placement.PREFETCH, Placement.CPU


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
    collectives: tuple[int, int] = (0, 0)  # tensor parallelism: collectives per step and their predicted us


def decide(graph: LayerGraph, tensors: Mapping[str, TensorInfo], policy: Policy,
           hardware: Hardware = H100, top_k: int | None = None, routing: RoutingProfile | None = None,
           checkpoint_fingerprint: str | None = None, num_experts: int | None = None,
           quantized: Mapping[str, str] | None = None, collectives: Mapping[str, tuple[int, int]] | None = None,
           shapes: Shapes | None = None) -> Decision:
    """Placements for every tensor (see the module doc); `hardware`, `top_k` (experts per
    token, from the workload or config.json) and `routing` (the policy's routing profile,
    which must fit the checkpoint's MoE layers) feed the cost model that every plan reports
    and that `backend: mixed` decides with. `checkpoint_fingerprint` tells the notes whether
    the profile was recorded on this checkpoint; `num_experts` (config.json's) checks the
    first dimension of experts stored already fused (prefused.py); `quantized` is quantized.py's
    `partners(tensors)` and `shapes` alike.py's over `tensors`, when the caller has them. Under tensor
    parallelism `tensors` is one GPU's share (shards.py `local_tensors`), the policy's budget each GPU's, and
    `collectives` the all-reduces and all-gathers of each layer (shards.py `collectives`), which the cost model
    adds to its predictions.

    A pipeline over one state: the placement and its `Footprint`, which every step
    moves tensors through, and the fused groups, found once.
    """
    place = dict.fromkeys(chain.from_iterable(layer.params for layer in graph.layers), GPU)
    names = Names(place)
    fixed: set[str] = set()
    won: list[set[str]] = []  # per rule, the tensors it places (first match wins)
    as_experts: list[set[str]] = []  # per rule, the tensors it calls experts (`role: expert`)
    roles = {}
    for rule in policy.rules:
        matched = select(graph.layers, rule.patterns, names)
        as_experts.append(matched if rule.role is Role.EXPERT else set())
        if rule.role is not None:
            for n in matched:
                roles.setdefault(n, rule.role)
        mine = matched - fixed if rule.place is not None else set()
        won.append(mine)
        fixed |= mine
        for n in mine:
            place[n] = rule.place
    quantized = partners(tensors) if quantized is None else quantized
    check_rules(policy.path, place, fixed, quantized)
    stack = graph.stack_layers()
    groups = FusedGroups.of_layers(stack, tensors, num_experts)
    selected = {"uva": Selection(graph.layers, policy.uva.params, names) if policy.uva.params else None,
                "prefetch": Selection(graph.layers, policy.prefetch.params, names) if policy.prefetch.params else None}
    check_groups(groups, won, selected, policy)
    check_roles(groups, as_experts, policy)
    check_cpu(groups, won, policy, tensors, quantized)
    check_streamed_runs(graph, won, policy)
    rare = set(chain.from_iterable(l.params for l in graph.rarely_run()))  # every other tensor runs in each step
    moe = {g: count for g, members in groups.members.items()
           if members[0] not in rare and (count := groups.experts(g))}
    if top_k and moe and top_k > min(moe.values()):
        raise PolicyError(f"{policy.where('workload.experts_per_token')}: top-k {top_k} (workload.experts_per_token, "
                          f"or config.json's) is more than the {min(moe.values())} routed experts of a layer: give "
                          "the model's top-k (num_experts_per_tok)")
    if routing is not None:
        check_fits(routing, moe, top_k, policy.where("workload.routing"), policy.checkpoint)
    work, stage = policy.workload, policy.uva.stage_prefill
    model = CostModel(graph, tensors, hardware, work.batch_size, groups, top_k, roles, routing, work.cuda_graphs,
                      prompt_tokens=work.prompt_tokens, stage=stage, quantized=quantized, collectives=collectives,
                      shapes=shapes, prefetch_slots=max(1, policy.prefetch.step))
    backend, reason = resolve_backend(policy)
    budget = policy.budget_bytes
    step = policy.prefetch.step
    if (backend is Backend.PREFETCH or PREFETCH in place.values()) and step < 1:
        raise PolicyError(f"{policy.path}: prefetch.step must be >= 1: rules place tensors on prefetch")
    want = policy.uva.stage_experts  # None: the planner decides (policy.py UvaPolicy)
    facts = GroupFacts(groups.members, tensors, stack, model.shapes)  # each kind of experts group read once

    def attempt(experts: bool):
        """The backend's placement with routed experts staged at prefill or not (their ring: working memory)."""
        staged = (lambda: model.staged_experts) if experts else (lambda: model.unstaged_experts)  # noqa: E731

        def running(place: Mapping[str, Placement], wheres=None):
            """The prefill staging of `place` and its experts' working memory (working.py; `wheres`: its)."""
            staging = make_staging(graph, place, tensors, hardware.stage_above_tokens, staged) if stage else None
            ring = {g: staging.ring_bytes for g in moe for s in (staging.layers if staging and staging.experts else ())
                    if g.startswith(s.layer + ".")}
            host = staging.above_tokens if staging else H100.stage_above_tokens  # runtime/execute/host/bind.py
            return staging, working(groups.members, moe, tensors, place, top_k, work.batch_size, work.prompt_tokens,
                                    ring, host, facts, wheres)

        room = lambda p: running(p)[1].peak_bytes  # noqa: E731
        most = room({**place, **{n: UVA for g in moe for n in groups.members[g] if n not in fixed}}) if (
            budget is not None and moe) else 0

        def walk(b: int | None):
            return place_backend(model.staging_experts(experts), graph, tensors, dict(place), stage, policy, backend,
                                 stack, fixed, groups, selected, b, room, most)

        # mixed leaves each strategy its own room (mixed.py); the other walks theirs, as working.py `within` says
        chosen = walk(budget) if budget is None or backend is Backend.MIXED else within(walk, budget, room, most)[0]
        return chosen, running, room

    favoured = model.favours_staged_experts if want is None else want
    chosen, running, room = attempt(favoured)
    fits = lambda c, r: c.prediction is not None and c.fp.total + r(c.fp.place) <= budget  # noqa: E731
    if want is None and favoured and backend is Backend.MIXED and budget is not None and (
            not fits(chosen, room) or getattr(running(chosen.fp.place)[0], "experts", False)):
        # the ring holds GPU memory that experts could: mixed weighs the request both ways (staging.py); a plan
        # that fits with no expert staged would place the same without
        other, *rest = attempt(False)
        new = policy.workload.new_tokens
        request = lambda c: c.prediction.request_us(new)  # noqa: E731
        if fits(other, rest[1]) and (not fits(chosen, room) or request(other) < request(chosen)):
            said = "routed experts not staged at prefill: " + (
                f"predicted request {request(other) / 1e3:.3f} ms, against {request(chosen) / 1e3:.3f} ms staged "
                "through their ring, whose GPU memory holds experts instead" if fits(chosen, room) else
                "staged, their ring would not fit the budget")
            chosen = dataclasses.replace(other, notes=other.notes + (said,))
            running, room = rest
        elif not fits(chosen, room) and other.fp.total + rest[1](other.fp.place) < chosen.fp.total + room(
                chosen.fp.place):  # neither fits: the budget error below names the nearer one's least
            chosen, (running, room) = other, rest
    # each layer's placements, as the cost model read them where it did (Prediction.wheres)
    wheres = {l.name: l.values(chosen.fp.place) if where is None else where
              for l, where in zip(graph.layers, chosen.prediction.wheres or repeat(None))}
    staging, runs = running(chosen.fp.place, wheres)
    if budget is not None and chosen.fp.total + runs.peak_bytes > budget:
        # the smallest budget that fits: the walk's least, or the rules' placement alone where working memory makes
        # offloading cost more than it saves (a budget that holds it offloads nothing: backends.py)
        rules = place_backend(model, graph, tensors, dict(place), stage, policy, Backend.NONE, stack, fixed, groups,
                              selected, None).fp
        least = min((chosen.fp, runs.peak_bytes), (rules, room(rules.place)), key=lambda f: f[0].total + f[1])
        raise BudgetError(over_budget(policy, chosen.backend, least[0].total + least[1], least[0].place, tensors,
                                      graph, least[0].stage_pool, least[1], won))
    fp, prediction, backend, skipped = chosen.fp, chosen.prediction, chosen.backend, chosen.skipped
    mixed_notes, reasons = chosen.notes, chosen.reasons
    place = fp.place
    if (staging.pool_bytes if staging else 0) != fp.stage_pool:  # one rule, two sums: a bug, not an input error
        raise AssertionError(f"staging pool {staging} against the footprint's {fp.stage_pool}")
    by = {GPU: 0, UVA: 0, PREFETCH: 0, CPU: 0}
    layers = []
    alike: dict[tuple, tuple] = {}  # layers alike (alike.py), placed alike: bytes by placement, experts map
    for l, c in zip(graph.layers, prediction.layers):
        where = wheres[l.name]
        key = (l.template, model.shapes(l), where) if l.template is not None and applies(l.name) else None
        got = alike.get(key) if key is not None else None
        if got is None:
            got = (bytes_by_placement(l.params, place, tensors, where),
                   experts_map(l, place.__getitem__))
            if key is not None:
                alike[key] = got
        mine, split = got
        by = {k: by[k] + mine[k] for k in by}
        layers.append(LayerBytes(l.name, mine[GPU], mine[UVA], mine[PREFETCH], c.h2d_bytes, c.gpu_us,
                                 reasons.get(l.name), l.runs, split, mine[CPU]))
    schedule = make_schedule(graph, place, tensors, step, model.shapes, fp.streamed, wheres)
    summary = Summary(by[GPU], by[UVA], by[PREFETCH], fp.pool, prediction.h2d_bytes, prediction.step_us,
                      fp.stage_pool, by[CPU], runs.decode_bytes, runs.prefill_bytes, runs.buffer_bytes)
    cost = Cost(hardware.name, prediction.batch_size, prediction.cpu_us, prediction.gpu_us, prediction.link_us,
                work.cuda_graphs, prediction.prompt_tokens, prediction.prefill_us,
                *((hardware.cpu_threads, hardware.cpu_expert_gbps, hardware.cpu_expert_sync_us) if by[CPU] else
                  (0, 0.0, 0.0)), top_k=top_k or 0 if moe else 0,
                eager_cpu_us=prediction.eager_cpu_us if work.cuda_graphs else None)
    outcome = Outcome(policy, backend, reason, skipped, place, frozenset(fixed), tensors, graph, schedule,
                      mixed_notes, bool(groups.members) and top_k is None and routing is None,
                      routing, bool(moe) and top_k is not None and routing is None, checkpoint_fingerprint, staging,
                      groups.not_experts, by, wheres,
                      tuple(i for i, (r, mine) in enumerate(zip(policy.rules, won)) if r.place is not None
                            and not mine), summary)
    said = notes(outcome)
    return Decision(backend, place, schedule, tuple(layers), said, summary, cost, staging,
                    (prediction.collectives, prediction.collectives_us))
