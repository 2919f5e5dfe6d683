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
  instantiates for each layer and prefetch's `whole_groups` reads, and
  `numbered`: each tensor's expert and group, which the cost model (reads.py)
  reads instead of maps by tensor name;
- which of them a policy's patterns select (`select`): a plain pattern without a
  dot matches a name iff it is one of its segments, so of the layer's name or of
  its local name; other patterns are matched name by name, as patterns.py does.
Names are not dtypes and shapes: `Shapes` numbers each layer's, read once per
layer, so that layers alike in both are told by a template and a number
(reads.py `kind`, slots.py `image_key`).

A template's findings hold for a layer whose own name has neither `experts` nor
a newline in it (`applies`): a tensor's full name is then classified exactly as
"." + its local name, its group prefixed by the layer's name. Any other layer's
names are classified one by one, as before.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from functools import cached_property
from itertools import compress
from operator import itemgetter

from ..inputs.patterns import Names, Pattern
from .expert_names import matches, piece, units_of

_DTYPE, _SHAPE, _DTYPE_SHAPE = itemgetter(1), itemgetter(2), itemgetter(1, 2)  # of a TensorInfo


def applies(layer_name: str) -> bool:
    """Whether a template's findings hold for the layer of this name (module doc)."""
    return "experts" not in layer_name and "\n" not in layer_name


def select(layers: Sequence, patterns: Iterable[Pattern], names: Names) -> set[str]:
    """`names.select(patterns)`, where `names` are the tensors of `layers`: plain patterns without a dot are
    matched once per template and each layer's name (module doc); the others by `names`."""
    patterns = list(patterns)
    segments = frozenset(p.text for p in patterns if p.regex is None and "." not in p.text)
    out = names.select([p for p in patterns if p.regex is not None or "." in p.text])
    if not segments:
        return out
    for l in layers:
        # its template tells nothing (no template, a tensor named as the layer, a newline): graph.py Layer.by_name
        if l.by_name:
            out |= Names(l.params).select([Pattern(t) for t in segments])
        elif not segments.isdisjoint(l.name.split(".")):
            out.update(l.params)
        else:
            out.update(compress(l.params, l.template.selected(segments)))
    return out


def taker(places: tuple[int, ...]) -> Callable[[Sequence], tuple]:
    """The items of a sequence at `places`, as a tuple, in one C call (itemgetter's, which gives one item bare)."""
    if len(places) == 1:
        return lambda seq, i=places[0]: (seq[i],)
    return itemgetter(*places) if places else lambda seq: ()


class Template:
    """The local names of layers alike, and what they say (module doc)."""

    def __init__(self, names: tuple[str, ...]):
        self.names = names
        self._selected: dict[frozenset[str], tuple[bool, ...]] = {}
        self._units: dict[tuple[bool, ...], list[tuple[int, ...]]] = {}

    @cached_property
    def plain(self) -> bool:
        """No local name holds a newline."""
        return not any("\n" in n for n in self.names)

    def selected(self, segments: frozenset[str]) -> tuple[bool, ...]:
        """Per local name: whether one of its segments is one of `segments` (`select`)."""
        if segments not in self._selected:
            self._selected[segments] = tuple(not segments.isdisjoint(n.split(".")) for n in self.names)
        return self._selected[segments]

    def units(self, chosen: tuple[bool, ...]) -> list[tuple[int, ...]]:
        """expert_names.py `units` of the local names that `chosen` marks, as places among these names: a slot image's
        (slots.py), worked out once per marks for every layer that streams them."""
        got = self._units.get(chosen)
        if got is None:
            names = list(compress(self.names, chosen))
            at = {n: i for i, n in enumerate(self.names)}
            got = self._units[chosen] = [tuple(map(at.__getitem__, u))
                                         for u in units_of(names, compress(self.matches, chosen))]
        return got

    @cached_property
    def every(self) -> tuple[bool, ...]:
        """Marks picking every local name (selection.py `Selection.marks`)."""
        return (True,) * len(self.names)

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

    @cached_property
    def takers(self) -> list[tuple[str, Callable, Callable, tuple, Callable | None]]:
        """`groups`, each list of places as a function that takes those of a layer's tensors as a tuple, in C
        (`FusedGroups.of_layers`); None for a group with no member holding every expert."""
        return [(g, taker(every), taker(each), their, taker(whole) if whole else None)
                for g, every, each, their, whole in self.groups]

    @cached_property
    def numbered(self) -> tuple[tuple[bool, ...], tuple[int | None, ...], tuple[str | None, ...]]:
        """Per local name: whether its tensor is one expert's (`groups`), that expert's number and its group's
        name after the layer's (None for none; a pre-fused member has a group, no number)."""
        numbers: list[int | None] = [None] * len(self.names)
        local: list[str | None] = [None] * len(self.names)
        for group, every, each, their, _ in self.groups:
            for i in every:
                local[i] = group
            for i, (_, expert, _) in zip(each, their):
                numbers[i] = expert
        return tuple(e is not None for e in numbers), tuple(numbers), tuple(local)


class Shapes:
    """Each layer's dtypes and shapes, tensor for tensor, as a number: layers of one number have the same
    ones. Read once per layer (a MoE layer of DeepSeek-V3 holds 1,548 tensors) for every question they
    decide, then compared as one int. `tensors` is the plan's (one GPU's share under tensor parallelism).

    Every question also asks for the layer's template, so a layer of a template is compared with the
    earlier layers of that template only, list to list (tensors of one dtype and shape share those
    objects: shard_header.py), rather than hashed: its number may then differ from an equal layer's of
    another template, which no question tells apart."""

    def __init__(self, tensors: Mapping[str, tuple]):
        self.tensors = tensors
        self._of: dict[str, int] = {}  # layer name -> its number
        self._numbers: dict[tuple, int] = {}  # dtypes and shapes -> their number (a layer of no template)
        self._alike: dict[Template, list[tuple[list, list, int]]] = {}  # template -> (dtypes, shapes, number)

    def __call__(self, layer) -> int:
        number = self._of.get(layer.name)
        if number is None:
            infos = layer.values(self.tensors)
            if layer.template is None:
                number = self._numbers.setdefault(tuple(map(_DTYPE_SHAPE, infos)), self._count())
            else:
                dtypes, shapes = list(map(_DTYPE, infos)), list(map(_SHAPE, infos))
                known = self._alike.setdefault(layer.template, [])
                number = next((n for d, s, n in known if s == shapes and d == dtypes), None)
                if number is None:
                    number = self._count()
                    known.append((dtypes, shapes, number))
            self._of[layer.name] = number
        return number

    def _count(self) -> int:
        return len(self._numbers) + sum(map(len, self._alike.values()))


InPlace = tuple[str, Collection[str] | None, tuple[int, ...]]  # template_groups': (group, its members, places)


def template_groups(members: Mapping[str, Collection[str]], layer) -> list[InPlace] | None:
    """Each fused group of `layer`'s template as (the group's name, its members in `members` (groups.py: group ->
    its member tensors), None where it has none there, and the places of its members among the layer's tensors,
    as the template says); None where the layer has no template that applies, or a group has members the template
    does not place (some in another layer): then its groups are found by name. What the passes that work per
    template of layers ask first."""
    t = layer.template
    if t is None or not applies(layer.name):
        return None
    out = []
    for local, every, *_ in t.groups:
        ms = members.get(layer.name + local)
        if ms is not None and len(ms) != len(every):
            return None
        out.append((layer.name + local, ms, every))
    return out
