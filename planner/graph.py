"""The layer graph: which tensors form the repeated stacks, and in what order things run.

Algorithm. A tensor name's *stack prefix* is everything before its first
all-digit segment (`model.layers.12.mlp...` -> `model.layers`, layer 12). A
prefix seen with two or more distinct numbers is a stack (`transformer.h`,
`blocks`, `language_model.model.layers`, `vision_tower...encoder.layers`).
When that guess is wrong (a model with `norms.0`/`norms.1`, or two stacks of
which only one should be offloaded), the policy's `stacks:` key names the
prefixes to use and the rest is treated as ordinary modules.

Every other tensor belongs to the module that owns it (its name without the
last segment). The execution order, a chain in a networkx DiGraph, is:
embedding-like modules, then the stacks (vision/audio/encoder stacks first,
then the rest in the order they appear), each in numeric order (10 after 9),
then the remaining modules (final norms), then the head. Within a layer,
tensors are in natural order (numbers compared as numbers), which is the
stable order used everywhere a layer's tensors are walked.

Limits: the order is inferred from names only. Modules that run between two
stacks (a VLM's projector) are put after the stacks; this only affects the
order in which the plan lists them, never where they are placed.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import networkx as nx

from .errors import PolicyError
from .patterns import closest
from .plan import LayerKind

_EMBED = re.compile(r"(^|\.)(embed\w*|wte|wpe|tok_embeddings|word_embeddings|patch_embed\w*)(\.|$)")
_HEAD = re.compile(r"(^|\.)(lm_head|output|head)$")
_EARLY_STACK = re.compile(r"vision|visual|audio|encoder")


def natural_key(name: str) -> str:
    """Sort key that orders `layers.10` after `layers.9`: numeric segments zero-padded.

    A string key (not a tuple) because comparing strings is what makes sorting
    90k names fast; segments of up to 12 digits compare numerically.
    """
    return ".".join([p.rjust(12, "0") if p.isdigit() else p for p in name.split(".")])


@dataclass(frozen=True)
class Layer:
    """A node of the layer graph: one layer of a stack, or one other module."""

    name: str  # "model.layers.7" or "model.embed_tokens"
    kind: LayerKind
    params: tuple[str, ...]  # full tensor names, natural order
    stack: str | None = None  # "model.layers" for stack layers
    index: int | None = None  # 7 for "model.layers.7"

    def local(self, param: str) -> str:
        """The tensor's name within this layer (`mlp.down_proj.weight`)."""
        return param[len(self.name) + 1:]


@dataclass(frozen=True)
class LayerGraph:
    layers: tuple[Layer, ...]  # execution order
    stacks: tuple[str, ...]
    tied_embeddings: bool
    graph: nx.DiGraph

    def stack_layers(self) -> list[Layer]:
        return [l for l in self.layers if l.kind is LayerKind.LAYER]


_NUMBERED = re.compile(r"^(?:(.*?)\.(\d+)\.)?", re.M)


def _numbered(names: list[str]) -> list[tuple[str, str]]:
    """(stack prefix, layer number) per name, ("", "") without a numbered segment.

    `model.layers.12.mlp.w` -> ("model.layers", "12"). One regex scan over all
    names joined by newlines: one (possibly empty) match per line.
    """
    hits = _NUMBERED.findall("\n".join(names))
    if len(hits) != len(names):  # a name holding a newline: fall back to one match per name
        hits = [m.groups("") for m in map(_NUMBERED.match, names)]
    return hits


def _natural_order(node: str, params: list[str], keys: dict[str, str]) -> tuple[str, ...]:
    """`params` of one layer in natural order of their local names (keys cached across layers)."""
    cut = len(node) + 1
    local = [p[cut:] for p in params]
    for name in set(local).difference(keys):
        keys[name] = natural_key(name)
    return tuple(p for _, p in sorted(zip(map(keys.__getitem__, local), params)))


def build_graph(names: Iterable[str], stacks: Iterable[str] | None = None,
                where: Callable[[str], str] | None = None) -> LayerGraph:
    """Group tensor names into layers and order them for execution (see module doc).

    `stacks` overrides detection; `where` turns a key path (`stacks[0]`) into the
    policy's `file:line:column` for the error naming a prefix that holds no tensor.
    """
    names = list(names)
    hits = _numbered(names)
    found: dict[str, set[int]] = {}
    for prefix, number in hits:
        if number:
            found.setdefault(prefix, set()).add(number)
    detected = [p for p, idx in found.items() if len(idx) >= 2]
    if stacks is None:
        chosen = detected
    else:
        chosen = list(stacks)
        missing = [(i, p) for i, p in enumerate(chosen) if p not in found]
        if missing:
            at = (lambda key: f"{where(key)}: {key}") if where else (lambda key: key)
            raise PolicyError("stacks: no numbered layers live under these prefixes", [
                f"{at(f'stacks[{i}]')}: {p!r}" + _did_you_mean(p, list(found)) for i, p in missing])
    chosen_set = set(chosen)

    by_layer: dict[str, list[str]] = {}
    kinds: dict[str, tuple[str, str | None, int | None]] = {}
    for name, (prefix, number) in zip(names, hits):
        if number and prefix in chosen_set:
            node = f"{prefix}.{number}"
            if node not in kinds:
                kinds[node] = (LayerKind.LAYER, prefix, int(number))
        else:
            node = name.rpartition(".")[0] or name
            if node not in kinds:
                kind = (LayerKind.EMBED if _EMBED.search(node) else LayerKind.HEAD if _HEAD.search(node)
                        else LayerKind.MODULE)
                kinds[node] = (kind, None, None)
        by_layer.setdefault(node, []).append(name)

    first_seen = {p: i for i, p in enumerate(chosen)}
    stack_rank = {p: (0 if _EARLY_STACK.search(p) else 1, first_seen[p]) for p in chosen}
    group_rank = {LayerKind.EMBED: 0, LayerKind.LAYER: 1, LayerKind.MODULE: 2, LayerKind.HEAD: 3}

    def order(node: str) -> tuple:
        kind, stack, index = kinds[node]
        if kind is LayerKind.LAYER:
            return (1, stack_rank[stack], index)
        return (group_rank[kind], (0, 0), 0)

    nodes = sorted(by_layer, key=lambda n: (order(n), natural_key(n)))
    keys: dict[str, str] = {}  # natural keys of local names, shared by every layer of a stack
    layers = tuple(Layer(n, kinds[n][0], _natural_order(n, by_layer[n], keys), kinds[n][1], kinds[n][2])
                   for n in nodes)
    graph = nx.DiGraph()
    graph.add_nodes_from((l.name, {"layer": l}) for l in layers)
    nx.add_path(graph, [l.name for l in layers])
    has_embed = any(l.kind is LayerKind.EMBED for l in layers)
    has_head = any(l.kind is LayerKind.HEAD for l in layers)  # lm_head, or `output` (Meta's layout)
    return LayerGraph(layers, tuple(sorted(chosen, key=stack_rank.get)), has_embed and not has_head, graph)


def execution_order(graph: LayerGraph, selected: Iterable[str]) -> list[str]:
    """The selected layer names in the order the graph runs them."""
    selected = set(selected)
    return [n for n in nx.topological_sort(graph.graph) if n in selected]


def _did_you_mean(word: str, options: list[str]) -> str:
    near = closest(word, options) if options else []
    if near:
        return f": did you mean {' or '.join(repr(n) for n in near)}?"
    return f" (detected: {', '.join(sorted(options)[:5]) or 'none'})"
