"""Fused expert groups: checkpoint tensors that become one tensor at run time.

Checkpoints store MoE experts one tensor each (`mlp.experts.7.up_proj.weight`),
but transformers 5.x and vLLM fuse every expert of a layer's `experts` module
into a few stacked tensors (`mlp.experts.gate_up_proj` [E, 2I, H]). A placement
that splits such a group cannot be applied: the fused tensor lives in one place.
So the planner treats the per-expert tensors of one `experts` module as a unit:

- the uva walk offloads a group whole, when it reaches its first tensor;
- prefetch offloads whole layers, so groups stay whole;
- a rule or a `params` pattern that selects part of a group is an error.

Grouping is by name: `<prefix>.experts.<N>.<rest>` belongs to group
`<prefix>.experts`. Shared experts (`mlp.shared_experts.*`) carry no number and
stay ordinary tensors.

Within a group, `units` gives the runtime parameters in memory order. Both
transformers 5.x and vLLM stack experts along a first dimension and join the
gate and up projections along the next: `gate_up_proj[e] = [gate_e; up_e]`
(vLLM's `w13`, from Mixtral's `w1` and `w3`), so that parameter's bytes are
`gate_0, up_0, gate_1, up_1, ...`; every other projection (`down_proj`, `w2`)
is stacked alone, `down_0, down_1, ...`. The same suffix (`.weight`, `.bias`,
`.weight_scale_inv`) fuses with its own kind only. A prefetch slot lays each
unit out contiguously (slots.py), so that the runtime's fused tensor is a view
of the slot; the runtime checks this against transformers' own conversion.
"""
from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass

_EXPERT = re.compile(r"^(.*\.experts)\.\d+\..*$", re.M)
_MEMBER = re.compile(r"^(.*\.experts)\.(\d+)\.([^.]+)(.*)$")
# projection -> (the fused parameter it joins, its place within one expert's block)
FUSED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "w1": ("w13", 0), "w3": ("w13", 1)}


def fused_groups(names: Iterable[str]) -> dict[str, list[str]]:
    """Group name -> its member tensor names, in the order given (one regex scan over all names)."""
    groups: dict[str, list[str]] = {}
    for m in _EXPERT.finditer("\n".join(names)):
        groups.setdefault(m[1], []).append(m[0])
    return groups


@dataclass(frozen=True)
class FusedGroups:
    """A checkpoint's fused expert groups, found once per plan and shared by every step that needs them."""

    members: dict[str, tuple[str, ...]]  # group -> its member tensors, in checkpoint order
    group_of: dict[str, str]  # member -> its group

    @classmethod
    def find(cls, names: Iterable[str]) -> "FusedGroups":
        members = {g: tuple(ms) for g, ms in fused_groups(names).items()}
        return cls(members, {m: g for g, ms in members.items() for m in ms})

    def unit(self, name: str) -> tuple[str, ...]:
        """What moves with `name`: its whole group, or the tensor alone."""
        group = self.group_of.get(name)
        return (name,) if group is None else self.members[group]

    def experts(self, group: str) -> int:
        """How many distinct experts the group holds."""
        return len({m[len(group) + 1:].split(".", 1)[0] for m in self.members[group]})


def split_groups(groups: FusedGroups, selected: Collection[str], what: str) -> list[str]:
    """Problems for groups that `selected` holds only partly, one line per group."""
    problems = []
    for group, members in groups.members.items():
        picked = [m for m in members if m in selected]
        if picked and len(picked) < len(members):
            problems.append(
                f"{what} selects {len(picked)} of the {len(members)} tensors of fused group {group} "
                f"(e.g. {picked[0]}); transformers and vLLM fuse a layer's experts into one tensor, so "
                f"select all of them (for example with the pattern `experts`)")
    return problems


def units(names: Iterable[str]) -> list[tuple[str, ...]]:
    """`names` grouped as the runtime holds them, each unit's members in memory order (module doc).

    Units come in the order of their first member in `names`; a tensor that is
    no expert's is a unit of its own.

    >>> units(["m.experts.0.up_proj.weight", "m.experts.0.gate_proj.weight", "m.experts.1.gate_proj.weight",
    ...        "m.experts.1.up_proj.weight", "m.experts.0.down_proj.weight", "m.norm.weight"])
    [('m.experts.0.gate_proj.weight', 'm.experts.0.up_proj.weight', 'm.experts.1.gate_proj.weight', \
'm.experts.1.up_proj.weight'), ('m.experts.0.down_proj.weight',), ('m.norm.weight',)]
    """
    members: dict[tuple, list[tuple[tuple[int, int], str]]] = {}
    for n in names:
        m = _MEMBER.match(n)
        if m is None:
            members[(n,)] = [((0, 0), n)]
            continue
        group, expert, proj, suffix = m[1], int(m[2]), m[3], m[4]
        fused, part = FUSED.get(proj, (proj, 0))
        members.setdefault((group, fused, suffix), []).append(((expert, part), n))
    return [tuple(n for _, n in sorted(ms)) for ms in members.values()]
