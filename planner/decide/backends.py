"""The backends' placements: one attempt of `placement.decide`, over a copy of the rules' placement.

`place_backend` runs the policy's backend (placement.py steps 4-6: nothing
when the budget already fits, the uva walk, the prefetch walk, or mixed.py)
through a `Footprint`, with the cost model that placement.py built for the
plan's prefill (staging routed experts or not: staging.py `stage_experts`).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import chain, filterfalse

from ..errors import PolicyError
from ..inputs.checkpoint import TensorInfo
from ..inputs.policy import Policy
from ..layers.alike import template_groups
from ..layers.graph import Layer, LayerGraph
from ..layers.groups import FusedGroups, whole_groups
from ..plan import Backend, Placement, Runs
from ..units import GIB, plural
from .cost import CostModel, Prediction
from .footprint import Footprint
from .mixed import place_mixed
from .placement_errors import layer_list, nothing_left
from .schedule import fewest_layers

GPU, UVA, PREFETCH = Placement.GPU, Placement.UVA, Placement.PREFETCH


@dataclass(frozen=True)
class Placed:
    """One placement by `place_backend`: its footprint, prediction, the backend that ran (or was skipped), notes."""

    fp: Footprint
    prediction: Prediction
    backend: Backend
    skipped: Backend | None
    notes: tuple[str, ...]
    reasons: dict[str, str]

    total = property(lambda self: self.fp.total)  # working.py `within`
    place = property(lambda self: self.fp.place)


def place_backend(model: CostModel, graph: LayerGraph, tensors: Mapping[str, TensorInfo], place: dict[str, Placement],
                  stage: bool, policy: Policy, backend: Backend, stack, fixed, groups: FusedGroups,
                  selected, budget: int | None, room: Callable[[Mapping[str, Placement]], int] = lambda p: 0,
                  most: int = 0) -> Placed:
    """The backend's placement over `place` (which it changes), prefill staging experts as `model` says
    (placement.py, steps 4-6 and 8), its walks stopping within `budget`: the policy's, less the room that
    placement.py keeps for the experts' working memory. mixed.py keeps each strategy's own room free
    (`room(place)`, at most `most`: working.py `within`)."""
    fp = Footprint(graph, tensors, place, policy.prefetch.step, stage, partner=model.quantized,
                   stageable_names=lambda: model.unstaged_experts, shapes=model.shapes)
    skipped, prediction, notes, reasons = None, None, (), {}
    if backend is not Backend.NONE and budget is not None and fp.total + room(fp.place) <= budget:
        skipped, backend = backend, Backend.NONE  # offloading more would only cost speed
    elif backend is Backend.UVA:
        _uva(stack, fixed, fp, policy, groups, selected["uva"], graph.rarely_run(), budget)
    elif backend is Backend.PREFETCH:
        _prefetch(stack, fixed, fp, policy, graph, selected["prefetch"], groups, budget)
    elif backend is Backend.MIXED:
        choice = place_mixed(graph, policy, fp, fixed, groups, model, budget, room, most)
        fp, prediction, notes, reasons = choice.footprint, choice.prediction, choice.notes, choice.why
    return Placed(fp, prediction or model.predict(fp.place), backend, skipped, notes, reasons)


def _rarely_run_first(rare: list[Layer], fixed, fp: Footprint, groups: FusedGroups, selected):
    """The units budget-driven placement offloads to uva first: what does not run in every decode step
    (vision towers, MTP layers: graph.py) costs a decode step nothing, wherever it lives. Lazy: each
    unit is taken from the placement as the walk (`Footprint.fit`) reaches it."""
    for layer in rare:
        for n in layer.params:
            if n not in fixed and fp.place[n] is GPU and (selected is None or n in selected):
                yield groups.expert(n)


def _uva(stack, fixed, fp: Footprint, policy: Policy, groups: FusedGroups, selected, rare: list[Layer],
         budget: int | None) -> None:
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
    fp.fit(chain(_rarely_run_first(rare, fixed, fp, groups, selected), units(groups.expert)), UVA, budget)


def _prefetch(stack, fixed, fp: Footprint, policy: Policy, graph: LayerGraph, selected, groups: FusedGroups,
              budget: int | None) -> None:
    pre = policy.prefetch

    def chosen(layer: Layer) -> list[str]:
        names = layer.params if selected is None else selected.of(layer)
        return whole_groups(list(filterfalse(fixed.__contains__, names)), groups, layer)

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
        fixed_in = {p for n in fixed for p in _prefixes(n)}  # the names of the layers that may hold them
        known: dict[tuple, tuple[bool, ...]] = {}
        for layer in picked:
            marks = None if layer.name in fixed_in else _streamable(layer, selected, groups, known)
            if marks is None:
                fp.move(chosen(layer), PREFETCH, layer)
            else:
                fp.move_picked(layer, marks, PREFETCH)
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
    if not fp.fit(_rarely_run_first(rare, fixed, fp, groups, selected), UVA, budget):
        for layer, names in fewest_layers(eligible, fp, budget):
            fp.move(names, PREFETCH, layer)


def _prefixes(name: str):
    """`name` and each name it extends by dotted parts: a layer holds only tensors named as it or under it."""
    while name:
        yield name
        name = name.rpartition(".")[0]


def _streamable(layer: Layer, selected, groups: FusedGroups, known: dict) -> tuple[bool, ...] | None:
    """What `_prefetch` streams of a layer no rule placed a tensor of, as marks over its tensors: what `selected`
    picks, less every fused group it picks part of (groups.py `whole_groups`); found once per template (alike.py)
    and picks. None where its picks or groups are not its template's (then named one by one)."""
    mine = template_groups(groups.members, layer)
    picks = None if mine is None else layer.template.every if selected is None else selected.marks(layer)
    if picks is None:
        return None
    key = (layer.template, id(picks), tuple(ms is not None for _, ms, _ in mine))
    marks = known.get(key)
    if marks is None:
        got = list(picks)
        for _, ms, every in mine:
            if ms is not None and len(set(map(picks.__getitem__, every))) == 2:  # picked in part: left
                for i in every:
                    got[i] = False
        marks = known[key] = tuple(got)
    return marks
