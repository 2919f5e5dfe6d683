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
the touched experts' rows of it (prefused.py `expert_rows`).
"""
from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from ..inputs.prefused import expert_rows, prefused_key

# (token, expert) pairs up to which an experts forward runs batched_mm's arithmetic (runtime/execute/experts.py):
# a copy of each pair's expert weights in HBM, then one GEMV per pair; above, grouped_mm reads them in place
BATCHED_PAIRS = 16
_MEMBER = re.compile(r"^(.*\.experts)\.(\d+)\.([^.]+)(.*)$")
# projection -> (the fused parameter it joins, its place within one expert's block)
FUSED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "w1": ("w13", 0), "w3": ("w13", 1)}


def _key(name: str):
    """(group, parameter, expert, place in the expert's block) of an expert tensor, or None."""
    m = _MEMBER.match(name)
    if m is None:
        return None
    fused, part = FUSED.get(m[3], (m[3], 0))
    return m[1], f"{fused}{m[4]}", int(m[2]), part


def expert_number(name: str) -> int | None:
    """The expert a tensor belongs to (`mlp.experts.7.up_proj.weight`: 7), or None for no expert's."""
    k = _key(name)
    return None if k is None else k[2]


def is_expert(name: str) -> bool:
    """Whether a tensor belongs to a fused expert group by its name: one expert's, or every expert's at once."""
    return _key(name) is not None or prefused_key(name) is not None


def units(names: Iterable[str]) -> list[tuple[str, ...]]:
    """`names` grouped into fused parameters, each unit's members in memory order (module doc).

    Units come in the order of their first member in `names`; a tensor that is
    no expert's is a unit of its own.

    >>> units(["m.experts.0.up_proj.weight", "m.experts.0.gate_proj.weight", "m.experts.1.gate_proj.weight",
    ...        "m.experts.1.up_proj.weight", "m.experts.0.down_proj.weight", "m.norm.weight"])
    [('m.experts.0.gate_proj.weight', 'm.experts.0.up_proj.weight', 'm.experts.1.gate_proj.weight', \\
'm.experts.1.up_proj.weight'), ('m.experts.0.down_proj.weight',), ('m.norm.weight',)]
    """
    members: dict[tuple, list[tuple[tuple[int, int], str]]] = {}
    for n in names:
        k = _key(n)
        if k is None:
            members[(n,)] = [((0, 0), n)]
        else:
            members.setdefault(k[:2], []).append((k[2:], n))
    return [tuple(n for _, n in sorted(ms)) for ms in members.values()]


@dataclass(frozen=True)
class FusedGroups:
    """A checkpoint's fused expert groups, found once per plan; the three units of the module doc."""

    members: dict[str, tuple[str, ...]]  # group -> its member tensors, in checkpoint order
    group_of: dict[str, str]  # member -> its group
    param_of: dict[str, tuple[str, ...]]  # member -> its parameter unit, in memory order
    expert_of: dict[str, tuple[str, ...]]  # member -> its expert unit, in memory order
    index_of: dict[str, int]  # member -> its expert number (per-expert tensors)
    rows_of: dict[str, int] = field(default_factory=dict)  # pre-fused member -> its experts, along dim 0
    not_experts: dict[str, str] = field(default_factory=dict)  # pre-fused member whose rows are not -> why

    @classmethod
    def find(cls, names: Iterable[str], shapes: Mapping[str, tuple[int, ...]] | None = None,
             experts: int | None = None) -> "FusedGroups":
        """The groups of `names`. `shapes` (the headers') and `experts` (config.json's count) check
        which pre-fused members hold one expert per row (prefused.py); without shapes (a plan's names
        alone) those are members whose rows are unknown: `rows_of` is empty."""
        members: dict[str, list[str]] = {}
        params: dict[tuple, list] = {}
        experts_of: dict[tuple, list] = {}
        stacked: dict[str, list[str]] = {}
        index_of = {}
        for n in names:
            k = _key(n)
            if k is None:
                fused = prefused_key(n)
                if fused is not None:
                    members.setdefault(fused[0], []).append(n)
                    stacked.setdefault(fused[0], []).append(n)
                continue
            group, param, expert, part = k
            members.setdefault(group, []).append(n)
            params.setdefault((group, param), []).append(((expert, part), n))
            experts_of.setdefault((group, param, expert), []).append((part, n))
            index_of[n] = expert
        param_of = {n: unit for ms in params.values() for unit in [tuple(n for _, n in sorted(ms))] for n in unit}
        expert_of = {n: unit for ms in experts_of.values() for unit in [tuple(n for _, n in sorted(ms))] for n in unit}
        rows_of: dict[str, int] = {}
        not_experts: dict[str, str] = {}
        if shapes is not None and stacked:
            counted = {g: len({index_of[m] for m in members[g] if m in index_of}) for g in stacked}
            rows_of, not_experts = expert_rows(stacked, shapes, counted, experts)
        return cls({g: tuple(ms) for g, ms in members.items()}, {m: g for g, ms in members.items() for m in ms},
                   param_of, expert_of, index_of, rows_of, not_experts)

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
        numbered = {self.index_of[m] for m in self.members[group] if m in self.index_of}
        return len(numbered) or max((self.rows_of[m] for m in self.members[group] if m in self.rows_of), default=0)

    def routed(self, name: str) -> bool:
        """Whether routing decides what of `name` a step reads: one expert's tensor, or a pre-fused
        one whose rows are the group's experts (`rows_of`)."""
        return name in self.index_of or name in self.rows_of


def whole_groups(names: list[str], groups: "FusedGroups") -> list[str]:
    """`names` without the members of any group they hold only part of: what prefetch may stream."""
    have = set(names)
    return [n for n in names if all(m in have for m in groups.group(n))]


def split_units(groups: FusedGroups, selected: Collection[str], what: str, whole_groups: bool) -> list[str]:
    """Problems where `selected` holds part of a unit it must take whole, one line per unit.

    `whole_groups` (prefetch): the unit is the group; else the expert of a fused parameter.
    """
    problems = []
    seen: set[tuple[str, ...]] = set()
    for m in selected:
        unit = groups.group(m) if whole_groups else groups.expert(m)
        if len(unit) < 2 or unit in seen:
            continue
        seen.add(unit)
        picked = [n for n in unit if n in selected]
        if len(picked) < len(unit):
            if whole_groups:
                problems.append(
                    f"{what} selects {len(picked)} of the {len(unit)} tensors of fused group {groups.group_of[m]} "
                    f"(e.g. {picked[0]}); prefetch streams a group whole, since its fused parameters are views of "
                    "one slot: select all of them (for example with the pattern `experts`), or place experts on uva")
            else:
                missing = next(n for n in unit if n not in selected)
                problems.append(
                    f"{what} selects {picked[0]} but not {missing}: they are one row of a fused parameter at run "
                    "time (transformers and vLLM join gate and up), so select both")
    return sorted(problems)


def ranges(numbers: Iterable[int]) -> str:
    """`0-3,7,9-10`: sorted numbers with runs folded."""
    out, run = [], []
    for n in sorted(numbers):
        if run and n == run[-1] + 1:
            run.append(n)
            continue
        if run:
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [n]
    if run:
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(out)


def experts_map(names: Iterable[str], placement_of, prefix: str) -> str | None:
    """Which experts of each split group are where, compactly: `mlp.experts: gpu 0-31, uva 32-127`.

    Only groups whose experts are not all in one place appear; when the
    group's fused parameters differ, each gets its own entry
    (`mlp.experts.gate_up_proj: ...; mlp.experts.down_proj: ...`). `prefix`
    (the layer's name and a dot) is cut from the names. None when nothing is split.
    """
    maps: dict[str, dict[str, dict[str, set[int]]]] = {}  # group -> parameter -> placement -> experts
    for n in names:
        k = _key(n)
        if k is not None:
            group, param, expert, _ = k
            place = placement_of(n).value
            maps.setdefault(group, {}).setdefault(param, {}).setdefault(place, set()).add(expert)
    entries = []
    for group, params in maps.items():
        if all(len(p) == 1 for p in params.values()) and len({next(iter(p)) for p in params.values()}) == 1:
            continue  # the whole group in one place
        local = group[len(prefix):] if group.startswith(prefix) else group
        described = {param: ", ".join(f"{place} {ranges(e)}" for place, e in sorted(by.items()))
                     for param, by in sorted(params.items())}
        if len(set(described.values())) == 1:
            entries.append(f"{local}: {next(iter(described.values()))}")
        else:
            entries += [f"{local}.{param}: {text}" for param, text in described.items()]
    return "; ".join(entries) or None
