"""Prefill staging: uva tensors copied to the GPU before a layer of a forward that carries many tokens.

A GEMM reading its weight in place through a UVA view pulls the weight over
the host link once per output tile: for a decode step (a few tokens) that is
once, for a long prompt many times (24x the bytes at 8192 tokens on the H100).
The plan's `prefill:` section (planner/plan.py `PrefillStaging`) names the
layers whose uva tensors are staged, and `above_tokens`, the crossover `plan
calibrate` measured. Routed experts are staged only where it says so
(`ring_bytes`: when the prompt is predicted to touch most of them,
planner/decide/staging.py), and not through the slots: their rows in pinned memory
stream through the expert ring (ring.py), from which offplan's experts
implementation (experts.py) takes them after its gather of the rows in HBM.
Otherwise the experts implementation reads each touched expert once per
forward, through the zero-copy view, once the router has picked them.

Per forward:

- a forward pre-hook on each staged layer's module counts the tokens of its
  input (all dimensions but the last). At or below `above_tokens` it does
  nothing: decode reads in place, zero-copy, as before;
- one on the model's input embedding starts the first staged layer's copy
  and the expert ring when the forward begins (above the threshold), so that
  they overlap the layers before it instead of waiting for that layer's hook
  (unless that layer is a vision tower, which a text prompt never runs);
- above, the layer's staged tensors are copied into a GPU slot (there are
  `slots`, normally 2, used in turn) and the compute stream waits for that
  copy; then the next staged layer's copy starts on the copy stream, after an
  event recorded on the compute stream just now, so it overwrites the slot only
  once the layer that used it last has run. The copy of layer i+1 overlaps the
  compute of layer i, as prefetch does;
- while the layer runs, each staged parameter reads its slot view instead of
  the pinned tensor, through a class property (place/slot_params.py); `remove()` restores
  each module's class.

The wait and the copies run in `offplan::prefetch_wait` (ops.py), threaded
through the layer's input as prefetch does, so torch.compile keeps them in
order without a graph break; the staged-or-not choice is made from the input's
shape in Python, which Dynamo traces (and guards on). A decode step captured in
a CUDA graph stages nothing: it stays zero-copy.

Without CUDA the same rotation runs with synchronous copies into CPU slots, so
CI exercises it; a wrong slot gives wrong outputs.

A staged experts module's forward finds its layer's state, the stager's key
and its unit in the ring through the `_offplan_ring` attribute the stager
sets on it (`RingUse`), and calls `offplan::expert_fill` while the layer is
staged. An experts module that does not dispatch through offplan's experts
implementation (experts.py `supports`; Llama 4's in transformers 5.17, which
multiplies every expert for every token) reads its host experts in place at
prefill too (`in_place` names them): the planner, which sees names only,
cannot size a slot for them.

Lifecycle: `PrefillStager(...)` (slots, ring, module classes swapped, hooks) -> forwards ->
`remove()` (classes restored, hooks removed, slots freed).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from planner.errors import PlanFileError
from planner.plan import PrefillStaging

from ..place.arena import PinnedArena, align, typed
from ..place.modules import module_paths
from ..place.names import Target
from . import experts as experts_impl, ops
from .ring import ExpertRing
from ..place.slot_params import LayerState, staged_class


@dataclass(frozen=True)
class RingUse:
    """What a staged experts module's forward needs of the ring: its layer's state, the stager, its unit."""

    state: LayerState
    key: int
    unit: int


def _tokens(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.dim() else 0


class PrefillStager:
    """Slots, a copy stream, each staged layer's copies, staged parameters and hooks (module doc)."""

    def __init__(self, staging: PrefillStaging, targets: list[Target], experts: set[str], quantized: set[str],
                 host_offset: dict[str, int], arena: PinnedArena, model: torch.nn.Module, device: torch.device,
                 early: bool = True):
        """`targets`: the uva targets; those whose pieces are routed experts (`experts`: checkpoint names of
        fused expert groups) go through the expert ring, and only with `staging.experts`; quantized ones
        (`quantized`: checkpoint names) are never staged. `early`: the first staged layer runs in every forward
        (no vision tower, which a text prompt skips), so its copies may start at the input embedding."""
        self.above = staging.above_tokens
        self.device = device
        self.cuda = device.type == "cuda"
        self.slots = [torch.empty(staging.slot_bytes, dtype=torch.uint8, device=device) for _ in range(staging.slots)]
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.copies: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # per staged layer: (slot bytes, pinned bytes)
        self.ready = [torch.cuda.Event() for _ in staging.layers] if self.cuda else []
        self.ahead: int | None = None  # the layer whose copy was started by the one before it
        self.last: int | None = None  # the last staged layer waited for (a lower one starts a new forward)
        self.staged_forwards = 0  # staged layer forwards, for stats and tests
        self.swapped: dict[torch.nn.Module, type] = {}  # module -> its own class
        self.ring_modules: list[torch.nn.Module] = []
        self.in_place: list[str] = []  # routed experts whose module runs its own forward: read in place (module doc)
        self.hooks = []
        self.key = ops.register(self)
        mine = {l.layer: [] for l in staging.layers}
        routed = {t.name for t in targets if any(p.source in experts for p in t.pieces)}
        for t in targets:
            if any(p.source in quantized for p in t.pieces) or (t.name in routed and not staging.experts):
                continue
            layer = next((l for l in mine if t.pieces[0].source.startswith(l + ".")), None)
            if layer is not None:
                mine[layer].append(t)
        paths, problems = module_paths(model, targets, {l.module for l in staging.layers})
        views: dict[torch.nn.Module, dict[str, tuple[LayerState, torch.Tensor]]] = {}
        units: list[list[tuple[int, torch.Tensor, list[int]]]] = []
        for index, layer in enumerate(staging.layers):
            slot = self.slots[index % staging.slots] if self.slots else None  # none: it stages experts only
            state = LayerState()
            cursor, copies, rows, in_place = 0, [], {}, len(self.in_place)
            for t in mine[layer.layer]:
                host = arena.host_view(host_offset[t.name], t.nbytes)
                path, _, attr = t.name.rpartition(".")
                owner = model.get_submodule(path)
                if t.name in routed:  # through the ring, if offplan's experts implementation runs the module
                    if experts_impl.bound(owner, attr):
                        rows.setdefault(owner, []).append((experts_impl.fused_params(owner).index(attr),
                                                           typed(host, t.dtype, t.shape),
                                                           sorted(set(range(t.shape[0])) - set(t.resident))))
                    else:
                        self.in_place.append(t.name)
                    continue
                if cursor + t.nbytes > staging.slot_bytes:
                    problems.append(f"{layer.layer}: its staged tensors need more than the plan's slot_bytes "
                                    f"({staging.slot_bytes})")
                    break
                dst = slot[cursor:cursor + t.nbytes]
                copies.append((dst, host))
                for alias in t.aliases:
                    path, _, attr = alias.rpartition(".")
                    views.setdefault(model.get_submodule(path), {})[attr] = (state, typed(dst, t.dtype, t.shape))
                cursor = align(cursor + t.nbytes)
            for owner, params in rows.items():
                owner._offplan_ring = RingUse(state, self.key, len(units))
                self.ring_modules.append(owner)
                units.append(params)
            if not copies and not rows and len(self.in_place) == in_place:
                problems.append(f"{layer.layer}: the plan stages it for prefill, but it has no uva tensor here")
            self.copies.append(copies)
            if layer.module not in paths:
                continue  # reported by module_paths
            module = model.get_submodule(paths[layer.module])
            self.hooks.append(module.register_forward_pre_hook(self._pre_hook(index, state), with_kwargs=True))
            self.hooks.append(module.register_forward_hook(self._post_hook(state)))
        try:
            self.ring = ExpertRing(staging.ring_bytes, units, device, self.copy_stream) if units else None
        except PlanFileError as e:
            problems.append(str(e))
        embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if early and isinstance(embed, torch.nn.Module) and self.copies:  # the first staged copy starts with the forward
            self.hooks.append(embed.register_forward_pre_hook(self._start_hook))
        for owner, staged in views.items():
            kinds = {attr: owner._buffers.get(attr) is not None for attr in staged}
            lost = [a for a, buffer in kinds.items() if not buffer and owner._parameters.get(a) is None]
            if lost:
                problems.append(f"{type(owner).__name__} has no parameter or buffer {lost} to stage")
                continue
            self.swapped[owner] = type(owner)
            owner._offplan_staged = staged
            owner.__class__ = staged_class(type(owner), frozenset(kinds.items()))
        if problems:
            self.remove()
            raise PlanFileError("the plan's prefill staging does not match the model; rebuild the plan", problems)

    @property
    def pool_bytes(self) -> int:
        return sum(s.numel() for s in self.slots)

    def _pre_hook(self, index: int, state: LayerState):
        def hook(module, args, kwargs):
            if args and isinstance(args[0], torch.Tensor):
                x, put = args[0], lambda y: ((y, *args[1:]), kwargs)
            elif isinstance(kwargs.get("hidden_states"), torch.Tensor):
                x, put = kwargs["hidden_states"], lambda y: (args, {**kwargs, "hidden_states": y})
            else:
                state.staged = False
                return None
            state.staged = _tokens(x) > self.above
            if not state.staged:
                return None
            return put(ops.prefetch_wait(x, self.key, index))
        return hook

    def _start_hook(self, module, args):
        """On the input embedding, above the threshold: the first staged layer's copy starts now, overlapping
        the layers before it (`input_ids` [B, T]: B x T tokens, as the layers count them)."""
        if not args or not isinstance(args[0], torch.Tensor) or args[0].numel() <= self.above:
            return None
        return (ops.prefetch_start(args[0], self.key, -1), *args[1:])

    def start_after(self, index: int) -> None:
        """The body of `offplan::prefetch_start` for this engine, called before any layer (`index` -1): start
        the first staged layer's copy, unless one is under way, then the expert ring's."""
        if self.ahead is None:
            self._copy(0)
            self.ahead = 0
        if self.ring is not None:
            self.ring.begin()
        self.last = -1

    def fill(self, unit: int, rows: list[torch.Tensor]) -> None:
        """The body of `offplan::expert_fill`: `unit`'s host rows from the ring (ring.py)."""
        self.ring.fill(unit, rows)

    @staticmethod
    def _post_hook(state: LayerState):
        def hook(module, args, output):
            state.staged = False
        return hook

    def wait(self, index: int) -> None:
        """Stage layer `index` (the body of `offplan::prefetch_wait` for this engine): its copy, unless the
        layer before started it, then the current stream waits for it; then start the next layer's copy."""
        self.staged_forwards += 1
        if self.ahead != index:
            self._copy(index)
        if self.ring is not None and (self.last is None or index <= self.last):  # a forward the embedding did not start
            self.ring.begin()
        self.last = index
        self.ahead = None
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.ready[index])
        if index + 1 < len(self.copies):
            self._copy(index + 1)
            self.ahead = index + 1

    def _copy(self, index: int) -> None:
        if not self.cuda:
            for dst, src in self.copies[index]:
                dst.copy_(src)
            return
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        self.copy_stream.wait_event(done)
        with torch.cuda.stream(self.copy_stream):
            for dst, src in self.copies[index]:
                dst.copy_(src, non_blocking=True)
            self.ready[index].record(self.copy_stream)

    def remove(self) -> None:
        """Module classes restored and hooks removed (each parameter is its pinned tensor again), slots freed."""
        for owner, cls in self.swapped.items():
            owner.__class__ = cls
            del owner._offplan_staged
        self.swapped = {}
        for owner in self.ring_modules:
            del owner._offplan_ring
        self.ring_modules = []
        self.ring = None
        for h in self.hooks:
            h.remove()
        self.hooks = []
        if self.copy_stream is not None:
            self.copy_stream.synchronize()
        self.copies = []
        self.slots = []
        self.copy_stream = None
