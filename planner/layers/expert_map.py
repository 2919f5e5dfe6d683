"""Where a layer's experts are, as people read it: the layer table's `experts` column (`mlp.experts: gpu 0-31, uva
32-127`) and the units `plan show --tensors` and `plan diff` list (each fused expert group once per placement).

Takes a layer (graph.py) and its placements; reads the layer's template (alike.py) where one applies, so that a
layer's thousands of expert tensors are classified once per kind of layer, not once per plan reader.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import groupby

from .alike import applies
from .groups import FusedGroups


def group_numbers(layer) -> tuple[Sequence[str | None], Sequence[int | None]]:
    """Per tensor of `layer` (graph.py): its fused group (None for none) and its expert (None for none, or for a
    member holding every expert at once), from the layer's template where that applies (alike.py)."""
    t = layer.template
    if t is not None and applies(layer.name):
        _, numbers, local = t.numbered
        return [None if g is None else layer.name + g for g in local], numbers
    groups = FusedGroups.find(layer.params)
    return list(map(groups.group_of.get, layer.params)), list(map(groups.index_of.get, layer.params))


def ranges(numbers: Iterable[int]) -> str:
    """`0-3,7,9-10`: sorted numbers with runs folded."""
    runs = [[n for _, n in run] for _, run in groupby(enumerate(sorted(numbers)), lambda p: p[1] - p[0])]
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def experts_map(layer, placement_of) -> str | None:
    """Which experts of each split group of `layer` (graph.py) are where, compactly: `mlp.experts: gpu 0-31, uva
    32-127`.

    Only groups whose experts are not all in one place appear; when the
    group's fused parameters differ, each gets its own entry
    (`mlp.experts.gate_up_proj: ...; mlp.experts.down_proj: ...`), named after the layer's name. None when
    nothing is split. The members and their experts come from the layer's template (alike.py) where it has
    one: a layer of Kimi-K2 holds 2,304 experts' tensors, and every layer of a per-expert plan is asked.
    """
    if len(set(map(placement_of, layer.expert_tensors))) < 2:
        return None  # the experts all in one place: no group is split
    entries, cut = [], len(layer.name) + 1
    for group, names, pieces in _per_expert(layer):
        got: dict[tuple, set[int]] = {}  # (parameter, placement) -> experts
        for (param, expert, _), place in zip(pieces, map(placement_of, names)):
            experts = got.get((param, place))
            if experts is None:
                got[(param, place)] = {expert}
            else:
                experts.add(expert)
        params: dict[str, dict[str, set[int]]] = {}  # parameter -> placement -> experts
        for (param, place), experts in got.items():
            params.setdefault(param, {})[place.value] = experts
        if all(len(p) == 1 for p in params.values()) and len({next(iter(p)) for p in params.values()}) == 1:
            continue  # the whole group in one place
        local = group[cut:] if group.startswith(layer.name + ".") else group
        described = {param: ", ".join(f"{place} {ranges(e)}" for place, e in sorted(by.items()))
                     for param, by in sorted(params.items())}
        if len(set(described.values())) == 1:
            entries.append(f"{local}: {next(iter(described.values()))}")
        else:
            entries += [f"{local}.{param}: {text}" for param, text in described.items()]
    return "; ".join(entries) or None


def _per_expert(layer) -> Iterable[tuple[str, list[str], list[tuple[str, int, int]]]]:
    """(group, its members stored one expert each, their pieces) of each fused group of `layer`, in the order of
    its first member: from its template where that applies (alike.py), else from its names."""
    t = layer.template
    if t is not None and applies(layer.name):
        params = layer.params
        return [(layer.name + local, [params[i] for i in each], their)
                for local, _, each, their, _ in t.groups if each]
    return [(group, ns, ps) for group, (ns, ps) in FusedGroups.find(layer.params).pieces.items()]
