"""Quantized weights times a few rows of activations, in one kernel that reads each stored byte once: FP8
block-scaled, and MXFP4 (gpt-oss's experts, one token's pairs).

A module that reads an FP8 weight dequantized (dequant.py) writes the weight
in bf16 and reads it back: 5 bytes of HBM traffic per weight element where a
bf16 model moves 2, so at decode (a few rows of activations, bound by
memory) resident FP8 ran at 0.66x bf16 on the H100. Here a Triton kernel
computes `out[m, n] = sum_k x[m, k] * w[n, k]` with each tile of `w`
dequantized in registers, exactly as dequant.py rounds it (the f32 product
`fp8 x scale of its block`, rounded once to the model's dtype), so it reads
1 byte per weight element (plus a scale per block):

- `fp8_linear(x [M, K], data [N, K], scale [ceil(N/b0), ceil(K/b1)])`: a Linear
  at decode, M <= `ROWS` (one tile of rows; `applies` says when);
- `fp8_pairs(x [P, K], data [E, N, K], scale [E, ...], ids [P] | None)`: one
  row per (token, expert) pair, row p times expert `ids[p]` (None: expert p),
  as batched_mm's arithmetic at decode of one token (experts.py): the experts'
  weights are read where they lie, in place, with no copy per pair.

Each program reduces a tile of `BN` output columns over K in steps of the
scale block (one scale per step), accumulating `tl.dot` in f32: the same
products as the dequantized weight's GEMV, summed in another order, so
outputs differ from it only by f32 summation order before the one rounding to
the model's dtype: at most 1 unit in the last place of bf16 (about 0.1% of
outputs differ at all, measured on the H100). Greedy tokens can thus differ
from the dequantized model's where two logits tie within that rounding.

Tile widths from a sweep on the H100 (BN 16/32/64, 2/4/8 warps, graph replay):
the widest tile that still gives every SM work. Measured there per call, bf16
GEMV / dequantize + GEMV / this kernel: 4096 x 2048 5.8 / 11.9 / 7.8 us;
28672 x 4096 85 / 220 / 51 us; eight Qwen3-30B-A3B experts' gate_up
(1536 x 2048 each) 119 us (batched_mm's weight copy and bmm) / 142 / 14 us.

Limits: power-of-two blocks of at least 16 rows and `BK` columns (DeepSeek-V3,
Qwen3-FP8 and Kimi-K2 use 128 x 128); CUDA with Triton. Elsewhere, and for
more rows, modules dequantize and run the model's own GEMM.

MXFP4 (`mxfp4_pairs`): a decode step of gpt-oss dequantized each touched
expert to bf16 (dequant.py: 4 bytes written a stored byte, then read back by
the GEMV), which set its pace. Here each program takes `MX_BN` output rows of
one pair and reads `MX_BB` stored bytes of each a step: both codes of a byte
as f32 values (`_e2m1_value`), times the even and odd columns of x, summed
per group of 32 in f32, then times the group's scale (a power of two: exact),
summed, and rounded once: the dequantized weight's exact products (dequant.py's
values are exact in bf16) summed in another order, so as for FP8 within one
bf16 unit of the dequantized weight's GEMV. bf16 models only (the values are
not exact in fp16), the stored layout ([E, N, G, 16], out features first)
whichever way the model holds the weight. A value past bf16's range (a scale
near 2^127, which no checkpoint uses) is inf in the dequantized weight, while
its group's sum here may stay finite. Measured on an H200
(docs/memory-peak/mxfp4_gemv_probe.py, gpt-oss-120b's 4 touched experts in
HBM): gate_up_proj 50 us against 249 dequantized then multiplied, down_proj 30
against 135 (700 and 590 GB/s of stored bytes); of nine tiles, this one (16
rows, 128 bytes, 4 warps) was within 5% of the fastest on both.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

ROWS = 16  # rows of activations one program multiplies (tl.dot's smallest tile): the largest M fp8_linear takes
BK = 128  # columns per step: one scale block (blocks narrower than this are not fused)

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch
    triton = None

if triton is not None:
    @triton.jit
    def _kernel(x, w, s, ids, out, M, N, K, s_cols, w_stride, s_stride, B0: tl.constexpr, B1: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PAIRS: tl.constexpr, IDS: tl.constexpr):
        """Program (n, g): output columns [n BN, (n + 1) BN) of row tile g (PAIRS: of pair g alone, with its
        expert's weight)."""
        g = tl.program_id(1)
        n0 = tl.program_id(0) * BN
        if PAIRS:
            e = (tl.load(ids + g) if IDS else g).to(tl.int64)
            r = g + tl.arange(0, BM)
            rmask = tl.arange(0, BM) < 1
        else:
            e = 0
            r = g * BM + tl.arange(0, BM)
            rmask = r < M
        n = n0 + tl.arange(0, BN)
        nmask = n < N
        wp = w + e * w_stride + n[:, None].to(tl.int64) * K
        sp = s + e * s_stride + (n0 // B0) * s_cols
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            kmask = k < K
            xt = tl.load(x + r[:, None].to(tl.int64) * K + k[None, :], mask=rmask[:, None] & kmask[None, :],
                         other=0.0)
            wt = tl.load(wp + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
            wt = (wt.to(tl.float32) * tl.load(sp + k0 // B1)).to(xt.dtype)  # dequant.py's rounding
            acc = tl.dot(xt, tl.trans(wt), acc)
        tl.store(out + r[:, None].to(tl.int64) * N + n[None, :], acc.to(out.dtype.element_ty),
                 mask=rmask[:, None] & nmask[None, :])


    @triton.jit
    def _e2m1_value(code):
        """E2M1 `code` (int32, 0-15) as f32: 0, 0.5, 1, 1.5, 2, 3, 4 or 6, signed. Its exponent and mantissa bits
        shifted into f32's (c << 22, rebiased by 126 << 23) give 1 to 6; 0 and 0.5 are picked out."""
        m = code & 7
        value = ((m << 22) + (126 << 23)).to(tl.float32, bitcast=True)
        value = tl.where(m < 2, m.to(tl.float32) * 0.5, value)
        return tl.where((code & 8) != 0, -value, value)

    @triton.jit
    def _mxfp4_kernel(x, blocks, scales, ids, out, N, per_row, w_stride, s_stride, BN: tl.constexpr, BB: tl.constexpr,
                      IDS: tl.constexpr):
        """Program (n, p): output columns [n BN, (n + 1) BN) of pair p, with expert `ids[p]` (IDS; else expert p)
        of `blocks` [E, N, G, 16] (two E2M1 codes a byte, low nibble first; `per_row` = 16 G) and `scales` [E, N, G].
        Each step reads BB bytes (BB / 16 groups) of each of the BN rows and the even and odd columns of x they
        multiply; each group's 32 products are summed in f32, then scaled by its 2^(s - 127), exact in f32 (a power
        of two), and summed."""
        p = tl.program_id(1)
        e = (tl.load(ids + p) if IDS else p).to(tl.int64)
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        nmask = n < N
        wp = blocks + e * w_stride + n[:, None].to(tl.int64) * per_row
        sp = scales + e * s_stride + n[:, None].to(tl.int64) * (per_row // 16)
        xp = x + p.to(tl.int64) * 2 * per_row
        acc = tl.zeros((BN,), dtype=tl.float32)
        for j0 in range(0, per_row, BB):
            j = j0 + tl.arange(0, BB)
            jmask = j < per_row
            b = tl.load(wp + j[None, :], mask=nmask[:, None] & jmask[None, :], other=0).to(tl.int32)
            xe = tl.load(xp + 2 * j, mask=jmask, other=0.0).to(tl.float32)
            xo = tl.load(xp + 2 * j + 1, mask=jmask, other=0.0).to(tl.float32)
            part = _e2m1_value(b & 15) * xe[None, :] + _e2m1_value(b >> 4) * xo[None, :]  # [BN, BB]
            part = tl.sum(tl.reshape(part, (BN, BB // 16, 16)), axis=2)  # [BN, BB / 16]: a group's 32 products
            g = j0 // 16 + tl.arange(0, BB // 16)
            s = tl.load(sp + g[None, :], mask=nmask[:, None] & (g[None, :] < per_row // 16), other=127).to(tl.int32)
            factor = (tl.maximum(s, 1) << 23).to(tl.float32, bitcast=True)  # 2^(s - 127); E8M0's 0 is 2^-127:
            part = tl.where(s == 0, part * 0.5, part) * factor  # a subnormal, so halved apart; 255 is NaN
            acc += tl.sum(tl.where(s == 255, float("nan"), part), axis=1)
        tl.store(out + p.to(tl.int64) * N + n, acc.to(out.dtype.element_ty), mask=nmask)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def applies(x: torch.Tensor, data: torch.Tensor, block: tuple[int, int], rows: int) -> bool:
    """Whether `rows` rows of `x` times FP8 `data` with scale blocks `block` run this kernel (module doc)."""
    b0, b1 = block
    return (triton is not None and x.is_cuda and data.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
            and x.dtype in (torch.bfloat16, torch.float16) and 1 <= rows <= ROWS and _power_of_two(b0)
            and _power_of_two(b1) and b0 >= 16 and b1 >= BK and _rows_contiguous(data))


def _rows_contiguous(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and t.stride(-2) == t.shape[-1]


def _tile(n: int, programs_per_column: int) -> tuple[int, int]:
    """(BN, warps): the widest tile giving two waves of programs on an H100's 132 SMs, else one, else 16."""
    for bn, enough in ((64, 264), (32, 128)):
        if -(-n // bn) * programs_per_column >= enough:
            return bn, 2 if bn == 64 else 4
    return 16, 4


def _launch(x, data, scale, ids, out, rows: int, groups: int, b0: int, b1: int, pairs: bool) -> torch.Tensor:
    n, k = data.shape[-2:]
    bn, warps = _tile(n, groups)
    bn = min(bn, b0)
    if pairs:
        warps = 2
    _kernel[(triton.cdiv(n, bn), groups)](
        x, data, scale, x if ids is None else ids, out, rows, n, k, scale.shape[-1],
        data.stride(0) if pairs else 0, scale.stride(0) if pairs else 0, B0=b0, B1=b1, BM=ROWS, BN=bn, BK=BK,
        PAIRS=pairs, IDS=ids is not None, num_warps=warps)
    return out


def _fp8_linear(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, b0: int, b1: int) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty(x.shape[0], data.shape[0], dtype=x.dtype, device=x.device)
    return _launch(x, data, scale, None, out, x.shape[0], triton.cdiv(x.shape[0], ROWS), b0, b1, False)


def _fp8_pairs(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor | None, b0: int,
               b1: int) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty(x.shape[0], data.shape[-2], dtype=x.dtype, device=x.device)
    return _launch(x, data, scale, ids, out, x.shape[0], x.shape[0], b0, b1, True)


fp8_linear_op = torch.library.custom_op("offplan::fp8_linear", _fp8_linear, mutates_args=())
fp8_pairs_op = torch.library.custom_op("offplan::fp8_pairs", _fp8_pairs, mutates_args=())


@fp8_linear_op.register_fake
def _(x, data, scale, b0, b1):
    return x.new_empty(x.shape[0], data.shape[0])


@fp8_pairs_op.register_fake
def _(x, data, scale, ids, b0, b1):
    return x.new_empty(x.shape[0], data.shape[-2])


def fp8_linear(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """x [M, K] (M <= ROWS) times FP8 `data` [N, K] -> [M, N] (`applies` must hold). An opaque custom op where
    torch.compile traces the call, the function itself elsewhere (its dispatcher costs ~35 us of CPU a call)."""
    run = fp8_linear_op if torch.compiler.is_compiling() else _fp8_linear
    return run(x, data, scale, *block)


def fp8_pairs(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor | None,
              block: tuple[int, int]) -> torch.Tensor:
    """x [P, K], row p times expert `ids[p]` of FP8 `data` [E, N, K] (None: expert p) -> [P, N]."""
    run = fp8_pairs_op if torch.compiler.is_compiling() else _fp8_pairs
    return run(x, data, scale, ids, *block)


@dataclass(frozen=True)
class Fp8Rows:
    """An FP8 parameter's experts for the pairs of one token, as `fp8_pairs` reads them where they lie (the
    experts' forward, runtime/execute/experts.py): expert `ids[p]` of `data` and `scale` for pair p (None:
    expert p, the rows gathered in pair order)."""

    data: torch.Tensor
    scale: torch.Tensor
    ids: torch.Tensor | None
    block: tuple[int, int]


MX_BN, MX_BB = 16, 128  # `_mxfp4_kernel`'s rows and bytes a step


def mxfp4_applies(x: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether one token's pairs `x` times MXFP4 `blocks` run `mxfp4_pairs`: CUDA with Triton, a bf16 model (each
    value exact in bf16, as dequant.py's), bytes laid out as stored."""
    return (triton is not None and x.is_cuda and x.dtype == dtype == torch.bfloat16
            and blocks.dtype == torch.uint8 and blocks.stride(-1) == 1 and blocks.stride(-2) == 16
            and blocks.stride(-3) == 16 * blocks.shape[-2])


def _mxfp4_pairs(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
                 ids: torch.Tensor | None) -> torch.Tensor:
    x, scales = x.contiguous(), scales.contiguous()
    n, g = blocks.shape[-3:-1]
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    _mxfp4_kernel[(triton.cdiv(n, MX_BN), x.shape[0])](
        x, blocks, scales, x if ids is None else ids, out, n, 16 * g, blocks.stride(0), scales.stride(0), BN=MX_BN,
        BB=MX_BB, IDS=ids is not None, num_warps=4)
    return out


mxfp4_pairs_op = torch.library.custom_op("offplan::mxfp4_pairs", _mxfp4_pairs, mutates_args=())


@mxfp4_pairs_op.register_fake
def _(x, blocks, scales, ids):
    return x.new_empty(x.shape[0], blocks.shape[-3])


def mxfp4_pairs(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
    """x [P, 32 G], row p times expert `ids[p]` of MXFP4 `blocks` [E, N, G, 16] with `scales` [E, N, G] (None:
    expert p) -> [P, N], as stored (out features first), whichever way the model holds the dequantized weight."""
    run = mxfp4_pairs_op if torch.compiler.is_compiling() else _mxfp4_pairs
    return run(x, blocks, scales, ids)


@dataclass(frozen=True)
class Mxfp4Rows:
    """An MXFP4 parameter's experts for the pairs of one token, as `mxfp4_pairs` reads them where they lie (as
    `Fp8Rows`)."""

    data: torch.Tensor
    scale: torch.Tensor
    ids: torch.Tensor | None
