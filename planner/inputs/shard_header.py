"""One safetensors shard's header: read, typed and checked (checkpoint.py reads every shard's through here).

A shard is `u64 little-endian header length` + `header JSON` + data; only the
first two are read. Each entry must have a known dtype, a shape of
non-negative integers, and data_offsets [begin, end) holding exactly
dtype x shape bytes inside the file, no two overlapping. Every problem is
collected, one line naming the shard and tensor, for the caller to raise once.
"""
from __future__ import annotations

import os
from math import prod
from pathlib import Path
from typing import NamedTuple

from .dtypes import BITS, nbytes

try:  # orjson, a dependency: DeepSeek-V3's index and 163 headers (21 MB) in 97 ms, where json takes 156 (2-CPU VM)
    from orjson import loads
except ImportError:  # installed without its dependencies (the GPU machine's stack): the same values, slower
    from json import loads

_MAX_HEADER = 100 * 2**20  # safetensors' own limit


class TensorInfo(NamedTuple):
    """One tensor of the checkpoint (a NamedTuple: 90k of them are built per plan)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    shard: str  # file name relative to the checkpoint directory
    offset: int  # absolute byte offset of the data in the shard file



def read_header(file: Path, problems: list[str]) -> tuple[bytes, int, dict] | None:
    """Read one shard's header: (header bytes, file size, parsed JSON), or None on error."""
    got = read_raw(file, problems)
    if got is None:
        return None
    raw, size = got
    try:
        header = loads(raw)
    except ValueError as e:
        problems.append(f"{file.name}: header is not valid JSON: {e}")
        return None
    if not isinstance(header, dict):
        problems.append(f"{file.name}: header is not a JSON object")
        return None
    return raw, size, header


def read_raw(file: Path, problems: list[str]) -> tuple[bytes, int] | None:
    """One shard's header bytes, unparsed, and the file's size; None on error (`problems` says why)."""
    try:
        with open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                problems.append(f"{file.name}: file is {size} bytes, too short for a safetensors header")
                return None
            n = int.from_bytes(head, "little")
            if n > size - 8:
                problems.append(
                    f"{file.name}: header length {n} exceeds the file size {size} "
                    "(truncated or not a safetensors file)"
                )
                return None
            if n > _MAX_HEADER:
                problems.append(f"{file.name}: header length {n} exceeds safetensors' limit of "
                                f"{_MAX_HEADER} bytes (not a safetensors file?)")
                return None
            raw = f.read(n)
    except OSError as e:
        problems.append(f"{file.name}: cannot read: {e.strerror}")
        return None
    return raw, size


def parse_tensors(shard: str, header: dict, header_len: int, size: int, problems: list[str],
                  known: dict[tuple, tuple] | None = None, rejected: set[str] | None = None) -> dict[str, TensorInfo]:
    """Type and check every entry of one header.

    The common case (a well-formed entry) runs in a handful of operations per
    tensor: sizes are computed once per (dtype, shape), which repeat across
    layers, and overlaps are looked for only when a tensor starts before the
    end of one listed earlier (writers list them in file order, so none
    overlap). Anything unusual falls through to `_entry_problem` for the
    message, and out-of-order spans to `_overlaps`.

    A bad entry is left out, its name added to `rejected` (where given), so the caller does not report it
    again as missing. Tensors of one (dtype, shape) share one dtype, shape and size object
    (`known`, across the shards of a checkpoint): DeepSeek-V3's 92k tensors
    have a few hundred, and every later pass over the tensors reads, and the
    end of a plan frees, a few objects instead of 92k of each.
    """
    data_len = size - 8 - header_len
    base = 8 + header_len
    out: dict[str, TensorInfo] = {}
    known = {} if known is None else known
    make = tuple.__new__  # TensorInfo(...) without the Python frame of its __new__
    reach, ordered = 0, True  # the furthest end so far; whether every tensor starts at or past it
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            key = (entry["dtype"], tuple(entry["shape"]))
            got = known.get(key)  # one hash of the key (a tuple's is not kept)
            if got is None:
                got = known[key] = (*key, _size(*key))
            dtype, shape, want = got
            begin, end = entry["data_offsets"]
            ok = (want is not None and type(begin) is int and type(end) is int
                  and 0 <= begin and end - begin == want and end <= data_len)
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            problems.append(_entry_problem(f"{shard}: tensor {name}", entry, data_len))
            if rejected is not None:
                rejected.add(name)
            continue
        if begin >= reach:
            reach = end
        else:
            ordered = False
        out[name] = make(TensorInfo, (name, dtype, shape, want, shard, base + begin))
    if not ordered:
        _overlaps(shard, out, base, problems)
    return out


def _size(dtype: str, shape: tuple) -> int | None:
    """Bytes of a well-formed (dtype, shape), else None; raises for what is not even that."""
    want, rem = divmod(BITS[dtype] * prod(shape), 8)
    return want if not rem and type(want) is int and (not shape or min(shape) >= 0) else None


def _overlaps(shard: str, tensors: dict[str, TensorInfo], base: int, problems: list[str]) -> None:
    """One problem per tensor whose bytes overlap another's.

    Compare each span with the one reaching furthest so far: a long tensor
    that swallows several later ones is reported against each of them.
    """
    spans = sorted((t.offset - base, t.offset - base + t.nbytes, t.name) for t in tensors.values())
    if spans:
        b0, e0, n0 = spans[0]
        for b1, e1, n1 in spans[1:]:
            if b1 < e0 and b1 < e1:  # an empty tensor occupies no bytes
                problems.append(f"{shard}: tensors {n0} [{b0}, {e0}) and {n1} [{b1}, {e1}) overlap")
            if e1 > e0:
                b0, e0, n0 = b1, e1, n1


def _entry_problem(where: str, entry, data_len: int) -> str:
    """The message for a header entry that failed the fast checks."""
    try:
        dtype = entry["dtype"]
        shape = list(entry["shape"])
        begin, end = entry["data_offsets"]
    except (TypeError, KeyError, ValueError):
        return f"{where}: expected {{dtype, shape, data_offsets: [begin, end]}}"
    if dtype not in BITS:
        return f"{where}: unknown dtype {dtype!r} (known: {', '.join(BITS)})"
    if not all(type(d) is int and d >= 0 for d in shape):
        return f"{where}: shape {shape} must be non-negative integers"
    if not (type(begin) is int and type(end) is int and 0 <= begin <= end):
        return f"{where}: data_offsets [{begin}, {end}] must be integers 0 <= begin <= end"
    want = nbytes(dtype, tuple(shape))
    if want is None:
        return f"{where}: {dtype} x {shape} is not a whole number of bytes"
    if end - begin != want:
        return f"{where}: data_offsets [{begin}, {end}] hold {end - begin} bytes but {dtype} x {shape} needs {want}"
    return f"{where}: data_offsets end {end} lies past the data region ({data_len} bytes; file truncated?)"
