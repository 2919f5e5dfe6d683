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
"""
from __future__ import annotations

import re
from collections.abc import Collection, Iterable

_EXPERT = re.compile(r"^(.*\.experts)\.\d+\..*$", re.M)


def fused_groups(names: Iterable[str]) -> dict[str, list[str]]:
    """Group name -> its member tensor names, in the order given (one regex scan over all names)."""
    groups: dict[str, list[str]] = {}
    for m in _EXPERT.finditer("\n".join(names)):
        groups.setdefault(m[1], []).append(m[0])
    return groups


def split_groups(groups: dict[str, list[str]], selected: Collection[str], what: str) -> list[str]:
    """Problems for groups that `selected` holds only partly, one line per group."""
    problems = []
    for group, members in groups.items():
        picked = [m for m in members if m in selected]
        if picked and len(picked) < len(members):
            problems.append(
                f"{what} selects {len(picked)} of the {len(members)} tensors of fused group {group} "
                f"(e.g. {picked[0]}); transformers and vLLM fuse a layer's experts into one tensor, so "
                f"select all of them (for example with the pattern `experts`)")
    return problems
