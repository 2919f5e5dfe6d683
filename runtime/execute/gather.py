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

An eager step is bound by the CPU's launches, and a Triton launch costs about
80 us of CPU on the H100 machine's host, more with each argument (measured:
`gather` 140 us a call). So where no lookahead is read, `gather_many` moves
every pinned tensor of a module in one launch (up to four per launch), and
`route` computes a forward's slots (experts.py step 1) in one launch where
torch takes nine ops (367 us of CPU against 99, measured at batch 8). One
launch also keeps the link busier: two gathers in one kernel read the link at
49 GB/s against 41 for the two kernels in turn (46 experts at batch 8).
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

    @triton.jit
    def _copy_row(out, full, resident, slot, row_numel, e, u, block, BLOCK: tl.constexpr):
        offs = block * BLOCK + tl.arange(0, BLOCK)
        mask = offs < row_numel
        s = tl.load(slot + e).to(tl.int64)
        if s >= 0:
            src = resident + s * row_numel
        else:
            src = full + e * row_numel
        tl.store(out + u.to(tl.int64) * row_numel + offs, tl.load(src + offs, mask=mask), mask=mask)

    @triton.jit
    def _gather_many_kernel(order, valid, out0, full0, res0, slot0, n0, out1, full1, res1, slot1, n1,
                            out2, full2, res2, slot2, n2, out3, full3, res3, slot3, n3,
                            COUNT: tl.constexpr, BLOCK: tl.constexpr):
        u = tl.program_id(0)
        if tl.load(valid + u) != 0:  # program (u, block, t): block `block` of slot u's row of tensor t
            e = tl.load(order + u).to(tl.int64)
            t = tl.program_id(2)
            if t == 0:
                _copy_row(out0, full0, res0, slot0, n0, e, u, tl.program_id(1), BLOCK)
            if COUNT > 1:
                if t == 1:
                    _copy_row(out1, full1, res1, slot1, n1, e, u, tl.program_id(1), BLOCK)
            if COUNT > 2:
                if t == 2:
                    _copy_row(out2, full2, res2, slot2, n2, e, u, tl.program_id(1), BLOCK)
            if COUNT > 3:
                if t == 3:
                    _copy_row(out3, full3, res3, slot3, n3, e, u, tl.program_id(1), BLOCK)

    @triton.jit
    def _route_kernel(ids, order, valid, pos, pairs, experts, size, EB: tl.constexpr, PB: tl.constexpr):
        ex = tl.arange(0, EB)
        hit = tl.zeros([EB], dtype=tl.int32)
        for start in range(0, pairs, PB):  # which experts the pairs touch
            p = start + tl.arange(0, PB)
            e = tl.load(ids + p, mask=p < pairs, other=-1)
            hit = tl.maximum(hit, tl.max((e[:, None] == ex[None, :]).to(tl.int32), axis=0))
        before = tl.cumsum(hit, 0)  # hit experts up to and including each
        slot = tl.where(hit != 0, before - 1, tl.sum(hit) + ex - before)  # hit first, by number; then the rest
        keep = (ex < experts) & (slot < size)
        tl.store(order + slot, ex.to(tl.int64), mask=keep)
        tl.store(valid + slot, hit, mask=keep)
        for start in range(0, pairs, PB):  # each pair's slot
            p = start + tl.arange(0, PB)
            e = tl.load(ids + p, mask=p < pairs, other=-1)
            at = tl.sum(tl.where(e[:, None] == ex[None, :], slot[None, :], 0), axis=1)
            tl.store(pos + p, at.to(tl.int64), mask=p < pairs)


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


_PER_LAUNCH = 4  # tensors one `gather_many` launch moves (the kernel's argument sets)


def _row_numel(t: torch.Tensor) -> int:
    n = 1
    for d in t.shape[1:]:
        n *= d
    return n


def _gather_many(fulls: list[torch.Tensor], residents: list[torch.Tensor], slots: list[torch.Tensor],
                 order: torch.Tensor, valid: torch.Tensor) -> list[torch.Tensor]:
    """`_gather_rows` of each (full, resident, slot) with no lookahead, in one kernel per four tensors."""
    if not order.is_cuda or triton is None:
        return [_gather_reference(f, r, s, order, valid) for f, r, s in zip(fulls, residents, slots)]
    outs = [torch.empty((order.numel(), *f.shape[1:]), dtype=f.dtype, device=order.device) for f in fulls]
    block = 4096
    for first in range(0, len(fulls), _PER_LAUNCH):
        args, rows = [], []
        for out, full, resident, slot in list(zip(outs, fulls, residents, slots))[first:first + _PER_LAUNCH]:
            words = as_words(full)
            rows.append(_row_numel(words))
            args += [as_words(out), words, as_words(resident), slot, rows[-1]]
        count = len(rows)
        args += [None, None, None, None, 0] * (_PER_LAUNCH - count)
        _gather_many_kernel[(order.numel(), triton.cdiv(max(rows), block), count)](
            order, valid, *args, COUNT=count, BLOCK=block)
    return outs


gather_rows_many = torch.library.custom_op("offplan::gather_rows_many", _gather_many, mutates_args=())


def gather_many(fulls: list[torch.Tensor], residents: list[torch.Tensor], slots: list[torch.Tensor],
                order: torch.Tensor, valid: torch.Tensor) -> list[torch.Tensor]:
    """`gather` of several tensors of one module, where no lookahead holds any of their rows (module doc): one
    launch for up to four, the rows of each as `gather` gives them."""
    run = gather_rows_many if torch.compiler.is_compiling() else _gather_many
    return run(fulls, residents, slots, order, valid)


@gather_rows_many.register_fake
def _(fulls, residents, slots, order, valid):
    return [f.new_empty((order.shape[0], *f.shape[1:])) for f in fulls]


def _route_reference(ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    size = min(experts, ids.numel())
    hit = torch.zeros(experts, dtype=torch.int32, device=ids.device).index_fill_(0, ids, 1)
    order = torch.sort(hit, descending=True, stable=True).indices[:size]  # hit experts first, by number
    valid = hit.index_select(0, order)
    slot_of = torch.zeros(experts, dtype=torch.long, device=ids.device).index_copy_(
        0, order, torch.arange(size, device=ids.device))
    return order, valid, slot_of.index_select(0, ids)


_ROUTE_EXPERTS = 1024  # the most experts the route kernel holds in one program's registers


def route(ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A forward's slots over `experts` for its pairs' experts `ids` [P] (experts.py step 1): `order` [U] int64,
    U = min(experts, P), the experts touched first, by number, then the others as padding; `valid` [U] int32,
    1 for a touched expert's slot; `pos` [P] int64, each pair's slot. On CUDA one Triton program (module doc)
    where torch.compile is not tracing; torch's ops elsewhere, with the same values."""
    if (not ids.is_cuda or triton is None or torch.compiler.is_compiling() or experts > _ROUTE_EXPERTS
            or not ids.numel()):
        return _route_reference(ids, experts)
    pairs = ids.numel()
    size = min(experts, pairs)
    order = torch.empty(size, dtype=torch.long, device=ids.device)
    valid = torch.empty(size, dtype=torch.int32, device=ids.device)
    pos = torch.empty(pairs, dtype=torch.long, device=ids.device)
    eb = triton.next_power_of_2(experts)
    _route_kernel[(1,)](ids, order, valid, pos, pairs, experts, size, EB=eb, PB=max(1, min(64, 8192 // eb)),
                        num_warps=4 if eb <= 256 else 8)
    return order, valid, pos
