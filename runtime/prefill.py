"""Prefill staging: uva tensors copied to the GPU before a layer of a forward that carries many tokens.

A GEMM reading its weight in place through a UVA view pulls the weight over
the host link once per output tile: for a decode step (a few tokens) that is
once, for a long prompt many times (24x the bytes at 8192 tokens on the H100).
The plan's `prefill:` section (planner/plan.py `PrefillStaging`) names the
layers whose uva tensors are staged, and `above_tokens`, the crossover `plan
calibrate` measured. Routed experts are staged only where it says `experts`
(when the prompt is predicted to touch most of them: planner/staging.py):
each fused expert parameter lies whole in the slot, its experts in pinned
memory copied, one copy per run of them, and offplan's experts
implementation (experts.py) gathers the touched ones from the slot, those
the plan keeps on the GPU from HBM as always. Otherwise the experts
implementation reads each touched expert once per forward, through the
zero-copy view, once the router has picked them. Per forward:

- a forward pre-hook on each staged layer's module counts the tokens of its
  input (all dimensions but the last). At or below `above_tokens` it does
  nothing: decode reads in place, zero-copy, as before;
- one on the model's input embedding starts the first staged layer's copy
  when the forward begins (above the threshold), so that it overlaps the
  layers before it instead of waiting for that layer's hook (unless that
  layer is a vision tower, which a text prompt never runs);
- above, the layer's staged tensors are copied into a GPU slot (there are
  `slots`, normally 2, used in turn) and the compute stream waits for that
  copy; then the next staged layer's copy starts on the copy stream, after an
  event recorded on the compute stream just now, so it overwrites the slot only
  once the layer that used it last has run. The copy of layer i+1 overlaps the
  compute of layer i, as prefetch does;
- while the layer runs, each staged parameter reads its slot view instead of
  the pinned tensor: the owning module's class is swapped for a subclass whose
  class property for that name returns the slot view while its layer's forward
  is staged, the registered parameter otherwise (the forward hook clears the
  flag). That is how `torch.nn.utils.parametrize` computes a parameter on
  access, without its machinery (a parametrize access costs about 10 us of
  CPU, 9 per decoder layer per decode step: a tax on eager decode); Dynamo
  inlines class properties of modules. The parameter stays registered under
  its own name (`named_parameters()` and `state_dict()` unchanged; a persistent
  buffer held with the weights, the same way) and
  `param.data` is never touched. `remove()` restores each module's class.

The wait and the copies run in `offplan::prefetch_wait` (ops.py), threaded
through the layer's input as prefetch does, so torch.compile keeps them in
order without a graph break; the staged-or-not choice is made from the input's
shape in Python, which Dynamo traces (and guards on). A decode step captured in
a CUDA graph stages nothing: it stays zero-copy.

Without CUDA the same rotation runs with synchronous copies into CPU slots, so
CI exercises it; a wrong slot gives wrong outputs.

Lifecycle: `PrefillStager(...)` (slots, module classes swapped, hooks) -> forwards ->
`remove()` (classes restored, hooks removed, slots freed).
"""
from __future__ import annotations

import functools

import torch

from planner.errors import PlanFileError
from planner.plan import PrefillStaging

from . import ops
from .arena import PinnedArena, align, typed
from .checkpoint_names import Target
from .modules import module_paths


class _LayerState:
    """Whether the layer's forward now running is staged: the staged properties read it, the hooks set it."""

    def __init__(self):
        self.staged = False


def _staged_property(name: str, buffer: bool) -> property:
    if buffer:  # a persistent buffer held with the weights (DeepSeek-V3's router `e_score_correction_bias`)
        def get(self):
            state, view = self._offplan_staged[name]
            return view if state.staged else self._buffers[name]
    else:
        def get(self):
            state, view = self._offplan_staged[name]
            return view if state.staged else self._parameters[name]
    return property(get)


@functools.cache
def _staged_class(cls: type, names: frozenset[tuple[str, bool]]) -> type:
    """`cls` with a property per staged (parameter or buffer name, is a buffer) (module doc); one class per
    (class, names)."""
    return type(f"Staged{cls.__name__}", (cls,), {n: _staged_property(n, b) for n, b in sorted(names)})


def _copies(t: Target, dst: torch.Tensor, src: torch.Tensor, routed: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(slot bytes, pinned bytes) to stage `t`: all of it, or for a fused expert parameter each run of
    consecutive experts in pinned memory (rows the plan keeps on the GPU are read from there: experts.py)."""
    if not routed or not t.resident:
        return [(dst, src)]
    row, keep = t.nbytes // t.shape[0], set(t.resident)
    out, start = [], None
    for e in range(t.shape[0] + 1):
        if e < t.shape[0] and e not in keep:
            start = e if start is None else start
        elif start is not None:
            out.append((dst[start * row:e * row], src[start * row:e * row]))
            start = None
    return out


def _tokens(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.dim() else 0


class PrefillStager:
    """Slots, a copy stream, each staged layer's copies, staged parameters and hooks (module doc)."""

    def __init__(self, staging: PrefillStaging, targets: list[Target], experts: set[str], quantized: set[str],
                 host_offset: dict[str, int], arena: PinnedArena, model: torch.nn.Module, device: torch.device,
                 early: bool = True):
        """`targets`: the uva targets; those whose pieces are routed experts (`experts`: checkpoint names of
        fused expert groups) are staged only with `staging.experts`, quantized ones (`quantized`: checkpoint
        names) never. `early`: the first staged layer runs in every forward (no vision tower, which a text
        prompt skips), so its copy may start at the input embedding."""
        self.above = staging.above_tokens
        self.device = device
        self.cuda = device.type == "cuda"
        self.slots = [torch.empty(staging.slot_bytes, dtype=torch.uint8, device=device) for _ in range(staging.slots)]
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.copies: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # per staged layer: (slot bytes, pinned bytes)
        self.ready = [torch.cuda.Event() for _ in staging.layers] if self.cuda else []
        self.ahead: int | None = None  # the layer whose copy was started by the one before it
        self.staged_forwards = 0  # staged layer forwards, for stats and tests
        self.swapped: dict[torch.nn.Module, type] = {}  # module -> its own class
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
        views: dict[torch.nn.Module, dict[str, tuple[_LayerState, torch.Tensor]]] = {}
        for index, layer in enumerate(staging.layers):
            slot = self.slots[index % staging.slots]
            state = _LayerState()
            cursor, copies = 0, []
            for t in mine[layer.layer]:
                if cursor + t.nbytes > staging.slot_bytes:
                    problems.append(f"{layer.layer}: its staged tensors need more than the plan's slot_bytes "
                                    f"({staging.slot_bytes})")
                    break
                dst = slot[cursor:cursor + t.nbytes]
                copies += _copies(t, dst, arena.host_view(host_offset[t.name], t.nbytes), t.name in routed)
                for alias in t.aliases:
                    path, _, attr = alias.rpartition(".")
                    views.setdefault(model.get_submodule(path), {})[attr] = (state, typed(dst, t.dtype, t.shape))
                cursor = align(cursor + t.nbytes)
            if not copies:
                problems.append(f"{layer.layer}: the plan stages it for prefill, but it has no uva tensor here")
            self.copies.append(copies)
            if layer.module not in paths:
                continue  # reported by module_paths
            module = model.get_submodule(paths[layer.module])
            self.hooks.append(module.register_forward_pre_hook(self._pre_hook(index, state), with_kwargs=True))
            self.hooks.append(module.register_forward_hook(self._post_hook(state)))
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
            owner.__class__ = _staged_class(type(owner), frozenset(kinds.items()))
        if problems:
            self.remove()
            raise PlanFileError("the plan's prefill staging does not match the model; rebuild the plan", problems)

    @property
    def pool_bytes(self) -> int:
        return sum(s.numel() for s in self.slots)

    def _pre_hook(self, index: int, state: _LayerState):
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
        the first staged layer's copy, unless one is under way."""
        if self.ahead is None:
            self._copy(0)
            self.ahead = 0

    @staticmethod
    def _post_hook(state: _LayerState):
        def hook(module, args, output):
            state.staged = False
        return hook

    def wait(self, index: int) -> None:
        """Stage layer `index` (the body of `offplan::prefetch_wait` for this engine): its copy, unless the
        layer before started it, then the current stream waits for it; then start the next layer's copy."""
        self.staged_forwards += 1
        if self.ahead != index:
            self._copy(index)
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
        for h in self.hooks:
            h.remove()
        self.hooks = []
        if self.copy_stream is not None:
            self.copy_stream.synchronize()
        self.copies = []
        self.slots = []
        self.copy_stream = None
