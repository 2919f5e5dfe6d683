"""Fused expert groups: checkpoint tensors that the runtime holds as a few stacked parameters.

Checkpoints store MoE experts one tensor each (`mlp.experts.7.up_proj.weight`).
transformers 5.x and vLLM stack every expert of a layer's `experts` module
along a first dimension and join gate and up along the next:
`gate_up_proj[e] = [gate_e; up_e]` (vLLM's `w13`, from Mixtral's `w1` and
`w3`); every other projection (`down_proj`, `w2`) is stacked alone. The same
suffix (`.weight`, `.bias`, `.weight_scale_inv`) fuses with its own kind only.
So a fused parameter's bytes are `gate_0, up_0, gate_1, up_1, ...` or
`down_0, down_1, ...`, the memory order that slots.py lays out and the
runtime checks against transformers' own conversion.

Three units follow, coarse to fine:
- the group: every tensor of one `experts` module. Prefetch streams a group
  whole (its parameters are views of the slot);
- the parameter: one fused parameter's pieces over all experts (a layer's
  w13, or w2): the unit of vLLM's uva walk (`uva.offload_gib`);
- the expert: one expert's pieces of one parameter (`gate_e` and `up_e`, or
  `down_e`): the unit of per-expert placement. A group's experts may be split
  between the GPU and uva, one expert of one parameter at a time; the runtime
  reads the resident ones from HBM and the others in place (runtime/execute/experts.py).
A rule or `params` pattern that splits an expert, or prefetches part of a
group, is an error.

Grouping is by name: `<prefix>.experts.<N>.<proj><suffix>` belongs to group
`<prefix>.experts`. Shared experts (`mlp.shared_experts.*`) are no member.
Experts stored already fused (`mlp.experts.gate_up_proj` [E, ...], GPT-OSS,
Llama 4: prefused.py) are members too, by name, but one tensor holds a
parameter of every expert: it is its own parameter and expert unit, placed
whole, since the plan is keyed by checkpoint tensor names. Given the
tensors' shapes, `FusedGroups.find` also checks that its first dimension
counts the group's experts (`rows_of`), which the cost model needs to count
the touched experts' rows of it (prefused.py `expert_rows`). What a name says is
expert_names.py; `FusedGroups.of_layers` reads it once per layer template (alike.py).
"""
from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from itertools import filterfalse
from operator import itemgetter

from ..inputs.checkpoint import TensorInfo
from ..inputs.prefused import expert_rows, prefused_key
from ..units import plural
from .alike import applies
from .expert_names import key, matches, piece

# (token, expert) pairs up to which an experts forward runs batched_mm's arithmetic (runtime/execute/experts.py):
# a copy of each pair's expert weights in HBM, then one GEMV per pair; above, grouped_mm reads them in place
BATCHED_PAIRS = 16
_EXPERT = itemgetter(1)  # of a piece: (parameter, expert, place)


def expert_number(name: str) -> int | None:
    """The expert a tensor belongs to (`mlp.experts.7.up_proj.weight`: 7), or None for no expert's."""
    k = key(name)
    return None if k is None else k[2]


def is_expert(name: str) -> bool:
    """Whether a tensor belongs to a fused expert group by its name: one expert's, or every expert's at once."""
    return key(name) is not None or prefused_key(name) is not None


@dataclass(frozen=True)
class FusedGroups:
    """A checkpoint's fused expert groups, found once per plan; the three units of the module doc.

    Kept per group: its members, and for those stored one expert each their pieces (parameter,
    expert, place in the expert's block); the maps by member (`group_of`, `index_of`, `param_of`, `expert_of`)
    are put together when first asked for (a prefetch plan asks none: layer by layer, its templates tell)."""

    members: dict[str, tuple[str, ...]]  # group -> its member tensors, in checkpoint order
    rows_of: dict[str, int] = field(default_factory=dict)  # pre-fused member -> its experts, along dim 0
    not_experts: dict[str, str] = field(default_factory=dict)  # pre-fused member whose rows are not -> why
    # group -> (its per-expert members, in order; their pieces: (parameter, expert, place in the expert's block))
    pieces: dict[str, tuple[list[str], list[tuple[str, int, int]]]] = field(default_factory=dict, repr=False)

    @classmethod
    def find(cls, names: Iterable[str], shapes: Mapping[str, tuple[int, ...]] | None = None,
             experts: int | None = None) -> "FusedGroups":
        """The groups of `names`. `shapes` (the headers') and `experts` (config.json's count) check
        which pre-fused members hold one expert per row (prefused.py); without shapes (a plan's names
        alone) those are members whose rows are unknown: `rows_of` is empty."""
        found: tuple[dict, dict, dict] = ({}, {}, {})
        _add(list(names), found)
        return cls._made(*found, shapes, experts)

    @classmethod
    def of_layers(cls, layers, tensors: Mapping[str, TensorInfo], experts: int | None = None) -> "FusedGroups":
        """`find` of the layers' tensors (in the layers' order) with their shapes, read from each layer's
        template (alike.py): the names of layers alike are classified once, not once per layer."""
        found: tuple[dict, dict, dict] = ({}, {}, {})
        members, stacked, pieces = found
        for l in layers:
            if l.template is None or not applies(l.name):
                _add(list(l.params), found)
                continue
            params = l.params
            for local, every, each, their, whole in l.template.takers:  # each takes its tensors at once, in C
                group = l.name + local
                members.setdefault(group, []).extend(every(params))
                if their:
                    mine = pieces.setdefault(group, ([], []))
                    mine[0].extend(each(params))
                    mine[1].extend(their)
                if whole is not None:
                    stacked.setdefault(group, []).extend(whole(params))
        shapes = {n: tensors[n].shape for ms in stacked.values() for n in ms}
        return cls._made(members, stacked, pieces, shapes, experts)

    @classmethod
    def _made(cls, members: dict, stacked: dict, pieces: dict, shapes, experts: int | None) -> "FusedGroups":
        rows_of, not_experts = {}, {}  # pre-fused member -> its experts; -> why its rows are not
        if shapes is not None and stacked:
            counted = {g: len(set(map(_EXPERT, pieces[g][1]))) if g in pieces else 0 for g in stacked}
            rows_of, not_experts = expert_rows(stacked, shapes, counted, experts)
        return cls({g: tuple(ms) for g, ms in members.items()}, rows_of, not_experts, pieces)

    def units(self, group: str, per_expert: bool) -> list[tuple[str, ...]]:
        """A group's parameter units (or, `per_expert`, its expert units), each in memory order; none for a group
        of pre-fused tensors."""
        ns, ps = self.pieces.get(group, ((), ()))
        found: dict[tuple, list] = {}
        for n, (param, expert, part) in zip(ns, ps):
            found.setdefault((param, expert) if per_expert else param, []).append(((expert, part), n))
        return [tuple(n for _, n in sorted(ms)) for ms in found.values()]

    def _units(self, per_expert: bool) -> dict[str, tuple[str, ...]]:
        """Member -> its parameter unit (or, `per_expert`, its expert unit), in memory order."""
        out: dict[str, tuple[str, ...]] = {}
        for group in self.pieces:
            for unit in self.units(group, per_expert):
                out.update(dict.fromkeys(unit, unit))
        return out

    @cached_property
    def group_of(self) -> dict[str, str]:  # member -> its group
        out: dict[str, str] = {}
        for g, ms in self.members.items():
            out.update(dict.fromkeys(ms, g))
        return out

    @cached_property
    def index_of(self) -> dict[str, int]:  # member -> its expert number (per-expert tensors)
        return {n: p[1] for ns, ps in self.pieces.values() for n, p in zip(ns, ps)}

    @cached_property
    def param_of(self) -> dict[str, tuple[str, ...]]:
        """Member -> its parameter unit, in memory order."""
        return self._units(per_expert=False)

    @cached_property
    def expert_of(self) -> dict[str, tuple[str, ...]]:
        """Member -> its expert unit, in memory order."""
        return self._units(per_expert=True)

    @cached_property
    def _counts(self) -> dict[str, int]:
        """Group -> `experts(group)`. A group whose pieces equal the last counted group's (the layers of one
        template hold the same pieces objects: a list compare in C) has as many experts, not counted again."""
        out: dict[str, int] = {}
        last: tuple[list | None, int] = (None, 0)  # the pieces last counted, their experts
        for g, ms in self.members.items():
            pieces = self.pieces[g][1] if g in self.pieces else None
            if pieces is not None and pieces != last[0]:
                last = (pieces, len(set(map(_EXPERT, pieces))))
            out[g] = (0 if pieces is None else last[1]) or max((self.rows_of[m] for m in ms if m in self.rows_of),
                                                               default=0)
        return out

    def group(self, name: str) -> tuple[str, ...]:
        """Everything that streams with `name`: its whole group, or the tensor alone."""
        g = self.group_of.get(name)
        return (name,) if g is None else self.members[g]

    def param(self, name: str) -> tuple[str, ...]:
        """vLLM's unit: `name`'s fused parameter over all experts (w13 or w2), or the tensor alone."""
        return self.param_of.get(name, (name,))

    def expert(self, name: str) -> tuple[str, ...]:
        """The per-expert unit: `name`'s expert of its fused parameter, or the tensor alone."""
        return self.expert_of.get(name, (name,))

    def experts(self, group: str) -> int:
        """How many distinct experts the group holds: its per-expert tensors' experts, or the rows of
        its pre-fused ones; 0 when neither is known (pre-fused rows unchecked or not experts)."""
        return self._counts[group]

    def by_expert(self, group: str) -> dict[int, tuple[str, ...]]:
        """A group's per-expert tensors by expert, each expert's across its fused parameters (an expert on the
        host CPU is placed whole: placement_errors.py, mixed.py); {} for a group of pre-fused tensors."""
        out: dict[int, list[str]] = {}
        for m in self.members[group]:
            if m in self.index_of:
                out.setdefault(self.index_of[m], []).append(m)
        return {e: tuple(ms) for e, ms in out.items()}

    def routed(self, name: str) -> bool:
        """Whether routing decides what of `name` a step reads: one expert's tensor, or a pre-fused
        one whose rows are the group's experts (`rows_of`)."""
        return name in self.index_of or name in self.rows_of


def _add(names: list[str], found: tuple[dict, dict, dict]) -> None:
    """Add `names`' members to `found` (members, pre-fused members, pieces: per group)."""
    members, stacked, pieces = found
    cache: dict = {}
    for n, (group, number, proj, suffix, fused, _) in zip(names, matches(names)):
        if group:
            mine = pieces.get(group)
            if mine is None:
                mine = pieces[group] = ([], [])
            mine[0].append(n)
            mine[1].append(piece(number, proj, suffix, cache))
        elif fused:
            group = fused
            stacked.setdefault(group, []).append(n)
        else:
            continue
        if group in members:
            members[group].append(n)
        else:
            members[group] = [n]


def whole_groups(names: list[str], groups: "FusedGroups", layer) -> list[str]:
    """`names` (of `layer`, graph.py) without the members of any group they hold only part of: what prefetch may
    stream. Each group is checked once (a DeepSeek-V3 layer's holds 1,536 tensors), named by the layer's template
    (alike.py) where it has one, and `names` are walked again only where a group is split."""
    have, t = set(names), layer.template
    named = (layer.name + local for local, *_ in t.groups) if t is not None and applies(layer.name) else set(
        map(groups.group_of.get, names))  # the groups of its names: None for none, in no group's `members`
    mine = [groups.members[g] for g in named if g in groups.members]
    split = [ms for ms in mine if not have.issuperset(ms) and not have.isdisjoint(ms)]
    return list(filterfalse(set().union(*split).__contains__, names)) if split else list(names)


def split_units(groups: FusedGroups, selected: Collection[str], what: str, whole_groups: bool) -> list[str]:
    """The problem where `selected` holds part of units it must take whole: one line for `what` (a rule or a
    section), naming the first such unit, and how many there are where more than one.

    `whole_groups` (prefetch): the unit is the group; else the expert of a fused parameter.
    """
    if whole_groups and 4 * len(selected) < sum(map(len, groups.members.values())):  # a few: each unit once
        units = [(g, groups.members[g]) for g in set(map(groups.group_of.get, selected)) - {None}]
    elif whole_groups:  # many: every group's members looked up in their order (a set's order is at random in memory)
        units = [(g, ms) for g, ms in groups.members.items() if any(map(selected.__contains__, ms))]
    else:  # one expert's tensors (`key`: named `.experts.`; a rule of a few others asks no map)
        units = [(groups.group_of[u[0]], u) for u in {groups.expert_of[m] for m in selected
                                                       if ".experts." in m and m in groups.index_of}]
    split = sorted((group, unit) for group, unit in units  # in C: a group of DeepSeek-V3 holds 1,536
                   if len(unit) >= 2 and not all(map(selected.__contains__, unit)))
    if not split:
        return []
    group, unit = split[0]
    picked = list(filter(selected.__contains__, unit))
    if whole_groups:
        more = f" (and {plural(len(split) - 1, 'more group')} alike)" if len(split) > 1 else ""
        return [f"{what} selects {len(picked)} of the {len(unit)} tensors of fused group {group} (e.g. {picked[0]})"
                f"{more}; prefetch streams a group whole, since its fused parameters are views of one slot: select "
                "all of them (for example with the pattern `experts`), or place experts on uva"]
    missing = next(n for n in unit if n not in selected)
    more = f" (and in {plural(len(split) - 1, 'more expert')} alike)" if len(split) > 1 else ""
    return [f"{what} selects {picked[0]} but not {missing}{more}: they are one row of a fused parameter at run time "
            "(transformers and vLLM join gate and up), so select both"]
