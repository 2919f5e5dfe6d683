"""Layers alike: what follows from a layer's local names is found once for every layer that has them.

The layers of a stack name their tensors alike (`self_attn.q_proj.weight`,
`mlp.experts.7.up_proj.weight`): DeepSeek-V3's 58 MoE layers share one list of
1,548 local names, Kimi-K2's 60 one of 2,322. `build_graph` gives every layer
the `Template` of its local names, in the layer's order, one object for all the
layers that share them, so what names alone decide is worked out once per
template, not once per tensor (90k tensors, a handful of templates):
- `matches`: which tensors belong to fused expert groups, and as what
  (expert_names.py `matches`), which gives `Layer.expert_tensors`;
- `groups`: the fused expert groups they form, which `FusedGroups.of_layers`
  instantiates for each layer.

A template's findings hold for a layer whose own name has neither `experts` nor
a newline in it (`applies`): a tensor's full name is then classified exactly as
"." + its local name, its group prefixed by the layer's name. Any other layer's
names are classified one by one, as before.
"""
from __future__ import annotations

from functools import cached_property

from .expert_names import matches, piece


def applies(layer_name: str) -> bool:
    """Whether a template's findings hold for the layer of this name (module doc)."""
    return "experts" not in layer_name and "\n" not in layer_name


class Template:
    """The local names of layers alike, and what they say (module doc)."""

    def __init__(self, names: tuple[str, ...]):
        self.names = names

    @cached_property
    def matches(self) -> list[tuple[str, ...]]:
        """expert_names.py `matches` of "." + each local name: a group is the part after the layer's name."""
        return matches(["." + n for n in self.names])

    @cached_property
    def experts(self) -> tuple[bool, ...]:
        """Per local name: whether its tensor belongs to a fused expert group (groups.py `is_expert`)."""
        return tuple(bool(m[0] or m[4]) for m in self.matches)

    @cached_property
    def groups(self) -> list[tuple[str, tuple[int, ...], tuple[int, ...], tuple, tuple[int, ...]]]:
        """The fused expert groups of these names, in the order of their first member: (the group's name after
        the layer's, the indices of its members, of those stored one expert each, their pieces (parameter,
        expert, place in the expert's block), of those holding every expert)."""
        found: dict[str, tuple[list, list, list, list]] = {}
        cache: dict = {}
        for i, (group, number, projection, suffix, fused, _) in enumerate(self.matches):
            if group:
                every, each, their, _ = found.setdefault(group, ([], [], [], []))
                each.append(i)
                their.append(piece(number, projection, suffix, cache))
            elif fused:
                every, _, _, whole = found.setdefault(fused, ([], [], [], []))
                whole.append(i)
            else:
                continue
            every.append(i)
        return [(g, *map(tuple, lists)) for g, lists in found.items()]
