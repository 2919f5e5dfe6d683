"""What one decode step and the prefill read of each tensor: the cost model's per-tensor facts (cost.py's roles).

Per tensor: its role (expert, embedding or dense), the fraction of its bytes a
decode step reads (`frac`), the fraction the prefill reads (`pre_frac`), the
FLOPs the prefill spends on it (`flops`), whether a forward reads it in place
once rather than once per tile (`gathered`: experts, embedding rows); per layer,
its routed tensors (`experts`). cost.py says how each follows from the role,
the routing and the batch. Two FLOP counts are not a GEMM over every prompt
token: the head's (and a tied embedding's, which is the head) computes the last
position's logits only, as the runtime's generation asks (2 x elements); a
query projection (`ATTENTION`, in a decoder layer) carries its layer's attention
besides its own GEMM: causal scores and values over T tokens, 2 x T^2 x its
output features (every head's dimensions; MLA's `q_b_proj` counts its query
heads' width for the values too, which a 128-wide value head makes 1.5x high).

Layers alike (alike.py) have the same facts tensor for tensor: a layer's facts
depend on its local names (its template), kind, when it runs, the dtypes and
shapes of its tensors, which of them are routed experts and the expert counts
of its groups, unless a rule gives one of them a role or a routing profile
counts its experts. So they are worked out once per `kind` of layer and copied
to each layer of that kind (DeepSeek-V3: a handful of kinds for 65 layers);
`kind` also lets cost.py predict each kind of layer once per placement.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from functools import cached_property
from itertools import compress, repeat

from ..inputs.checkpoint import TensorInfo
from ..inputs.routing import RoutingProfile
from ..layers.alike import Shapes, applies
from ..layers.graph import Layer, LayerGraph
from ..layers.groups import FusedGroups
from ..plan import LayerKind, Role, Runs

ATTENTION = ("q_proj.weight", "q_b_proj.weight")  # a decoder layer's query projection: its attention's width


def chance_read(share: float, tokens: int) -> float:
    """The chance that `tokens` tokens, each routed to an expert with chance `share`, touch it."""
    return 1 - (1 - share) ** tokens


def later(first: float, ahead: float, var: float) -> float:
    """The expected end of the later of two sides whose times vary: E[max(A, B)] for B of mean `first` and
    A - B of mean `ahead` and variance `var` (us^2), taken as normal: E[B] + mu Phi(mu/s) + s phi(mu/s).

    A layer split between the host's cores and the GPU (experts on cpu beside experts on uva, cost.py) ends when
    the later side does, and which experts a step touches is random: each expert e, touched with chance q_e
    (`chance_read`) independently of the others, adds t_e to its own side (+t_e to A, -t_e to A - B), so
    var = sum q_e (1 - q_e) t_e^2. The mean of the later side is above the later of the means: at batch 1 over
    8 of Qwen3-30B-A3B's 128 experts, half of them on cpu, with the H100 machine's figures (118 us an expert on
    the host, 200 over the link), 0.99 ms a layer against 0.92 (measured: 1.08), and the best share on cpu moves
    from 60% to 70%. Limits: top-k picks exactly k experts a token, so one token's touches are not independent;
    there the variance this gives is 6% above the exact (hypergeometric) one, and E[max] 0.4%."""
    if var <= 0:
        return first + max(ahead, 0.0)
    s = math.sqrt(var)
    z = ahead / s
    return first + ahead * 0.5 * (1 + math.erf(z / math.sqrt(2))) + s * math.exp(-z * z / 2) / math.sqrt(2 * math.pi)


class Reads:
    """The facts of the module doc: per layer, its kind's number and facts tensor by tensor; by tensor name,
    put together when first asked for (a prefetch plan's prediction reads them by kind)."""

    def __init__(self, shapes: Shapes):
        self.shapes = shapes  # each layer's dtypes and shapes (alike.py): read once, for the slot images too
        # layer -> (its kind's number, (roles, fracs, pre_fracs, flops, gathered), routed): one entry per tensor
        self.layers: dict[str, tuple[int, tuple, tuple[bool, ...]]] = {}
        self.experts: dict[str, list[str]] = {}  # layer -> its routed tensors, in order
        self._names: dict[str, tuple[str, ...]] = {}  # layer -> its tensors

    def _by_name(self, i: int) -> dict:
        return {n: v for layer, names in self._names.items() for n, v in zip(names, self.layers[layer][1][i])}

    @cached_property
    def role(self) -> dict[str, Role]:
        return self._by_name(0)

    @cached_property
    def frac(self) -> dict[str, float]:
        return self._by_name(1)

    @cached_property
    def pre_frac(self) -> dict[str, float]:
        return self._by_name(2)

    @cached_property
    def flops(self) -> dict[str, float]:
        """Prefill: 2 x T x elements x the share of tokens it computes."""
        return self._by_name(3)

    @cached_property
    def gathered(self) -> set[str]:
        return {n for layer, names in self._names.items() for n in compress(names, self.layers[layer][1][4])}


def reads(graph: LayerGraph, tensors: Mapping[str, TensorInfo], groups: FusedGroups, top_k: int | None,
          roles: Mapping[str, Role] | None, routing: RoutingProfile | None, batch: int, prompt_tokens: int,
          shapes: Shapes | None = None) -> Reads:
    """Every tensor's facts (module doc): `roles` are the rules' overrides; `routing` a profile that counts
    every group that runs in decode, or None for uniform routing over `top_k` of each group's experts; `shapes`:
    the layers' dtypes and shapes (alike.py, over `tensors`) where the caller has read them."""
    counts = {g: groups.experts(g) for g in groups.members}
    chance = {g: routing.probabilities(g) for g in groups.members if g in routing.layers} if routing else {}
    phase = "prefill" if routing and routing.prefill_tokens else "decode"
    pre_chance = {g: routing.probabilities(g, phase) for g in chance} if routing else {}
    # group -> what its tensors' reads depend on: the expert (a profile's group), else the expert count
    depends = {g: None if g in chance else (counts[g],) if top_k is not None else () for g in groups.members}
    read: dict[tuple, tuple[float, float, float]] = {}  # `depends` -> (frac, pre_frac, pre)

    def expert_read(g: str, e: int | None) -> tuple[float, float, float]:
        """A routed tensor's (frac, pre_frac, pre): over its rows (one for one expert's tensor, E for a
        pre-fused one), the mean chance to be read in a step and in the prefill, and the mean share of
        prefill tokens computed; all of it when routing is unknown."""
        key = depends[g] if depends[g] is not None else (g, e)
        if key not in read:
            if g in chance:
                decode, prefill = (chance[g], pre_chance[g]) if e is None else ((chance[g][e],), (pre_chance[g][e],))
            elif top_k is not None:
                decode = prefill = (min(top_k, counts[g]) / counts[g],)
            else:
                decode = prefill = (1.0,)
            read[key] = (sum(chance_read(p, batch) for p in decode) / len(decode),
                         sum(chance_read(p, prompt_tokens) for p in prefill) / len(prefill),
                         sum(prefill) / len(prefill))
        return read[key]

    # A tied embedding is also the head, which reads all of it every step: dense, not sparse.
    embed = set() if graph.tied_embeddings else {
        n for l in graph.layers if l.kind is LayerKind.EMBED for n in l.params if len(tensors[n].shape) == 2}
    roles = roles or {}
    facts: dict[tuple, tuple] = {}  # (role, routed, read, shape, runs every step, head, query) -> what follows

    def tensor_facts(n: str, is_routed: bool, e: int | None, group: str | None, step: bool, kind: LayerKind) -> tuple:
        """(role, frac, pre_frac, flops, gathered) of one tensor of a layer of `kind`: `e` its expert, `group`
        its group (None: ask `groups`)."""
        role = roles.get(n) or (Role.EXPERT if is_routed else Role.EMBEDDING if n in embed else Role.DENSE)
        shape = tensors[n].shape
        g = (group or groups.group_of[n]) if is_routed and role is Role.EXPERT else None
        e = None if g is None else e
        # the GEMM's tokens: the last position's at the head (module doc); a query projection's attention
        last = kind is LayerKind.HEAD or kind is LayerKind.EMBED
        attention = kind is LayerKind.LAYER and n.endswith(ATTENTION) and len(shape) == 2
        key = (role, is_routed, g if g is None else depends[g] if depends[g] is not None else (g, e), shape, step,
               last, attention)
        got = facts.get(key)
        if got is None:
            if role is Role.EMBEDDING:
                rows = max(1, shape[0])
                frac, pre_frac, pre = min(1.0, batch / rows), min(1.0, prompt_tokens / rows), 0.0
            elif g is not None:
                frac, pre_frac, pre = expert_read(g, e)
            else:  # dense, or an override: all of it
                frac = pre_frac = pre = 1.0
            if not step:
                frac = pre_frac = pre = 0.0  # neither in a decode step nor in a text prefill
            flops = 2 * (1 if last else prompt_tokens) * math.prod(shape) * pre
            if attention:
                flops += 2 * prompt_tokens ** 2 * shape[0] * pre
            got = facts[key] = (role, frac, pre_frac, flops, role is Role.EMBEDDING or is_routed)
        return got

    out = Reads(shapes := Shapes(tensors) if shapes is None else shapes)
    kinds: dict[tuple, tuple[int, tuple]] = {}  # a layer's kind -> (its number, its facts tensor by tensor)
    for i, layer in enumerate(graph.layers):
        params = layer.params
        flags, numbers, local = _routed(layer, groups)
        kind = _kind(layer, flags, shapes, groups, depends, roles)
        number, got = kinds.get(kind, (-1 - i, None)) if kind is not None else (-1 - i, None)
        if got is None:
            step = layer.runs is Runs.STEP
            named = repeat(None) if local is None else (g and layer.name + g for g in local)  # a kind's first layer
            got = tuple(zip(*map(tensor_facts, params, flags, numbers, named, repeat(step), repeat(layer.kind)))) \
                or ((),) * 5
            if kind is not None:
                number = len(kinds)
                kinds[kind] = (number, got)
        out.layers[layer.name] = (number, got, flags)
        out._names[layer.name] = params
        out.experts[layer.name] = list(compress(params, flags))
    return out


def _routed(layer: Layer, groups: FusedGroups) -> tuple[tuple[bool, ...], tuple[int | None, ...], tuple | None]:
    """Per tensor of `layer`: `groups.routed`, its expert (`groups.index_of`; None for none) and, where read from
    the layer's template (alike.py: where `groups` holds every per-expert tensor of its groups), its group's name
    after the layer's (else None: by name, `groups.group_of`)."""
    t, pieces = layer.template, groups.pieces
    if t is not None and applies(layer.name) and all(
            len(pieces.get(layer.name + g, ((),))[0]) == len(each) for g, _, each, _, _ in t.groups):
        flags, numbers, local = t.numbered
        whole = [i for *_, ws in t.groups for i in ws]
        if whole:  # stored fused: routed where its rows are the group's experts
            flags = list(flags)
            for i in whole:
                flags[i] = layer.params[i] in groups.rows_of
            flags = tuple(flags)
        return flags, numbers, local
    numbers = tuple(map(groups.index_of.get, layer.params))
    return tuple(e is not None or n in groups.rows_of for n, e in zip(layer.params, numbers)), numbers, None


def _kind(layer: Layer, routed: tuple[bool, ...], shapes: Shapes, groups: FusedGroups,
          depends: Mapping[str, tuple | None], roles: Mapping[str, Role]) -> tuple | None:
    """What a layer's facts depend on (module doc), or None when they are its own: a rule gives one of its
    tensors a role, a routing profile counts its experts, or its names are no template's (alike.py)."""
    t = layer.template
    if t is None or not applies(layer.name) or roles and not roles.keys().isdisjoint(layer.params):
        return None
    mine = [layer.name + g[0] for g in t.groups if layer.name + g[0] in groups.members]
    if any(depends[g] is None for g in mine):
        return None
    return id(t), layer.kind, layer.runs, shapes(layer), routed, tuple(depends[g] for g in mine)
