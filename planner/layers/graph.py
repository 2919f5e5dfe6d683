"""The layer graph: which tensors form the layers, in what order they run, and when.

Layers. A tensor name's *stack prefix* is everything before its first
all-digit segment (`model.layers.12.mlp...` -> `model.layers`, layer 12). A
prefix with two or more numbers is a stack, unless it has fewer than four and
a gap: an `nn.Sequential` of modules and activations (Qwen2-VL's
`visual.merger.mlp.0` and `.2`) is a module, not two layers. The policy's
`stacks:` key overrides detection.
Every other tensor belongs to the module that owns it (its name without the
last segment).

Order: embedding-like modules, then the stacks (vision/audio/encoder stacks
first), each in numeric order (10 after 9), then the remaining modules (final
norms, projectors), then the head. Within a layer, tensors are in natural
order (numbers compared as numbers).

When each layer runs (`Runs`), which placement and the cost model act on:
- `images`: a vision tower and its projector (by name: `visual`,
  `vision_tower`, `vision_model`, `multi_modal_projector`, ...) run only for a
  prompt with images, in its prefill, never in a text decode step;
- `mtp`: a multi-token-prediction layer never runs in plain decode: a layer
  of a text stack numbered past config.json's `num_hidden_layers` when
  `num_nextn_predict_layers` says there are such (DeepSeek-V3's layer 61), or
  a module under an `mtp` segment;
- `step`: everything else, in every decode step.

The networkx graph holds the layers as nodes (with `layer` and `runs`), the
execution order as `order` edges, and a tied embedding (one tensor that is
also the head) as the node attribute `tied`. `schedule_problems` adds a
prefetch schedule's copy-start edges and checks them for slot overlap.

Limits: the order is inferred from names only. Modules that run between two
stacks (a VLM's projector) are put after the stacks; this only affects the
order in which the plan lists them, never where they are placed.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import compress
from operator import itemgetter
from typing import Any

import networkx as nx

from ..errors import PolicyError
from ..inputs.config import ModelFacts
from ..inputs.patterns import closest
from ..plan import LayerKind, Runs, Transfer
from .alike import Template, applies
from .expert_names import experts_among
from .natural import natural_key, natural_order

_EMBED = re.compile(r"(^|\.)(embed\w*|wte|wpe|tok_embeddings|word_embeddings|patch_embed\w*)(\.|$)")
_HEAD = re.compile(r"(^|\.)(lm_head|output|head)$")
_EARLY_STACK = re.compile(r"vision|visual|audio|encoder")
_VISION = re.compile(r"(^|\.)(visual|vision_tower|vision_model|vision_encoder|vision_embed\w*|multi_modal_projector"
                     r"|mm_projector|image_newline)(\.|$)")
_MTP = re.compile(r"(^|\.)(mtp|mtp_layers)(\.|$)")


@dataclass(frozen=True)
class Layer:
    """A node of the layer graph: one layer of a stack, or one other module."""

    name: str  # "model.layers.7" or "model.embed_tokens"
    kind: LayerKind
    params: tuple[str, ...]  # full tensor names, natural order
    stack: str | None = None  # "model.layers" for stack layers
    index: int | None = None  # 7 for "model.layers.7"
    runs: Runs = Runs.STEP
    template: Template | None = field(default=None, compare=False, repr=False)  # its local names (alike.py)

    def local(self, param: str) -> str:
        """The tensor's name within this layer (`mlp.down_proj.weight`)."""
        return param[len(self.name) + 1:]

    def values(self, mapping: Mapping[str, Any]) -> tuple:
        """Its tensors' values in `mapping` (their placements, their headers), in order: where it holds several, in
        one C call (an itemgetter of its names, kept), not one lookup called per tensor (90k per placement read)."""
        if len(self.params) < 2:  # itemgetter gives one item bare
            return tuple(map(mapping.__getitem__, self.params))
        return self._getter(mapping)

    @cached_property
    def _getter(self) -> itemgetter:
        return itemgetter(*self.params)

    @cached_property
    def by_name(self) -> bool:
        """Whether patterns must match its tensors name by name, its template telling nothing (alike.py `select`):
        it has none, a tensor is named as the layer (no local name) or a name holds a newline (lines to
        patterns.py). Asked once per layer, not by every selection again (a look through its 1,548 names)."""
        t = self.template
        return t is None or self.name in self.params or "\n" in self.name or not t.plain

    @cached_property
    def expert_tensors(self) -> frozenset[str]:
        """Its tensors of fused expert groups, by name (groups.py `is_expert`): found once per template
        (alike.py) and layer, for the planner's every question about them (staging, the experts map)."""
        t = self.template
        if t is None or not applies(self.name):
            return frozenset(experts_among(self.params))
        return frozenset(compress(self.params, t.experts))

    @property
    def module(self) -> str:
        """The path of the module whose forward runs this layer, which the runtime hooks: a prefetch
        schedule's `Transfer.module`, a prefill staging's `StagedLayer.module`. A layer is one module (a
        stack layer, or the owner of its tensors), so it is the layer's name."""
        return self.name


@dataclass(frozen=True)
class LayerGraph:
    layers: tuple[Layer, ...]  # execution order
    stacks: tuple[str, ...]
    graph: nx.DiGraph

    @property
    def tied_embeddings(self) -> bool:
        """True when an embedding is also the head (no head tensor): it is read whole every step."""
        return any(data.get("tied") for _, data in self.graph.nodes(data=True))

    def stack_layers(self) -> list[Layer]:
        return [l for l in self.layers if l.kind is LayerKind.LAYER]

    def rarely_run(self) -> list[Layer]:
        """Layers that do not run in every decode step (vision, MTP), in execution order."""
        return [l for l in self.layers if l.runs is not Runs.STEP]


_NUMBERED = re.compile(r"^(?:(.*?)\.(\d+)\.)?", re.M)


def _layer_runs(names: list[str]) -> list[tuple[tuple[str, str], int, int]]:
    """Runs `names[start:end]` sharing a (stack prefix, layer number), with it; ("", "") for a lone unnumbered name.

    `model.layers.12.mlp.w` -> ("model.layers", "12"). The names that start as a run's first does, up to and
    including its number (`model.layers.12.`), join its run: an index lists a layer's names together, so the
    pattern runs once per layer, not once per name. A run is as long as the stack's last one (layers alike
    hold as many tensors) where its least and greatest names start so (then every name between them does, in
    string order) and the next does not; else the names are walked one by one."""
    runs = []
    length: dict[str, int] = {}  # stack prefix -> its last run's length
    i, n = 0, len(names)
    while i < n:
        hit = _NUMBERED.match(names[i]).groups("")
        if not hit[1]:
            runs.append((hit, i, i + 1))
            i += 1
            continue
        start = f"{hit[0]}.{hit[1]}."
        j = i + length.get(hit[0], 1)
        if j > n or (j < n and names[j].startswith(start)) or not (
                min(run := names[i:j]).startswith(start) and max(run).startswith(start)):
            j = i + 1
            while j < n and names[j].startswith(start):
                j += 1
        length[hit[0]] = j - i
        runs.append((hit, i, j))
        i = j
    return runs


def _runs(node: str, kind: LayerKind, stack: str | None, index: int | None, facts: ModelFacts) -> Runs:
    if _VISION.search(node):
        return Runs.IMAGES
    if _MTP.search(node):
        return Runs.MTP
    if (kind is LayerKind.LAYER and facts.mtp_layers and facts.layers is not None and index >= facts.layers
            and not _EARLY_STACK.search(stack)):
        return Runs.MTP
    return Runs.STEP


def build_graph(names: Iterable[str], stacks: Iterable[str] | None = None,
                where: Callable[[str], str] | None = None, facts: ModelFacts | None = None) -> LayerGraph:
    """Group tensor names into layers, order them and say when each runs (see module doc).

    `stacks` overrides detection; `where` turns a key path (`stacks[0]`) into the
    policy's `file:line:column` for the error naming a prefix that holds no tensor;
    `facts` (config.py) tells MTP layers apart.
    """
    names = list(names)
    facts = facts or ModelFacts()
    runs = _layer_runs(names)
    found: dict[str, set[int]] = {}
    for prefix, number in dict.fromkeys(hit for hit, _, _ in runs):  # each layer once, in order of first appearance
        if number:
            found.setdefault(prefix, set()).add(int(number))
    detected = [p for p, idx in found.items() if len(idx) >= 4 or (len(idx) >= 2 and max(idx) - min(idx) == len(idx) - 1)]
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
    kinds: dict[str, tuple[LayerKind, str | None, int | None]] = {}
    # names of one layer come in runs (an index lists them sorted): each run is added at once
    for (prefix, number), i, j in runs:
        if number and prefix in chosen_set:
            node = f"{prefix}.{number}"
            if node not in kinds:
                kinds[node] = (LayerKind.LAYER, prefix, int(number))
                by_layer[node] = []
            by_layer[node] += names[i:j]
            continue
        for name in names[i:j]:
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
    orders: dict[tuple, tuple] = {}  # a layer's local names, in the index's order -> their order, template
    last: list = []  # the local names last cut, their entry of `orders`, none with a newline (natural.py)
    layers = tuple(Layer(n, kinds[n][0], params, kinds[n][1], kinds[n][2], _runs(n, *kinds[n], facts), template)
                   for n in nodes for params, template in [natural_order(n, by_layer[n], keys, orders, last)])
    graph = nx.DiGraph()
    graph.add_nodes_from((l.name, {"layer": l, "runs": l.runs}) for l in layers)
    graph.add_edges_from(zip(nodes, nodes[1:]), kind="order")
    has_head = any(l.kind is LayerKind.HEAD for l in layers)  # lm_head, or `output` (Meta's layout)
    if not has_head:  # the head reuses the (text) embedding: one tensor, read whole every step
        embed = next((l for l in layers if l.kind is LayerKind.EMBED and l.runs is Runs.STEP), None)
        if embed is not None:
            graph.nodes[embed.name]["tied"] = True
    return LayerGraph(layers, tuple(sorted(chosen, key=stack_rank.get)), graph)


def schedule_problems(graph: LayerGraph, schedule: Sequence[Transfer]) -> list[str]:
    """A prefetch schedule's copy-start edges, added to the graph (`kind="copy"`) and checked.

    Each transfer is an edge `after -> layer`: the copy into the layer's slot
    starts once `after` has run, in the same forward when `after` runs first,
    else in the forward before (and at load, for the first). Unrolled over
    forwards, every copy edge thus points forward in time: a schedule cannot
    deadlock. What it can do is overwrite weights still to be read: no layer
    may hold the slot between `after` and `layer`, and `after` must be the
    slot's previous holder.
    """
    streamed = [t.layer for t in schedule]
    slot = {t.layer: t.slot for t in schedule}
    at = {name: i for i, name in enumerate(streamed)}
    problems = []
    for t in schedule:
        graph.graph.add_edge(t.after, t.layer, kind="copy")
        if t.after not in at:
            problems.append(f"{t.layer}: its copy starts after {t.after}, which streams nothing")
            continue
        i, j = at[t.after], at[t.layer]
        between = streamed[i + 1:j] if i < j else streamed[i + 1:] + streamed[:j]
        holders = [n for n in between if slot[n] == t.slot]
        if holders:
            problems.append(f"{t.layer}: its copy into slot {t.slot} starts after {t.after}, while {holders[0]} "
                            "still holds that slot")
        elif slot[t.after] != t.slot:
            problems.append(f"{t.layer}: its copy into slot {t.slot} starts after {t.after}, which streams through "
                            f"slot {slot[t.after]}")
    return problems


def execution_order(graph: LayerGraph, selected: Iterable[str]) -> list[str]:
    """The selected layer names in the order the graph runs them."""
    selected = set(selected)
    order = nx.subgraph_view(graph.graph, filter_edge=lambda a, b: graph.graph[a][b]["kind"] == "order")
    return [n for n in nx.topological_sort(order) if n in selected]


def _did_you_mean(word: str, options: list[str]) -> str:
    near = closest(word, options) if options else []
    if near:
        return f": did you mean {' or '.join(repr(n) for n in near)}?"
    return f" (detected: {', '.join(sorted(options)[:5]) or 'none'})"
