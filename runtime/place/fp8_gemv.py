"""FP8 block-scaled weights times a few rows of activations, in one kernel that reads each FP8 byte once.

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
