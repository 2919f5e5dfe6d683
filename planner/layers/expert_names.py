"""What a tensor's name says of experts: which fused expert group it belongs to, and as what (groups.py).

- One expert's tensor: `<group>.<N>.<projection><suffix>`, its group `<prefix>.experts`
  (`MEMBER`; `mlp.experts.7.up_proj.weight`: expert 7 of `mlp.experts`, projection
  `up_proj`, suffix `.weight`). Gate and up join one fused parameter (`FUSED`).
- A tensor holding every expert at once: `<prefix>.experts.<parameter>` where the
  parameter starts with no expert number (prefused.py `prefused_key`).

`matches` classifies many names at once, and fast: planning DeepSeek-V3 asks it of
90k names. The patterns stay the definition; `matches` gives what they give.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from functools import lru_cache

from ..inputs.prefused import prefused_key

MEMBER = re.compile(r"^(.*\.experts)\.(\d+)\.([^.]+)(.*)$")
# projection -> (the fused parameter it joins, its place within one expert's block)
FUSED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "w1": ("w13", 0), "w3": ("w13", 1)}
_EXPERTS = ".experts."
_REST = re.compile(r"(\d+)\.([^.]+)(.*)")  # what `MEMBER` wants after the group's `.experts.`
NONE = ("",) * 6


def key(name: str):
    """(group, parameter, expert, place in the expert's block) of one expert's tensor, or None."""
    m = MEMBER.match(name)
    if m is None:
        return None
    fused, part = FUSED.get(m[3], (m[3], 0))
    return m[1], f"{fused}{m[4]}", int(m[2]), part


def matches(names: list[str]) -> list[tuple[str, ...]]:
    """Per name: (group, expert number, projection, suffix, "", "") for one expert's tensor (`key`),
    ("", "", "", "", group, parameter) for one holding every expert (`prefused_key`), else all "" (`NONE`).

    A name with one `.experts.` is cut there, and what follows it (`7.up_proj.weight`, the same in every
    layer) is classified once per call; a name with several, or any name when one holds a newline, is
    matched by the patterns themselves.
    """
    out = []
    rests: dict[str, tuple | None] = {}
    plain = "\n".join(names).count("\n") == len(names) - 1  # no name holds a newline
    for n in names:
        i = n.rfind(_EXPERTS)
        if i < 0:
            out.append(NONE)
            continue
        if not plain or n.find(_EXPERTS) != i:
            out.append(match(n))
            continue
        rest = n[i + 9:]
        got = rests[rest] if rest in rests else rests.setdefault(rest, _rest(rest))
        if got is None:
            out.append(NONE)
        elif got[0]:
            out.append((n[:i + 8], *got))
        else:
            out.append(("", "", "", "", n[:i + 8], rest))
    return out


@lru_cache(maxsize=8192)
def _rest(rest: str) -> tuple[str, ...] | None:
    """What follows a name's only `.experts.`: (number, projection, suffix, "", "") of one expert's
    tensor, ("",) for a pre-fused one, None for neither (as `MEMBER` and `prefused_key` say). Cached: layers
    of several templates (DeepSeek-V3's MoE and MTP layers) hold the same 1,536 expert tensors' ends."""
    m = _REST.fullmatch(rest)
    if m:
        return (*m.groups(), "", "")
    return ("",) if prefused_key("x.experts." + rest) else None


def match(name: str) -> tuple[str, ...]:
    """`matches` of one name, by the patterns themselves."""
    m = MEMBER.match(name)
    if m:
        return (*m.groups(), "", "")
    f = prefused_key(name)
    return ("", "", "", "", *f) if f else NONE


def piece(number: str, projection: str, suffix: str, cache: dict) -> tuple[str, int, int]:
    """(parameter, expert, place in the expert's block) of a member that `matches` found: `key` without the
    group. `cache` (one per caller) keeps each (projection, suffix)'s parameter."""
    got = cache.get((projection, suffix))
    if got is None:
        fused, part = FUSED.get(projection, (projection, 0))
        got = cache[(projection, suffix)] = (f"{fused}{suffix}", part)
    return got[0], int(number), got[1]


def experts_among(names: Iterable[str]) -> set[str]:
    """The names that belong to a fused expert group (groups.py `is_expert`), found in one pass."""
    names = list(names)
    return {n for n, m in zip(names, matches(names)) if m[0] or m[4]}


def units(names: Iterable[str]) -> list[tuple[str, ...]]:
    """`names` grouped into fused parameters, each unit's members in memory order (groups.py's module doc).

    Units come in the order of their first member in `names`; a tensor that is
    no expert's is a unit of its own.

    >>> units(["m.experts.0.up_proj.weight", "m.experts.0.gate_proj.weight", "m.experts.1.gate_proj.weight",
    ...        "m.experts.1.up_proj.weight", "m.experts.0.down_proj.weight", "m.norm.weight"])
    [('m.experts.0.gate_proj.weight', 'm.experts.0.up_proj.weight', 'm.experts.1.gate_proj.weight', \\
'm.experts.1.up_proj.weight'), ('m.experts.0.down_proj.weight',), ('m.norm.weight',)]
    """
    names = list(names)
    return units_of(names, matches(names))


def units_of(names: list[str], found: Iterable[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """`units(names)`, given `found`, the names' `matches` (a layer template's, alike.py: read, not matched again)."""
    members: dict[tuple, list[tuple[tuple[int, int], str]]] = {}
    cache: dict = {}
    for n, (group, number, proj, suffix, _, _) in zip(names, found):
        if not group:
            members[(n,)] = [((0, 0), n)]
        else:
            param, expert, part = piece(number, proj, suffix, cache)
            members.setdefault((group, param), []).append(((expert, part), n))
    return [tuple(n for _, n in sorted(ms)) if len(ms) > 1 else (ms[0][1],) for ms in members.values()]
