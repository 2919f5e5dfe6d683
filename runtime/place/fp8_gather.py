"""A forward's FP8 expert rows gathered and dequantized in one launch (experts.py, step 2, at more than one token).

An FP8 experts parameter that gemv.py does not multiply in place (more
than one token, or a transposed layout) was staged in three steps: its data
and its scales gathered (gather.py, one launch), then each parameter
dequantized (dequant.py, one launch each). An eager decode step is bound by
the host CPU's launches, and on the H100 machine's host a Triton launch costs
80-130 us of CPU (docs/front-door/). A parameter all in HBM (resident FP8
weights) was gathered by `index_select` of every slot, padding included: at
batch 8 of Qwen3-30B-A3B's shape, 64 experts copied a layer for the 8 that
8 copies of one prompt touch, and resident FP8 decoded at 0.54x bf16 (H100,
graph replay, 206 against 384 steps/s).

Here one kernel does all three for up to two parameters (gate_up_proj and
down_proj): program (u, t, p) reads tile t of slot u's matrix of parameter p,
from its resident rows in HBM where `slot` has the expert, else in place
(through the pinned parameter's zero-copy view, or in HBM), with the tile's
one scale read the same way, and writes it dequantized. The arithmetic is
dequant.py's: the f32 product of the FP8 value and its block's scale, rounded
once to the model's dtype, so the rows equal gather-then-dequantize bitwise.
Padding slots (`valid` 0) read nothing and are left unset, as both steps left
them.

Limits: power-of-two blocks (as dequant.py's kernel), the parameters of one
launch with one block; CUDA with Triton (`applies`). Elsewhere experts.py
gathers and dequantizes in turn, as before.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional  # torch.library's schema reads Optional, not `X | None`

import torch

from .dequant import power_of_two

PER_LAUNCH = 2  # parameters one launch moves: an experts module's gate_up_proj (or up_proj) and down_proj

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch
    triton = None

if triton is not None:
    @triton.jit
    def _tile(out, full, resident, slot, sfull, sresident, sslot, rows, cols, srows, scols, e, u, t,
              B0: tl.constexpr, B1: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, SLOTS: tl.constexpr):
        """Tile t (BR x BC, inside one scale block) of expert e's matrix, dequantized into slot u of `out`.
        SLOTS: some experts have resident rows (else every one is read from `full`, `sfull`)."""
        ctiles = tl.cdiv(cols, BC)
        r0, c0 = (t // ctiles) * BR, (t % ctiles) * BC
        if r0 < rows:
            base = full + e * rows * cols
            sbase = sfull + e * srows * scols
            if SLOTS:
                s = tl.load(slot + e).to(tl.int64)
                if s >= 0:
                    base = resident + s * rows * cols
                s = tl.load(sslot + e).to(tl.int64)
                if s >= 0:
                    sbase = sresident + s * srows * scols
            scale = tl.load(sbase + (r0 // B0) * scols + c0 // B1)
            r, c = r0 + tl.arange(0, BR), c0 + tl.arange(0, BC)
            mask = (r[:, None] < rows) & (c[None, :] < cols)
            offs = r[:, None].to(tl.int64) * cols + c[None, :]
            x = tl.load(base + offs, mask=mask).to(tl.float32)
            tl.store(out + u * rows * cols + offs, (x * scale).to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def _kernel(order, valid, out0, full0, res0, slot0, sfull0, sres0, sslot0, rows0, cols0, srows0, scols0,
                out1, full1, res1, slot1, sfull1, sres1, sslot1, rows1, cols1, srows1, scols1,
                COUNT: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                SLOTS: tl.constexpr):
        u = tl.program_id(0).to(tl.int64)
        if tl.load(valid + u) != 0:
            e = tl.load(order + u).to(tl.int64)
            t, p = tl.program_id(1), tl.program_id(2)
            if p == 0:
                _tile(out0, full0, res0, slot0, sfull0, sres0, sslot0, rows0, cols0, srows0, scols0, e, u, t,
                      B0, B1, BR, BC, SLOTS)
            if COUNT > 1:
                if p == 1:
                    _tile(out1, full1, res1, slot1, sfull1, sres1, sslot1, rows1, cols1, srows1, scols1, e, u,
                          t, B0, B1, BR, BC, SLOTS)


def applies(data: torch.Tensor, block: tuple[int, int]) -> bool:
    """Whether FP8 `data` [E, R, C] with scale blocks `block` runs the one-launch kernel (module doc)."""
    return (triton is not None and data.is_cuda and data.dim() == 3 and power_of_two(block[0])
            and power_of_two(block[1]))


def _gather_dequant(datas: list[torch.Tensor], residents: list[Optional[torch.Tensor]],
                    slots: list[Optional[torch.Tensor]], scales: list[torch.Tensor],
                    scale_residents: list[Optional[torch.Tensor]], scale_slots: list[Optional[torch.Tensor]],
                    order: torch.Tensor, valid: torch.Tensor, b0: int, b1: int,
                    dtype: torch.dtype) -> list[torch.Tensor]:
    outs = [torch.empty((order.numel(), *d.shape[1:]), dtype=dtype, device=order.device) for d in datas]
    br, bc = min(32, b0), min(128, b1)
    sets = list(zip(outs, datas, residents, slots, scales, scale_residents, scale_slots))
    for first in range(0, len(sets), PER_LAUNCH):
        args, tiles = [], []
        for out, data, resident, slot, scale, scale_resident, scale_slot in sets[first:first + PER_LAUNCH]:
            rows, cols = data.shape[-2:]
            tiles.append(triton.cdiv(rows, br) * triton.cdiv(cols, bc))
            args += [out, data, resident, slot, scale, scale_resident, scale_slot, rows, cols, *scale.shape[-2:]]
        count = len(tiles)
        args += ([None] * 7 + [0] * 4) * (PER_LAUNCH - count)
        _kernel[(order.numel(), max(tiles), count)](order, valid, *args, COUNT=count, B0=b0, B1=b1, BR=br, BC=bc,
                                                    SLOTS=slots[0] is not None)
    return outs


gather_dequant_op = torch.library.custom_op("offplan::gather_dequant_fp8", _gather_dequant, mutates_args=())


@gather_dequant_op.register_fake
def _(datas, residents, slots, scales, scale_residents, scale_slots, order, valid, b0, b1, dtype):
    return [d.new_empty((order.shape[0], *d.shape[1:]), dtype=dtype) for d in datas]


@dataclass(frozen=True)
class Source:
    """Where an FP8 parameter's experts lie: `data` [E, R, C] and `scale` [E, ceil(R/b0), ceil(C/b1)] (the whole
    parameter, in place: pinned, or in HBM), each with its resident rows and `[E]` slots (`>= 0`: the expert's row
    among them); the rows and slots None for a parameter whose experts are all in `data` and `scale`."""

    data: torch.Tensor
    resident: torch.Tensor | None
    slot: torch.Tensor | None
    scale: torch.Tensor
    scale_resident: torch.Tensor | None
    scale_slot: torch.Tensor | None
    block: tuple[int, int]
    dtype: torch.dtype


def gather_dequant(sources: dict[str, Source], order: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each parameter's rows for the slots `order` [U], dequantized to its dtype, from its resident rows where its
    slot has the expert, else in place; slots whose `valid` is 0 left unset (module doc). One launch for up to
    `PER_LAUNCH` parameters of one block and dtype, with slots or without. The op where torch.compile traces the
    call, the function itself elsewhere (the dispatcher's CPU time)."""
    run = gather_dequant_op if torch.compiler.is_compiling() else _gather_dequant
    out = {}
    for block, dtype, slots in {(s.block, s.dtype, s.slot is not None) for s in sources.values()}:
        names = [n for n, s in sources.items()
                 if (s.block, s.dtype, s.slot is not None) == (block, dtype, slots)]
        group = [sources[n] for n in names]  # as lists, not through dataclasses.fields: torch.compile breaks there
        out |= zip(names, run([s.data for s in group], [s.resident for s in group], [s.slot for s in group],
                              [s.scale for s in group], [s.scale_resident for s in group],
                              [s.scale_slot for s in group], order, valid, *block, dtype))
    return out
