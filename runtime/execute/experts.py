"""The `offplan` experts implementation: every routed expert read once per step, from HBM or pinned memory.

transformers 5.x stacks a layer's experts into fused parameters (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I])
and dispatches the experts' forward through `ALL_EXPERTS_FUNCTIONS`. offplan registers its own entry, "offplan",
and the runtime selects it (`set_experts_implementation`) for a model whose plan puts experts in pinned host memory.
A fused parameter with experts there is one uva tensor (the whole parameter, pinned, read in place); those the plan
keeps on the GPU are also held in HBM, their rows in a resident copy (`bind`). Per forward, for T tokens with top-k
routing over E experts:

1. the unique experts touched, in a list of static size U = min(E, T*k): the hit experts first, by number, then
   padding (gather.py `route`, one launch on CUDA; no host synchronization: a decode step is captured and
   replayed). One token's k experts are distinct: staged in its pairs' order instead, read as they lie in step 3;
2. each fused parameter's rows for those U slots, staged in HBM (gather.py): copied from the resident rows for
   experts on the GPU, read once through the zero-copy view for the others, not at all for padding (no link
   bytes). With T*k >= E every expert is staged: each host row still crosses the link once. A module's pinned
   tensors go in one launch (`gather_many`; FP8 ones that step 3 reads dequantized, and FP8 ones all in HBM:
   gathered and dequantized in one launch, fp8_gather.py), except for one token where the module before guessed
   experts and read them ahead: those rows come from the lookahead's buffer in HBM (lookahead.py, `gather`);
3. the experts' arithmetic over the staged rows, each (token, k) pair routed to its slot (`arithmetic`): up to
   `BATCHED_PAIRS` pairs (one or two tokens) transformers' `batched_mm`'s, above its `grouped_mm`'s over the U
   staged experts (grouped.py; in an eager forward whose U experts' rows exceed CHUNK_BYTES, 2 GiB, steps 2
   and 3 a chunk of the U slots at a time); the same kernels on the same values, so bitwise their outputs on
   the whole parameter. These are the fastest all-GPU paths at batch 1 and from batch 8 on (H100,
   benchmarks/RESULTS.md). The exception, a quantized parameter at one token (FP8, or MXFP4 in bf16): gemv.py
   multiplies each pair by its expert's stored rows (read in place when the parameter is all in HBM, else as
   step 2 gathered them), dequantizing in registers (batched_mm's outputs on the dequantized experts within one
   rounding: another summing order).

The lookahead (step 2) runs in a step captured in a CUDA graph or traced by torch.compile, and on the CPU (so CI
exercises it). An eager step on CUDA skips it: there the CPU's launches set the pace, and its launches cost more
than the link time it saves (H100, 8 Qwen3-30B-A3B layers on uva: 46 steps/s with, 63 without).

At prefill of a layer that the plan stages (prefill.py), the unique list is every expert in expert order (U = E:
a long prompt touches nearly all), step 2 gathers only the rows held in HBM, and those in pinned memory come from
the expert ring (ring.py: copied over the link while earlier layers computed), through `offplan::expert_fill`.

Experts on cpu (host/engine.py) lie in the pinned parameter as uva ones do. In a forward of at most the plan's
prefill threshold in tokens, step 2 leaves their rows out (the lookahead guesses none of them), and the host's
outputs replace their pairs' before the pairs are weighted and summed; above it they are read as uva ones.

A module whose fused parameters are all in HBM (on the GPU, or prefetched) has nothing to deduplicate: it runs
the arithmetic `arithmetic` picks, as offloaded ones do: transformers' `batched_mm`, or (bf16) `grouped_mm_forward`,
its `grouped_mm` less three masks for expert parallelism's sentinel ids (offplan routes none): bitwise its outputs,
1.2x faster at 8192 tokens (docs/moe-prefill/); so does a bf16 model with none to bind (bind_experts.py).
"""
from __future__ import annotations

import torch

from planner.layers.groups import BATCHED_PAIRS  # pairs up to which batched_mm's arithmetic runs (1-2 tokens)

from ..place import fp8_gather, gemv
from ..place.gemv import Fp8Rows, Mxfp4Rows
from ..place.dequant import dequantize, quantized, stored
from . import ops
from .gather import gather, gather_many, route
from .grouped import chunk_of, chunked_pairs, grouped_pairs

_PREFIX = "offplan_"  # non-persistent buffers on an experts module: `offplan_slot_<param>`, `offplan_rows_<param>`


def supports(module: torch.nn.Module) -> bool:
    """Whether `module` dispatches through transformers' experts interface (`use_experts_implementation`)."""
    return all(hasattr(module, a) for a in ("has_gate", "has_bias", "is_transposed", "num_experts"))


def fused_params(module: torch.nn.Module) -> list[str]:
    """The module's fused parameters, as transformers' experts functions read them."""
    names = ["gate_up_proj"] if module.has_gate else ["up_proj"]
    names.append("down_proj")
    if module.has_bias:
        names += [f"{n}_bias" for n in names]
    return names


def stored_params(module: torch.nn.Module, quants: dict | None = None) -> list[str]:
    """The tensors the module stores for its fused parameters: a quantized one's data and scales (dequant.py;
    `quants`: the module's, before `dequant.bind` gives them to it), the parameter itself otherwise."""
    quants = quantized(module) if quants is None else quants
    return [n for p in fused_params(module) for n in ((quants[p].data, quants[p].scale) if p in quants else (p,))]


def bind(module: torch.nn.Module, param: str, resident: torch.Tensor, slot: torch.Tensor) -> None:
    """Give the forward `param`'s resident rows and each expert's row in them (-1: read it in place). Non-persistent
    buffers: part of the module for torch.compile and CUDA graphs, never of its state_dict. `unbind` removes them."""
    module.register_buffer(f"{_PREFIX}rows_{param}", resident, persistent=False)
    module.register_buffer(f"{_PREFIX}slot_{param}", slot, persistent=False)


def bound(module: torch.nn.Module, param: str) -> bool:
    """Whether `param` of `module` runs through offplan's experts implementation (`bind` gave it rows)."""
    return getattr(module, f"{_PREFIX}slot_{param}", None) is not None


def unbind(module: torch.nn.Module) -> None:
    for name in [n for n, _ in module.named_buffers(recurse=False) if n.startswith(_PREFIX)]:
        delattr(module, name)


def arithmetic(pairs: int) -> str:
    """Which transformers experts implementation's arithmetic a forward of `pairs` (token, expert) pairs
    reproduces, bitwise: "batched_mm" or "grouped_mm" (module doc, step 3)."""
    return "batched_mm" if pairs <= BATCHED_PAIRS else "grouped_mm"


def _stage(module, params: list[str], order: torch.Tensor, valid: torch.Tensor, ahead: int = 0,
           x: torch.Tensor | None = None) -> dict[str, torch.Tensor | Fp8Rows | Mxfp4Rows]:
    """`params`' rows for the slots `order`, in HBM, in `params`' order; a quantized parameter's gathered
    quantized, then dequantized (only the touched experts: dequant.py; FP8 in one launch: fp8_gather.py).
    `ahead`: the key of the lookahead whose buffer holds some of them (lookahead.py), 0 for none. `x`: the pairs'
    activations when `order` is one token's pairs: a quantized parameter that gemv.py multiplies is then not
    dequantized (`Fp8Rows`, `Mxfp4Rows`), and one held whole in HBM is not gathered either."""
    quants, out, need, one = quantized(module), {}, {}, {}  # need: param -> (its stored tensors by name, fused)
    for p in params:
        q = quants.get(p)
        if q is None:
            need[p] = ({p: getattr(module, p)}, False)
            continue
        data, scale = stored(module, q.data), stored(module, q.scale)
        fused = x is not None and (gemv.mxfp4_applies(x, data, q.dtype) if q.format == "mxfp4" else
                                   not module.is_transposed and gemv.applies(x, data, q.block, 1))
        if fused and slot_of(module, q.data) is None:  # all in HBM: read in place
            out[p] = _fused_rows(q, data, scale, order)
        elif not fused and not ahead and (source := _one_launch(module, q)) is not None:
            one[p] = source
        else:
            need[p] = ({q.data: data, q.scale: scale}, fused)
    out |= fp8_gather.gather_dequant(one, order, valid) if one else {}
    rows = _rows(module, {n: t for tensors, _ in need.values() for n, t in tensors.items()}, order, valid, ahead)
    for p, (tensors, fused) in need.items():
        q = quants.get(p)
        if q is None:
            out[p] = rows[p]
        else:  # valid 0: padding or the host's experts, never read (quantized experts are never staged)
            data, scale = rows[q.data], rows[q.scale]
            out[p] = _fused_rows(q, data, scale, None) if fused else dequantize(q, data, scale, valid)
    return {p: out[p] for p in params}


def _fused_rows(q, data: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor | None) -> Fp8Rows | Mxfp4Rows:
    """A quantized parameter's experts for one token's pairs, as gemv.py multiplies them where they lie."""
    return Mxfp4Rows(data, scale, ids) if q.format == "mxfp4" else Fp8Rows(data, scale, ids, q.block)


def _one_launch(module, q) -> fp8_gather.Source | None:
    """FP8 `q`'s tensors for one launch (fp8_gather.py): data and scales both pinned, or both all in HBM."""
    if q is None or q.format != "fp8" or not fp8_gather.applies(stored(module, q.data), q.block):
        return None
    (d, dr, ds), (s, sr, ss) = ((stored(module, n), getattr(module, f"{_PREFIX}rows_{n}", None), slot_of(module, n))
                                for n in (q.data, q.scale))
    return None if (ds is None) != (ss is None) else fp8_gather.Source(d, dr, ds, s, sr, ss, q.block, q.dtype)


def _in_hbm(module, param: str) -> torch.Tensor:
    """[E] int32: 1 for each expert of `param` with rows in HBM (`bind`), 0 for those in pinned memory."""
    slot = getattr(module, f"{_PREFIX}slot_{param}", None)
    if slot is None:  # all of it in HBM
        return torch.ones(module.num_experts, dtype=torch.int32, device=getattr(module, param).device)
    return (slot >= 0).to(torch.int32)


def slot_of(module, name: str) -> torch.Tensor | None:
    """[E] int32: each expert's row among the resident rows of stored tensor `name` (-1: in pinned memory);
    None when `name` is not bound (all of it in HBM)."""
    return getattr(module, f"{_PREFIX}slot_{name}", None)


def _rows(module, full: dict[str, torch.Tensor], order: torch.Tensor, valid: torch.Tensor,
          ahead: int = 0) -> dict[str, torch.Tensor]:
    """The rows for `order` of each stored tensor in `full` (by name): those bound (`bind`) by gather.py, in
    one launch where no lookahead holds rows; the others, all in HBM, by `index_select`."""
    pinned = [n for n in full if slot_of(module, n) is not None]
    rows = {n: t.index_select(0, order) for n, t in full.items() if n not in pinned}
    resident = {n: getattr(module, f"{_PREFIX}rows_{n}") for n in pinned}
    if ahead:
        index = module._offplan_ahead.index
        rows |= {n: gather(full[n], resident[n], slot_of(module, n), order, valid, ahead, n, index) for n in pinned}
    elif pinned:
        rows |= dict(zip(pinned, gather_many([full[n] for n in pinned], list(resident.values()),
                                             [slot_of(module, n) for n in pinned], order, valid)))
    return rows


def _ahead_pays(ids: torch.Tensor) -> bool:
    """Whether this forward runs the lookahead (module doc): not in an eager step on CUDA."""
    return not ids.is_cuda or torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing()


def _linear(x: torch.Tensor, w: torch.Tensor | Fp8Rows | Mxfp4Rows, b: torch.Tensor | None,
            transposed: bool) -> torch.Tensor:
    """One GEMV per pair, x [S, in], w [S, out, in] ([S, in, out] transposed) -> [S, out]; quantized in gemv.py."""
    if isinstance(w, Fp8Rows):
        out = gemv.fp8_pairs(x, w.data, w.scale, w.ids, w.block)
    elif isinstance(w, Mxfp4Rows):
        out = gemv.mxfp4_pairs(x, w.data, w.scale, w.ids)
    elif transposed:
        out = torch.bmm(x.unsqueeze(1), w).squeeze(1)
    else:
        out = torch.bmm(w, x.unsqueeze(-1)).squeeze(-1)
    return out if b is None else out.add_(b)


def _batched(self: torch.nn.Module, hidden_states: torch.Tensor, rows: dict[str, torch.Tensor],
             weights: torch.Tensor, k: int, pos: torch.Tensor | None = None, merge=None) -> torch.Tensor:
    """batched_mm's arithmetic: one GEMV per (token, expert) pair. `pos` [T*k] picks each pair's staged row (a
    copy per pair); None: the rows already lie in pair order. `merge`: the pair outputs [T*k, H] -> those with
    the host's where it computed (host/engine.py), before they are weighted and summed."""
    first = "gate_up_proj" if self.has_gate else "up_proj"

    def pick(name: str) -> torch.Tensor | None:
        t = rows.get(name)
        return t if t is None or pos is None else t.index_select(0, pos)

    up = _linear(hidden_states.repeat_interleave(k, dim=0), pick(first), pick(f"{first}_bias"), self.is_transposed)
    up = self._apply_gate(up) if self.has_gate else self.act_fn(up)
    out = _linear(up, pick("down_proj"), pick("down_proj_bias"), self.is_transposed)
    out = out if merge is None else merge(out)
    return (out * weights.unsqueeze(-1)).view(-1, k, out.shape[-1]).sum(dim=1).to(hidden_states.dtype)


def offplan_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """The "offplan" entry of ALL_EXPERTS_FUNCTIONS (module doc). hidden_states [T, H], top_k_* [T, k]."""
    if not quantized(self) and not any(bound(self, p) for p in fused_params(self)):
        implementation = arithmetic(top_k_index.numel())
        if implementation == "grouped_mm" and self.down_proj.dtype == torch.bfloat16:  # bf16 only: bind_experts.py
            return grouped_mm_forward(self, hidden_states, top_k_index, top_k_weights)
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
        return ALL_EXPERTS_FUNCTIONS[implementation](self, hidden_states, top_k_index, top_k_weights)
    num_tokens, k = top_k_index.shape
    experts, pairs = self.num_experts, top_k_index.numel()
    ids = top_k_index.reshape(-1)
    weights = top_k_weights.reshape(-1)
    ring = getattr(self, "_offplan_ring", None)  # set by prefill.py on the experts modules it stages
    host = getattr(self, "_offplan_host", None)  # set by host/bind.py where the plan puts experts on cpu
    staged = ring is not None and ring.state.staged
    merge = None
    if host is not None and not staged and host.engine.takes(num_tokens):  # the host computes its experts
        engine, index, key = host.engine, host.index, host.key
        if torch.compiler.is_compiling():  # through ops opaque to Dynamo (ops.py)
            ids = ops.host_begin(ids, hidden_states, key, index)
            merge = lambda out, x=hidden_states, ids=ids: ops.host_end(out, x, ids, key, index)  # noqa: E731
        else:  # called directly: the ops' dispatch and copy of ids slowed eager steps 1.1-1.3x (docs/front-door)
            engine.begin(index, hidden_states, ids)
            merge = lambda out, x=hidden_states, ids=ids: engine.end(index, out, x, ids)  # noqa: E731
        mine = engine.modules[index].on_cpu_device  # [E] bool
    if staged:  # every expert, in order: HBM rows gathered, host rows from the ring
        size, order, pos = experts, torch.arange(experts, device=ids.device), ids
        rows = {}
        for p in fused_params(self):  # each parameter's own valid slots: its experts in HBM
            rows |= _stage(self, [p], order, _in_hbm(self, p))
        ops.expert_fill(list(rows.values()), ring.key, ring.unit)
    elif num_tokens == 1:  # one token's k experts are distinct: staged in pair order, no weight copy per pair
        use = getattr(self, "_offplan_ahead", None) if _ahead_pays(ids) else None  # set by lookahead.py
        if use is not None and (use.reads or use.guesses):  # this module's guessed experts joined, the next guessed
            ids = ops.ahead_begin(ids, hidden_states, use.key, use.index)
        ahead = use.key if use is not None and use.reads else 0
        valid = torch.ones_like(ids, dtype=torch.int32) if merge is None else \
            mine.index_select(0, ids).logical_not().to(torch.int32)  # the host's experts: not read here
        rows = _stage(self, fused_params(self), ids, valid, ahead, hidden_states)
        if use is not None:  # every gather enqueued before any GEMV; then the next module's guess read ahead
            gathered = [r.data if isinstance(r, (Fp8Rows, Mxfp4Rows)) else r for r in rows.values()]
            hidden_states = ops.ahead_read(hidden_states, gathered, use.key, use.index)
        return _batched(self, hidden_states, rows, weights, k, merge=merge)
    else:
        size = min(experts, pairs)
        order, valid, pos = route(ids, experts)  # hit experts first, by number; pos [T*k]: each pair's slot
        if merge is not None:  # the host's experts: not read here
            valid = valid * mine.index_select(0, order).logical_not().to(torch.int32)
        params = fused_params(self)
        if arithmetic(pairs) == "grouped_mm" and (chunk := chunk_of(self, params, size, ids)) < size:
            return chunked_pairs(self, hidden_states, lambda o, v: _stage(self, params, o, v), order, valid, pos,
                                 size, chunk, weights, k, merge)  # a chunk of the experts' rows at a time
        rows = _stage(self, params, order, valid)
    if arithmetic(pairs) == "batched_mm":  # one weight copy per pair, from HBM
        return _batched(self, hidden_states, rows, weights, k, pos, merge)
    return grouped_pairs(self, hidden_states, rows, pos, size, weights, k, merge)


def grouped_mm_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
    """"offplan_grouped_mm": transformers' grouped_mm less its sentinel masks (module doc), experts all in HBM."""
    rows = {p: getattr(self, p) for p in fused_params(self)}
    return grouped_pairs(self, hidden_states, rows, top_k_index.reshape(-1), self.num_experts,
                         top_k_weights.reshape(-1), top_k_index.shape[1])


def register() -> None:
    """Add "offplan" and "offplan_grouped_mm" to transformers' experts implementations (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    ALL_EXPERTS_FUNCTIONS.register("offplan", offplan_experts_forward)
    ALL_EXPERTS_FUNCTIONS.register("offplan_grouped_mm", grouped_mm_forward)
