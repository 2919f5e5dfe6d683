"""The experts' gather: a fused parameter's rows for the experts a forward touches, in HBM (experts.py, step 2).

Each expert's row comes from one of three places: the resident copy in HBM
where the plan keeps that expert on the GPU (`slot[e] >= 0`), the lookahead's
buffer where the module before guessed the expert and read it ahead
(lookahead.py), else the whole parameter in pinned memory, read in place
through its zero-copy view, over the link. Padding slots read nothing.

On CUDA the gather is a Triton kernel that reads a host row only when its slot
needs it (the link is the bottleneck: a kernel reading through a zero-copy
view moves about 50 GB/s on PCIe Gen5). On the CPU, and on CUDA without
Triton, it is `index_select` (which on CUDA would read padding rows over the
link too). The kernel is an opaque custom op (`offplan::gather_rows`), so
torch.compile traces the rest without a graph break; `gather` calls the op
where torch.compile traces it and the function itself elsewhere, since the
dispatcher costs about 35 us a call on the H100 machine's host (68 us for
the op against 35 for the function, measured), twice per layer in an eager step.
"""
from __future__ import annotations

import torch

from . import ops


def _gather_reference(full, resident, slot, order, valid, ahead=None) -> torch.Tensor:
    """rows[u] = resident[slot[e]] if slot[e] >= 0, else ahead.rows[j] if ahead.ids[j] == e (the side read
    completes every chunk without CUDA), else full[e], e = order[u]; rows not `valid`: zeros (the kernel
    leaves them unwritten), so that a test on the CPU sees a row the forward should have read elsewhere."""
    s = slot.index_select(0, order)
    shape = (-1, *([1] * (full.dim() - 1)))
    rows = full.index_select(0, order)
    if ahead is not None:
        hit = order.view(-1, 1) == ahead.ids.view(1, -1)  # [U, count]
        from_ahead = ahead.rows.index_select(0, hit.to(torch.long).argmax(dim=1))
        rows = torch.where(hit.any(dim=1).view(shape), from_ahead, rows)
    if resident.shape[0]:
        rows = torch.where((s >= 0).view(shape), resident.index_select(0, s.clamp(min=0)), rows)
    return torch.where(valid.view(shape) != 0, rows, torch.zeros((), dtype=rows.dtype))


try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch: the reference gather serves
    triton = None

if triton is not None:
    @triton.jit
    def _gather_kernel(out, full, resident, slot, order, valid, ahead_ids, ahead_rows, done, row_numel, first, per,
                       BLOCK: tl.constexpr, AHEAD: tl.constexpr, PROGRAMS: tl.constexpr, RATIO: tl.constexpr):
        u = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < row_numel
        if tl.load(valid + u) != 0:
            e = tl.load(order + u).to(tl.int64)
            s = tl.load(slot + e).to(tl.int64)
            if s >= 0:
                src = resident + s * row_numel
            else:
                src = full + e * row_numel
                j = -1
                for i in tl.static_range(AHEAD):  # the experts guessed for this module (AHEAD 0: none)
                    j = tl.where(tl.load(ahead_ids + i) == e, i, j)
                if j >= 0:  # read ahead, if the side read completed this block's chunk (lookahead.Source)
                    c = j * per + first + tl.program_id(1) // RATIO
                    if c // PROGRAMS < tl.load(done + c % PROGRAMS):
                        src = ahead_rows + j.to(tl.int64) * row_numel
            x = tl.load(src + offs, mask=mask)
            tl.store(out + u.to(tl.int64) * row_numel + offs, x, mask=mask)


def as_words(t: torch.Tensor) -> torch.Tensor:
    """Quantized bytes viewed 4 at a time (the kernels move int32 words), other dtypes as they are."""
    return t.view(torch.int32) if t.element_size() == 1 and t.shape[-1] % 4 == 0 else t


def _gather_rows(full: torch.Tensor, resident: torch.Tensor, slot: torch.Tensor, order: torch.Tensor,
                valid: torch.Tensor, ahead: int = 0, name: str = "", index: int = -1) -> torch.Tensor:
    """Rows of `full` [E, ...] for the slots `order` [U]: each expert's from `resident` where `slot` has it,
    else from the lookahead's buffer where the lookahead keyed `ahead` read it for module `index`'s stored
    tensor `name` (lookahead.py), else from `full` in place (through the zero-copy view: over the link);
    padding slots (`valid` 0) read nothing and hold garbage, which no pair reads."""
    source = ops.engine(ahead).source(index, name, full) if ahead else None
    if not full.is_cuda or triton is None:
        return _gather_reference(full, resident, slot, order, valid, source)
    words = as_words(full)
    row_numel = words[0].numel()
    out = torch.empty((order.numel(), *full.shape[1:]), dtype=full.dtype, device=order.device)
    block = 4096
    _gather_kernel[(order.numel(), triton.cdiv(row_numel, block))](
        as_words(out), words, as_words(resident), slot, order, valid,
        order if source is None else source.ids, words if source is None else as_words(source.rows),
        slot if source is None else source.done, row_numel, 0 if source is None else source.first,
        1 if source is None else source.per, BLOCK=block, AHEAD=0 if source is None else source.ids.numel(),
        PROGRAMS=1 if source is None else source.programs, RATIO=1 if source is None else source.block // block)
    return out


gather_rows = torch.library.custom_op("offplan::gather_rows", _gather_rows, mutates_args=())


def gather(full: torch.Tensor, resident: torch.Tensor, slot: torch.Tensor, order: torch.Tensor,
           valid: torch.Tensor, ahead: int = 0, name: str = "", index: int = -1) -> torch.Tensor:
    """`gather_rows`: the op where torch.compile traces the call, the function itself elsewhere (module doc)."""
    run = gather_rows if torch.compiler.is_compiling() else _gather_rows
    return run(full, resident, slot, order, valid, ahead, name, index)


@gather_rows.register_fake
def _(full, resident, slot, order, valid, ahead=0, name="", index=-1):
    return full.new_empty((order.shape[0], *full.shape[1:]))
