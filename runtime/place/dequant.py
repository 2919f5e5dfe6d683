"""Dequantization arithmetic (FP8 block-scaled, MXFP4), and modules that read their quantized tensors dequantized.

The formats and why they stay quantized: quant.py. Here:

- `dequantize(q, data, scale, valid)`: the tensor the model reads, in its dtype.
  FP8: `(fp8 -> f32) x scale of its block`, rounded once. MXFP4: the E2M1
  value (sign, 2 exponent bits, 1 mantissa bit) x 2^(s - 127), exact in bf16.
  On CUDA, FP8 runs one Triton kernel (`offplan::dequant_fp8`), which reads a
  uva weight through its zero-copy view once; elsewhere torch arithmetic. Both
  compute the same f32 product and round it once, so they agree bitwise, with
  each other and with a checkpoint dequantized on the host. MXFP4 in bf16 on
  CUDA runs one kernel too (`offplan::dequant_mxfp4`), building each value's
  bits from integers, bitwise the torch arithmetic's, with no temporaries.
  No tensor is made from host data on the way (a CUDA graph capture forbids it).
  `valid` [M] (0 or 1 per matrix of a stack) leaves matrices out on CUDA: a
  gathered stack's padding slots (experts.py), whose rows nothing reads. At
  batch 8 of Qwen3-30B-A3B's shape a layer stages 64 slots for the 8 experts its
  tokens touch, so the kernel's work falls 8x; the skipped matrices' values are
  unset.
- `bind(found)`: each module holding quantized tensors gets a class property
  per dequantized name (the module's class swapped for a cached subclass, as
  prefill.py does), so `linear.weight` is computed on access and the stored
  tensors stay registered under their own names. `unbind` restores the class
  and puts a plain tensor back under the name. A Linear with an FP8 weight
  also gets the subclass's `forward`: at decode (a few rows, on CUDA) one
  kernel reads the FP8 weight and computes the product (gemv.py: 1 byte per
  element read, where dequantizing first moves 5); otherwise the Linear's own
  forward, over the dequantized weight.
"""
from __future__ import annotations

import functools

import torch

from . import gemv
from .quant import Quant


def dequantize(q: Quant, data: torch.Tensor, scale: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """`data` [..., R, C] F8 with `scale` [..., ceil(R/b0), ceil(C/b1)] F32 (FP8), or `data` [..., R, G, 16]
    U8 with `scale` [..., R, G] U8 (MXFP4) -> the model's tensor (MXFP4 transposed if the model holds it so).
    `valid` [M] int32 for a stack of M matrices: those with 0 may be left unset (module doc)."""
    if q.format == "fp8":
        return dequant_fp8(data, scale, q.block[0], q.block[1], q.dtype, valid)
    return dequant_mxfp4(data, scale, q.dtype, q.transposed)


def _fp8_reference(data: torch.Tensor, scale: torch.Tensor, b0: int, b1: int, dtype: torch.dtype) -> torch.Tensor:
    rows, cols = data.shape[-2:]
    s = scale.repeat_interleave(b0, dim=-2)[..., :rows, :].repeat_interleave(b1, dim=-1)[..., :cols]
    return (data.to(torch.float32) * s).to(dtype)


def _mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., R, G, 16] bytes (low nibble first) and [..., R, G] E8M0 scales -> [..., R, 32 G]."""
    nibbles = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).to(torch.int32)  # [..., R, G, 16, 2]
    exponent, mantissa = (nibbles >> 1) & 3, (nibbles & 1).to(torch.float32)
    magnitude = torch.where(exponent == 0, 0.5 * mantissa,
                            torch.exp2((exponent - 1).to(torch.float32)) * (1 + 0.5 * mantissa))
    value = torch.where((nibbles & 8) != 0, -magnitude, magnitude)  # -0.0 for the code 0b1000, as E2M1 says
    value = value.flatten(-2) * torch.exp2(scales.to(torch.float32) - 127).unsqueeze(-1)
    return value.flatten(-2).to(dtype)


try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch
    triton = None

if triton is not None:
    @triton.jit
    def _fp8_kernel(out, data, scale, valid, rows, cols, scale_rows, scale_cols, B0: tl.constexpr,
                    B1: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, SKIP: tl.constexpr):
        """One BR x BC tile of matrix m: inside one scale block (BR divides B0, BC divides B1), so one scale.
        SKIP: matrices whose `valid` is 0 are left unset."""
        m = tl.program_id(0).to(tl.int64)
        if SKIP:
            if tl.load(valid + m) == 0:
                return
        r0, c0 = tl.program_id(1) * BR, tl.program_id(2) * BC
        r, c = r0 + tl.arange(0, BR), c0 + tl.arange(0, BC)
        mask = (r[:, None] < rows) & (c[None, :] < cols)
        offs = m * rows * cols + r[:, None].to(tl.int64) * cols + c[None, :]
        s = tl.load(scale + m * scale_rows * scale_cols + (r0 // B0) * scale_cols + c0 // B1)
        x = tl.load(data + offs, mask=mask).to(tl.float32)
        tl.store(out + offs, (x * s).to(out.dtype.element_ty), mask=mask)


    @triton.jit
    def _e2m1_bits(code, s):
        """The bf16 bits of E2M1 `code` (int32, 0-15) x 2^(s - 127), built from integers: the value is exact in
        bf16 (a subnormal below 2^-126), so nothing rounds and nothing is flushed; +-inf past bf16's range, NaN
        where s is 255 (E8M0's NaN)."""
        e, m = (code >> 1) & 3, code & 1
        frac = tl.where(e == 0, 0, m)  # 1.5 = 1.1b: the mantissa's top bit; 0.5 (e 0, m 1) is 2^-1 x 1.0
        biased = s + tl.where(e == 0, -1, e - 1)  # the bf16 exponent field of 2^(s - 127 + its exponent)
        normal = (biased << 7) | (frac << 6)
        subnormal = (2 + frac) << tl.maximum(biased + 5, 0)  # 2^(biased - 127) (1 + frac / 2) in units of 2^-133
        bits = tl.where(biased >= 255, 0x7F80, tl.where(biased <= 0, subnormal, normal))
        bits = tl.where((e == 0) & (m == 0), 0, bits) | ((code & 8) << 12)
        return tl.where(s == 255, 0x7FC0, bits)

    @triton.jit
    def _mxfp4_flat_kernel(out, blocks, scales, n, rows, per_row, stride_m, stride_r, stride_c, BLOCK: tl.constexpr):
        """BLOCK stored bytes of [M, R, G, 16] (two codes each, low nibble first; `per_row` = 16 G bytes a row),
        each to its two values at columns c, c + 1 of row r of matrix m, through `out`'s strides (int16 bits).
        For an output as stored: consecutive bytes go to consecutive pairs of values."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        b = tl.load(blocks + i, mask=mask, other=0).to(tl.int32)
        s = tl.load(scales + i // 16, mask=mask, other=127).to(tl.int32)
        row, c = i // per_row, (i % per_row) * 2
        at = (row // rows) * stride_m + (row % rows) * stride_r + c * stride_c
        tl.store(out + at, _e2m1_bits(b & 15, s).to(tl.int16), mask=mask)
        tl.store(out + at + stride_c, _e2m1_bits(b >> 4, s).to(tl.int16), mask=mask)

    @triton.jit
    def _mxfp4_tiled_kernel(out, blocks, scales, rows, per_row, stride_m, stride_r, stride_c, BR: tl.constexpr,
                            BB: tl.constexpr):
        """A tile of BR rows x BB stored bytes of matrix m of [M, R, G, 16] (two codes a byte, low nibble first;
        `per_row` = 16 G bytes a row), each byte to its two values at columns 2j, 2j + 1, through `out`'s strides
        (int16 bits). Loaded along the bytes; Triton lays each store out along whichever of r and c `out` holds
        contiguous, so a transposed output is written in whole lines too: there 4.1-4.6x as fast as the flat kernel,
        but 4.1-4.3x slower on an output as stored, which keeps the flat one (docs/memory-peak/README.md)."""
        m = tl.program_id(0).to(tl.int64)
        r = tl.program_id(1) * BR + tl.arange(0, BR)
        j = tl.program_id(2) * BB + tl.arange(0, BB)
        mask = (r[:, None] < rows) & (j[None, :] < per_row)
        byte = (m * rows + r[:, None].to(tl.int64)) * per_row + j[None, :]
        b = tl.load(blocks + byte, mask=mask, other=0).to(tl.int32)
        s = tl.load(scales + byte // 16, mask=mask, other=127).to(tl.int32)
        at = m * stride_m + r[:, None].to(tl.int64) * stride_r + (2 * j[None, :]).to(tl.int64) * stride_c
        tl.store(out + at, _e2m1_bits(b & 15, s).to(tl.int16), mask=mask)
        tl.store(out + at + stride_c, _e2m1_bits(b >> 4, s).to(tl.int16), mask=mask)


def _dequant_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, transposed: bool) -> torch.Tensor:
    """[..., R, G, 16] bytes and [..., R, G] E8M0 scales -> [..., R, 32 G] in `dtype`, or its transpose made
    contiguous. On CUDA in bf16, one kernel writes the values where they go (the output, 4 bytes a stored byte, its
    only allocation, as decide/working.py counts it); elsewhere torch arithmetic (`_mxfp4`), whose temporaries
    peaked at 58 bytes a stored byte on CUDA (docs/memory-peak). Bitwise the same for every scale below 255."""
    if not blocks.is_cuda or triton is None or dtype != torch.bfloat16:
        out = _mxfp4(blocks, scales, dtype)
        return out.transpose(-2, -1).contiguous() if transposed else out
    rows, groups, _ = blocks.shape[-3:]
    cols = 32 * groups
    out = torch.empty(_mxfp4_shape(blocks, transposed), dtype=dtype, device=blocks.device)
    n = blocks.numel()
    if n and transposed:  # tiles, so that the stores run along the output's rows
        grid = (n // (rows * groups * 16), triton.cdiv(rows, 64), triton.cdiv(16 * groups, 64))
        _mxfp4_tiled_kernel[grid](out.view(torch.int16), blocks.contiguous(), scales.contiguous(), rows,
                                  16 * groups, rows * cols, 1, rows, BR=64, BB=64)
    elif n:  # as stored: byte i's values land at 2i and 2i + 1
        _mxfp4_flat_kernel[(triton.cdiv(n, 1024),)](out.view(torch.int16), blocks.contiguous(), scales.contiguous(),
                                                    n, rows, 16 * groups, rows * cols, cols, 1, BLOCK=1024)
    return out


def _mxfp4_shape(blocks: torch.Tensor, transposed: bool) -> tuple[int, ...]:
    *lead, rows, groups, _ = blocks.shape
    return (*lead, *((32 * groups, rows) if transposed else (rows, 32 * groups)))


dequant_mxfp4_op = torch.library.custom_op("offplan::dequant_mxfp4", _dequant_mxfp4, mutates_args=())


def dequant_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, transposed: bool) -> torch.Tensor:
    """`_dequant_mxfp4`: an opaque custom op where torch.compile traces the call, the function itself elsewhere
    (the dispatcher's CPU time), as `dequant_fp8`."""
    run = dequant_mxfp4_op if torch.compiler.is_compiling() else _dequant_mxfp4
    return run(blocks, scales, dtype, transposed)


@dequant_mxfp4_op.register_fake
def _(blocks, scales, dtype, transposed):
    return blocks.new_empty(_mxfp4_shape(blocks, transposed), dtype=dtype)


def power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _dequant_fp8(data: torch.Tensor, scale: torch.Tensor, b0: int, b1: int, dtype: torch.dtype,
                 valid: torch.Tensor | None = None) -> torch.Tensor:
    if not data.is_cuda or triton is None or not (power_of_two(b0) and power_of_two(b1)):
        return _fp8_reference(data, scale, b0, b1, dtype)
    return _launch_fp8(torch.empty(data.shape, dtype=dtype, device=scale.device), data, scale, b0, b1, valid)


def _launch_fp8(out: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, b0: int, b1: int,
                valid: torch.Tensor | None) -> torch.Tensor:
    """The kernel over every tile of `data`'s matrices into `out` (the skipped matrices' left as they were)."""
    rows, cols = data.shape[-2:]
    matrices = data.numel() // max(1, rows * cols)
    br, bc = min(32, b0), min(128, b1)
    _fp8_kernel[(matrices, triton.cdiv(rows, br), triton.cdiv(cols, bc))](
        out, data, scale, scale if valid is None else valid, rows, cols, scale.shape[-2], scale.shape[-1],
        B0=b0, B1=b1, BR=br, BC=bc, SKIP=valid is not None)
    return out


dequant_fp8_op = torch.library.custom_op("offplan::dequant_fp8", _dequant_fp8, mutates_args=())


def dequant_fp8(data: torch.Tensor, scale: torch.Tensor, b0: int, b1: int, dtype: torch.dtype,
                valid: torch.Tensor | None = None) -> torch.Tensor:
    """FP8 `data` [..., R, C] times its block's `scale` [..., ceil(R/b0), ceil(C/b1)], in `dtype` (module doc).
    On CUDA with power-of-two blocks, tiles of 32 x 128 (at most a block) each read one scale, and the matrices
    whose `valid` [M] is 0 are skipped. An opaque custom op where torch.compile traces the call, the function
    itself elsewhere (the dispatcher's CPU time)."""
    run = dequant_fp8_op if torch.compiler.is_compiling() else _dequant_fp8
    return run(data, scale, b0, b1, dtype, valid)


@dequant_fp8_op.register_fake
def _(data, scale, b0, b1, dtype, valid=None):
    return torch.empty(data.shape, dtype=dtype, device=scale.device)


# ---------------------------------------------------------------- modules reading dequantized tensors

def stored(module: torch.nn.Module, name: str) -> torch.Tensor:
    """A stored tensor of `module` by its registered name, past any class property of that name."""
    t = module._parameters.get(name)
    return t if t is not None else module._buffers[name]


def _dequantized_property(attr: str) -> property:
    def get(self):
        q = self._offplan_quant[attr]
        return dequantize(q, stored(self, q.data), stored(self, q.scale))
    return property(get)


def _fp8_linear_forward(base: type):
    """The forward of a `base` Linear over an FP8 weight: fused at decode (gemv.py), `base`'s otherwise."""
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self._offplan_quant["weight"]
        data = stored(self, q.data)
        rows = x.numel() // x.shape[-1]
        if q.format != "fp8" or not gemv.applies(x, data, q.block, rows):
            return base.forward(self, x)
        out = gemv.fp8_linear(x.reshape(rows, x.shape[-1]), data, stored(self, q.scale), q.block)
        out = out.view(*x.shape[:-1], out.shape[-1])
        return out if self.bias is None else out + self.bias
    return forward


@functools.cache
def _quantized_class(cls: type, attrs: frozenset[str]) -> type:
    body = {a: _dequantized_property(a) for a in sorted(attrs)}
    if issubclass(cls, torch.nn.Linear) and "weight" in attrs:
        body["forward"] = _fp8_linear_forward(cls)
    return type(f"Dequantized{cls.__name__}", (cls,), body)


def bind(found: dict[torch.nn.Module, dict[str, Quant]]) -> None:
    """Each module reads its quantized tensors dequantized, by name (module doc)."""
    for module, quants in found.items():
        module._offplan_quant = dict(quants)
        module.__class__ = _quantized_class(type(module), frozenset(quants))


def quantized(module: torch.nn.Module) -> dict[str, Quant]:
    """{attr: Quant} of a bound module ({} for any other)."""
    return getattr(module, "_offplan_quant", {})


def unbind(module: torch.nn.Module, q: Quant, value: torch.Tensor) -> None:
    """`q.attr` is a plain parameter holding `value` again and the stored tensors go; the class is
    restored once the module's last quantized name is unbound. Also for a module never bound."""
    for name in (q.data, q.scale):
        module._parameters.pop(name, None)
        module._buffers.pop(name, None)
    quants = getattr(module, "_offplan_quant", None)
    if quants is not None:
        quants.pop(q.attr, None)
        base = module.__class__.__mro__[1]
        module.__class__ = _quantized_class(base, frozenset(quants)) if quants else base
        if not quants:
            del module._offplan_quant
    module.register_parameter(q.attr, torch.nn.Parameter(value, requires_grad=False))
