"""What a `params` list selects (`uva.params`, `prefetch.params`), held per layer rather than per tensor.

`prefetch.params: [experts]` selects 89k of DeepSeek-V3's 92k tensors. alike.py
`select` matches such plain single-segment patterns once per layer template,
then puts every selected name in one set; its users ask layer by layer (which
tensors of this layer may stream? does it split a fused group?). `Selection`
keeps each layer's answer as alike.py found it instead: every tensor of the
layer (the layer's own name matched), a mask over its tensors (its template's),
or none; names that other patterns matched one by one are `extra`. The set of
every selected name (`names`, `in`, iteration) is made only when something asks
for it (the uva walks, a policy error). A layer's picks are its tensors in the
layer's order, the same names in the same order as filtering by the set.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import cached_property
from itertools import compress

from ..inputs.patterns import Names, Pattern
from .alike import select, template_groups


class Selection:
    """The tensors `patterns` select among `layers`' (module doc); alike.py `select`'s set is `names`."""

    def __init__(self, layers: Sequence, patterns: Iterable[Pattern], names: Names):
        self.layers, self.patterns, self._names = layers, list(patterns), names
        segments = frozenset(p.text for p in self.patterns if p.regex is None and "." not in p.text)
        self.masks: dict[str, tuple[bool, ...] | bool] | None = None  # layer name -> True (all), its mask
        if segments and all(p.regex is None and "." not in p.text for p in self.patterns):
            self.masks = {}
            for l in layers:
                if l.by_name:
                    self.masks = None  # named one by one: the set
                    break
                if not segments.isdisjoint(l.name.split(".")):
                    self.masks[l.name] = True
                else:
                    self.masks[l.name] = l.template.selected(segments)

    @cached_property
    def names(self) -> set[str]:
        return select(self.layers, self.patterns, self._names)

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def of(self, layer) -> list[str]:
        """The layer's selected tensors, in its order."""
        mask = None if self.masks is None else self.masks.get(layer.name)
        if mask is None:
            return list(compress(layer.params, map(self.names.__contains__, layer.params)))
        return list(layer.params) if mask is True else list(compress(layer.params, mask))

    def marks(self, layer) -> tuple[bool, ...] | None:
        """The layer's picks as marks over its tensors, one object per template and answer; None where they are
        matched one by one."""
        mask = None if self.masks is None else self.masks.get(layer.name)
        return layer.template.every if mask is True else mask

    def splits_no_group(self, groups) -> bool:
        """True where no fused group (groups.py `FusedGroups`, of these layers) is selected in part, as the
        layers' masks show: each template's groups are looked at once. False: not known (ask groups.py)."""
        if self.masks is None:
            return False
        seen: dict[object, bool] = {}
        for l in self.layers:
            mine = template_groups(groups.members, l)
            if mine is None:
                return False
            mask = self.masks[l.name]
            if mask is True:
                continue
            if l.template not in seen:  # each group selected whole or not at all
                seen[l.template] = all(len(set(map(mask.__getitem__, every))) == 1 for _, _, every in mine)
            if not seen[l.template]:
                return False
        return True

