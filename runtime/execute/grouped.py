"""grouped_mm's arithmetic over a forward's staged experts (experts.py, step 3): all of them at once, or a chunk of
experts at a time.

A forward of many tokens touches nearly every expert, and experts.py stages the rows of each one it touches in HBM
(dequantized, for a quantized checkpoint) before the grouped GEMMs read them: at prefill, a layer's experts whole.
That is 1.2 GB for Qwen3-30B-A3B in bf16, but 31.5 GiB for DeepSeek-V3 in FP8 (256 experts, each 44 MB stored and
88 MB dequantized): on one 80 GB GPU, a 70 GiB budget then kept 38 GiB for weights. `chunked_pairs` computes the
same forward a chunk of staged slots at a time, each chunk's rows staged just before its GEMMs and freed after:
`chunk_of` experts, as many as planner/decide/working.py's CHUNK_BYTES holds (2 GiB; 16 of DeepSeek-V3's, while
a layer of Qwen3-30B-A3B's is one chunk), and the plan's footprint counts one chunk (working.py
`experts_per_chunk`).

The arithmetic is `grouped_pairs`': the pairs sorted by slot, each slot's rows one group of the grouped GEMM. A
chunk passes a contiguous run of those groups, with their offsets less the chunk's first row, so each expert's
products are the same GEMM over the same rows, and the outputs equal the whole forward's bitwise on the CPU (the
tests, with biases, transposed experts, FP8, MXFP4 and the host's experts merged in). On CUDA, torch's grouped GEMM
picks its kernel by the rows per group and the output width (sm90), so a chunk of cold experts may run another kernel
than the whole forward; neither splits the inner dimension, and tests/execute/test_experts_chunks_gpu.py checks such a
case bitwise (on an H200). A chunk whose slots no pair uses (padding) stages nothing.

Limits: the chunks' row ranges are read on the host (one synchronization per forward), so a forward is chunked only
where nothing is being captured or compiled: a prefill (always eager, generation.py) and eager decode steps. A
replayed decode step at a large batch stages its slots at once, as the plan's decode figure counts. A layer that the
plan stages at prefill (prefill.py: every expert, host rows from the ring) is not chunked either; the plan counts it
whole.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from planner.decide.working import experts_per_chunk

from ..place.dequant import quantized, stored


def chunk_of(module: torch.nn.Module, params: list[str], size: int, ids: torch.Tensor) -> int:
    """How many of `size` staged slots a forward of `module` stages at once: `size` where it may not synchronize
    (a capture, a compilation: module doc), else `experts_per_chunk` of one expert's staged bytes."""
    if torch.compiler.is_compiling() or ids.is_cuda and torch.cuda.is_current_stream_capturing():
        return size
    return min(size, experts_per_chunk(expert_bytes(module, params)))


def expert_bytes(module: torch.nn.Module, params: list[str]) -> int:
    """One expert's staged bytes, as working.py counts them from the headers: its rows of every fused parameter as
    stored (a quantized one's data and scales), and a quantized one's rows dequantized (FP8: an element per byte;
    MXFP4: two per byte), in the model's dtype."""
    quants, experts, total = quantized(module), module.num_experts, 0
    for p in params:
        q = quants.get(p)
        if q is None:
            total += getattr(module, p).nbytes // experts
            continue
        data = stored(module, q.data)
        total += (data.nbytes + stored(module, q.scale).nbytes) // experts
        total += data.numel() // experts * (1 if q.format == "fp8" else 2) * q.dtype.itemsize
    return total


def grouped(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, b: torch.Tensor | None,
            transposed: bool) -> torch.Tensor:
    """x [S, in] sorted by slot, w [U, ...], offsets: cumulative rows per slot -> [S, out], as grouped_mm does."""
    weight = w if transposed else w.transpose(-2, -1)
    out = torch.nn.functional.grouped_mm(x.to(weight.dtype), weight, offs=offsets)
    return out if b is None else out.add_(b)


def _sorted(hidden_states: torch.Tensor, pos: torch.Tensor, size: int, k: int):
    """The pairs sorted by slot: (their slots, the permutation, their activations [T*k, H], each slot's cumulative
    rows [size] int32)."""
    pos_sorted, perm = torch.sort(pos)
    x = hidden_states[perm // k]
    counts = torch.histc(pos_sorted.float() if x.device.type == "cpu" else pos_sorted.int(), bins=size, min=0,
                         max=size - 1)
    return pos_sorted, perm, x, torch.cumsum(counts, dim=0, dtype=torch.int32)


def _project(module, x, rows, offsets, at) -> torch.Tensor:
    """Both projections of the sorted pairs `x` over the slots of `rows`; `at`: each pair's slot among them."""
    first = "gate_up_proj" if module.has_gate else "up_proj"
    bias = (lambda p: rows[f"{p}_bias"][at]) if module.has_bias else (lambda p: None)
    up = grouped(x, rows[first], offsets, bias(first), module.is_transposed)
    up = module._apply_gate(up) if module.has_gate else module.act_fn(up)
    return grouped(up, rows["down_proj"], offsets, bias("down_proj"), module.is_transposed)


def _finish(out, perm, weights, k, dtype, merge) -> torch.Tensor:
    """The sorted pairs' outputs back in pair order (then weighted: the same products as weighting first, then
    reordering), the host's merged in, weighted and summed per token."""
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    out = out[inverse]
    out = out if merge is None else merge(out)
    return (out * weights.unsqueeze(-1)).view(-1, k, out.shape[-1]).sum(dim=1).to(dtype)


def grouped_pairs(module: torch.nn.Module, hidden_states: torch.Tensor, rows: dict[str, torch.Tensor],
                  pos: torch.Tensor, size: int, weights: torch.Tensor, k: int, merge=None) -> torch.Tensor:
    """grouped_mm's arithmetic over `size` staged experts: the pairs sorted by slot (`pos` [T*k]: each pair's),
    one grouped GEMM per projection, back in pair order, weighted and summed. `merge`: the pair outputs [T*k, H]
    -> those with the host's where it computed (host/engine.py), before they are weighted and summed."""
    pos_sorted, perm, x, offsets = _sorted(hidden_states, pos, size, k)
    out = _project(module, x, rows, offsets, pos_sorted)
    return _finish(out, perm, weights, k, hidden_states.dtype, merge)


def chunked_pairs(module: torch.nn.Module, hidden_states: torch.Tensor,
                  stage: Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]], order: torch.Tensor,
                  valid: torch.Tensor, pos: torch.Tensor, size: int, chunk: int, weights: torch.Tensor, k: int,
                  merge=None) -> torch.Tensor:
    """`grouped_pairs` with the `size` slots (`order`, `valid`: route's) staged `chunk` at a time by
    `stage(order, valid)` (module doc)."""
    pos_sorted, perm, x, offsets = _sorted(hidden_states, pos, size, k)
    ends = [0, *offsets.tolist()]  # each slot's last row: the one synchronization (module doc)
    out = None
    for first in range(0, size, chunk):
        last = min(size, first + chunk)
        a, b = ends[first], ends[last]
        if a == b:
            continue  # no pair routed to these slots: padding
        rows = stage(order[first:last], valid[first:last])
        part = _project(module, x[a:b], rows, offsets[first:last] - a, pos_sorted[a:b] - first)
        del rows
        if out is None:
            out = part.new_empty((x.shape[0], part.shape[-1]))
        out[a:b] = part
    return _finish(out, perm, weights, k, hidden_states.dtype, merge)
