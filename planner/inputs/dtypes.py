"""Sizes of the safetensors dtypes, in bits per element.

Sub-byte types (F4, F6_*) are packed; safetensors requires a tensor's total
bit count to be a whole number of bytes. U8 also carries packed 4-bit blocks
(for example GPTQ/AWQ-style weights): the header's shape is then already the
packed byte shape, so its size is simply one byte per element.
"""
from __future__ import annotations

from math import prod

BITS = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}


def nbytes(dtype: str, shape: tuple[int, ...]) -> int | None:
    """Bytes taken by a tensor, or None if its bits do not fill whole bytes."""
    bits = BITS[dtype] * prod(shape)
    if bits % 8:
        return None
    return bits // 8
