"""The GPU memory offplan's experts allocate while the model runs, beyond the resident tensors and the pools.

footprint.py counts what a plan holds for its whole life: the resident
tensors, the prefetch slots and the prefill staging pool. An experts module
whose routed experts are not all resident (runtime/execute/experts.py) also
stages, in each forward, its fused parameters' rows for the experts the
forward touches: U slots, each one expert's rows of every fused parameter,
freed when the module returns (so a forward holds one module's at a time),
and for quantized experts their dequantized copy too. This module sizes them
from the headers, per phase, for the largest such module:

    decode  = U x (one expert's stored bytes + its dequantized bytes)
              U = k at batch 1 (one token's pairs); min(E, batch x k) above;
              FP8 and MXFP4 at batch 1 are multiplied from their stored bytes
              (runtime/place/gemv.py): no dequantized copy, and nothing staged
              where every expert is in HBM
    prefill = U x (the same), U = min(E, batch x prompt tokens x k): the
              batch's prompts in one forward, as the runtime's generation
              prefills them; or E in a staged layer (every expert in
              order), plus the expert ring there;
              above BATCHED_PAIRS pairs, outside a staged layer, U is at most
              `experts_per_chunk` (the runtime stages such a forward's experts
              a chunk at a time, runtime/execute/grouped.py: CHUNK_BYTES each)
    buffers = LOOKAHEAD experts' rows of the two largest fused parameters
              (gate_up_proj and down_proj: an expert's weights), where two or
              more modules read experts over the link (lookahead.py)
              + the host engine's outputs where the host computes experts
              (runtime/execute/host/engine.py): host_tokens x k x hidden
              of the experts' dtype, 6.3 MB at Qwen3-30B-A3B's shape

The plan's footprint counts buffers plus the larger of decode and prefill
(`peak_bytes`), and the budget walks leave room for it (`within`). Under
tensor parallelism `tensors` are one GPU's share (layers/shards.py), so the
sizes are each GPU's. Not sized: what transformers' own forward allocates
(activations, the KV cache), which the budget never covered.
Worked example, 8 layers of Qwen3-30B-A3B (E 128, k 8, one expert's bf16 rows
9.4 MB), every expert on uva, a 512-token prompt: decode 75.5 MB at batch 1
and 604 MB at batch 8, prefill 2.28 GB (a layer's 128 experts, 1.21 GB, and the
1 GiB ring of a staged layer), buffers 18.9 MB. DeepSeek-V3 (FP8, one expert's
rows 44 MB stored and 88 MB dequantized): a 512-token prompt's forward stages
its experts 16 at a time, 1.97 GiB, where all 256 took 31.5 GiB (a layer of
Qwen3-30B-A3B's, 1.2 GB, is one chunk). Where config.json gives no k
(and the policy no `workload.experts_per_token`), every expert counts: k = E.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import compress, repeat
from operator import eq, itemgetter
from typing import Protocol, TypeVar

from ..inputs.checkpoint import TensorInfo
from ..layers.alike import Shapes, taker, template_groups
from ..layers.graph import Layer
from ..layers.groups import BATCHED_PAIRS
from ..plan import Placement, working_peak

TRIES = 3  # walks per budget-driven placement (`within`)
CHUNK_BYTES = 2 << 30  # staged expert rows a chunked forward holds at once (runtime/execute/grouped.py reads it)
LOOKAHEAD = 2  # experts the lookahead reads ahead; runtime/execute/lookahead.py LOOKAHEAD (a test holds them equal)
_DTYPE, _NBYTES = itemgetter(1), itemgetter(3)  # of a TensorInfo
_DEQUANTIZED = {"F8_E4M3": 2, "F8_E5M2": 2}  # bf16 bytes per stored byte; MXFP4 blocks: `_per_byte`


@dataclass(frozen=True)
class Working:
    """Bytes the experts allocate as the model runs (module doc): at a decode step, at a prefill, and at load."""

    decode_bytes: int = 0
    prefill_bytes: int = 0
    buffer_bytes: int = 0

    @property
    def peak_bytes(self) -> int:
        return working_peak(self.decode_bytes, self.prefill_bytes, self.buffer_bytes)


def experts_per_chunk(expert_bytes: int) -> int:
    """How many experts a chunked forward stages at once, each `expert_bytes` of rows (stored and dequantized):
    as many as CHUNK_BYTES holds, at least one. The runtime asks the same of its modules (grouped.py)."""
    return max(1, CHUNK_BYTES // max(1, expert_bytes))


def _per_byte(t: TensorInfo) -> int:
    """The dequantized (bf16) bytes per stored byte of an expert tensor; 0 for one read as stored."""
    if t.dtype in _DEQUANTIZED:
        return _DEQUANTIZED[t.dtype]
    return 4 if t.name.endswith("_blocks") and t.dtype == "U8" else 0  # two E2M1 values a byte, 2 bytes each


def _dequantized(infos: list[TensorInfo], dtypes: set[str]) -> int:
    """The bf16 bytes that the quantized tensors of `infos` (whose dtypes are `dtypes`) dequantize to
    (`_per_byte`), summed a dtype at a time: an experts group of DeepSeek-V3 holds 1,536 tensors."""
    total = 0
    for dtype in dtypes.intersection(_DEQUANTIZED):
        total += _DEQUANTIZED[dtype] * sum(map(_NBYTES, compress(infos, map(eq, map(_DTYPE, infos), repeat(dtype)))))
    if "U8" in dtypes:
        total += sum(t.nbytes * _per_byte(t) for t in infos if t.dtype == "U8")
    return total


def _scale(name: str) -> bool:
    return name.endswith(("_scale_inv", "_scales", "_scale"))


class GroupFacts:
    """What `working` reads of each experts group's tensors (their names, dtypes and shapes), found once per kind
    of group: those of layers alike (one template and `Shapes` number, alike.py, and alike in the words `working`
    looks for in a name) hold the same, and DeepSeek-V3's 58 groups of 1,536 tensors are read once."""

    def __init__(self, members: Mapping[str, tuple[str, ...]], tensors: Mapping[str, TensorInfo],
                 layers: Iterable[Layer] = (), shapes: Shapes | None = None):
        """`layers` (the stack's, whose groups `members` holds) and `shapes` (over `tensors`) tell the kinds."""
        self.members, self.tensors = members, tensors
        # group -> (its layer's name, a function taking its members' items of a sequence over the layer's tensors)
        self.at: dict[str, tuple[str, Callable[[Sequence], tuple]]] = {}
        self.kinds: dict[str, tuple] = {}  # group -> its kind, where `shapes` tells it
        for l in layers:  # the groups whose members are where the layer's template says
            for group, ms, every in template_groups(members, l) or ():
                if ms is not None:
                    self.at[group] = (l.name, taker(every))
                    if shapes is not None:
                        local = group[len(l.name):]
                        self.kinds[group] = (l.template, shapes(l), local, "down" in l.name, "bias" in l.name)
        self._known: dict = {}  # (kind or group, what) -> its fact

    def _get(self, group: str, what: Callable[[list[TensorInfo]], object]):
        key = (self.kinds.get(group, group), what)
        if key not in self._known:
            self._known[key] = what(list(map(self.tensors.__getitem__, self.members[group])))
        return self._known[key]

    def bytes(self, group: str) -> tuple[int, int, bool, int]:
        """(stored bytes, dequantized bytes, whether quantized (FP8 or MXFP4: multiplied from its stored bytes at
        one token), bytes read over the link but scales and biases)."""
        return self._get(group, _bytes)

    def down(self, group: str) -> tuple[int, int]:
        """The hidden size and bytes per element of its down projection's output (the host engine's)."""
        return self._get(group, _down)


def _bytes(infos: list[TensorInfo]) -> tuple[int, int, bool, int]:
    dequantized = _dequantized(infos, set(map(_DTYPE, infos)))  # above 0: FP8, or MXFP4's blocks (`_per_byte`)
    return (sum(map(_NBYTES, infos)), dequantized, dequantized > 0,
            sum(t.nbytes for t in infos if not _scale(t.name) and "bias" not in t.name))


def _down(infos: list[TensorInfo]) -> tuple[int, int]:
    down = next(t for t in infos if "down" in t.name and not _scale(t.name) and "bias" not in t.name)
    hidden = {3: down.shape[-1], 2: down.shape[0]}.get(len(down.shape), 0)  # [E, I, H] stored fused; [H, I]
    return hidden, down.nbytes // math.prod(down.shape)


def working(members: Mapping[str, tuple[str, ...]], experts: Mapping[str, int], tensors: Mapping[str, TensorInfo],
            place: Mapping[str, Placement], top_k: int | None, batch: int, prompt_tokens: int,
            staged: Mapping[str, int], host_tokens: int = 0, facts: GroupFacts | None = None,
            wheres: Mapping[str, tuple[Placement, ...]] | None = None) -> Working:
    """`members`: each fused experts group's tensors; `experts`: the decode step's groups and their expert
    counts; `staged`: the groups a staged prefill streams, each with its ring's bytes (0: not staged);
    `host_tokens`: the most tokens a forward hands the host engine (the plan's stage_above_tokens); `facts`:
    a `GroupFacts` of `members` and `tensors` kept across calls; `wheres`: layer name -> its tensors' placements
    in `place`, where the caller has read them (a group's are then read by place, `GroupFacts.at`)."""
    facts = GroupFacts(members, tensors) if facts is None else facts
    decode = prefill = host = 0
    over_link: list[int] = []  # per group read over the link: one expert's weights (gate_up_proj and down_proj)
    for group, count in experts.items():
        at = facts.at.get(group) if wheres is not None else None
        where = set(map(place.__getitem__, members[group]) if at is None else at[1](wheres[at[0]]))
        if Placement.PREFETCH in where:
            continue  # all in HBM, in a slot: transformers' own experts implementation (experts.py)
        k = top_k or count
        if Placement.CPU in where:  # one engine for every module: its outputs sized by the widest
            hidden, size = facts.down(group)
            host = max(host, host_tokens * k * hidden * size)
        stored, dequantized, quantized, weights = facts.bytes(group)
        dequantized //= count
        if where == {Placement.GPU} and not dequantized:
            continue  # likewise: nothing staged
        stored //= count
        slots = k if batch == 1 else min(count, batch * k)
        if batch == 1 and quantized:  # multiplied as stored: gathered from pinned memory, in place if all in HBM
            decode = max(decode, 0 if where == {Placement.GPU} else slots * stored)
        else:
            decode = max(decode, slots * (stored + dequantized))
        ring = staged.get(group)
        pairs = max(1, prompt_tokens) * batch * k  # the batch's prompts prefilled together
        slots = count if ring is not None else min(count, pairs) if pairs <= BATCHED_PAIRS else \
            min(count, pairs, experts_per_chunk(stored + dequantized))
        prefill = max(prefill, slots * (stored + dequantized) + (ring or 0))
        if Placement.UVA in where and Placement.CPU not in where:  # the lookahead's modules (bind_experts.py)
            over_link.append(weights // count)
    buffers = LOOKAHEAD * max(over_link) if len(over_link) > 1 else 0
    return Working(decode, prefill, buffers + host)


class _Placed(Protocol):
    total: int  # the footprint.py total: resident bytes and pools
    place: Mapping[str, Placement]


P = TypeVar("P", bound=_Placed)


def within(walk: Callable[[int], P], budget: int, room: Callable[[Mapping[str, Placement]], int], most: int
           ) -> tuple[P, int]:
    """A budget-driven placement that leaves room for its own working memory, and that memory's peak.

    `walk(b)` places within b bytes (footprint.py `fit`); `room(place)` is a placement's working peak, which
    grows as experts leave the GPU (a ring as large as a layer's host experts, the lookahead once two modules
    read over the link), so the walk is repeated with the room the last one needed kept free: the first walk
    with none, the second with the first's room. The last walk keeps `most` free, the room with every
    movable routed expert on uva, which the walks' placements do not exceed; one that still does not fit is
    returned for the caller's budget error."""
    reserve = 0
    for left in reversed(range(TRIES)):
        placed = walk(budget - reserve)
        need = room(placed.place)
        if placed.total + need <= budget or need <= reserve or not left:
            return placed, need
        reserve = need if left > 1 else max(need, most)
    raise AssertionError("unreachable")
