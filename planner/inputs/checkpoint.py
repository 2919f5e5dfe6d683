"""Read a safetensors checkpoint's inventory from its index and shard headers.

A shard is `u64 little-endian header length` + `header JSON` + data. Only the
first two are read: planning a 700 GB checkpoint touches a few megabytes.

Validation collects every problem before raising one `CheckpointError`:
header length against the file size, the JSON, each tensor's dtype, shape and
data_offsets (size = dtype x shape, inside the file, no overlaps), index
entries whose shard is missing or lacks the tensor, and shard tensors the
index does not list.

The fingerprint is a sha256 over the index bytes and, for every shard in name
order, its name, size and header bytes. Any change to names, dtypes, shapes or
layout changes it; rewriting weight values in place does not.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import NamedTuple

from ..errors import CheckpointError
from ..nogc import no_gc
from .dtypes import BITS, nbytes

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_MAX_HEADER = 100 * 2**20  # safetensors' own limit


class TensorInfo(NamedTuple):
    """One tensor of the checkpoint (a NamedTuple: 90k of them are built per plan)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    shard: str  # file name relative to the checkpoint directory
    offset: int  # absolute byte offset of the data in the shard file


@dataclass(frozen=True)
class Checkpoint:
    """What the planner knows of a checkpoint: headers only."""

    root: Path  # the directory holding the shards
    index: Path | None  # None for a single-file checkpoint
    tensors: dict[str, TensorInfo]  # in index (or header) order
    fingerprint: str  # "sha256:<hex>"
    metadata: dict[str, str]

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def shards(self) -> list[str]:
        return sorted({t.shard for t in self.tensors.values()})


def resolve(path: str | os.PathLike) -> tuple[Path, Path | None, list[str]]:
    """Return (directory, index file or None, shard names) for a checkpoint path.

    Accepts a directory holding `model.safetensors.index.json` or
    `model.safetensors`, or the path of either kind of file.
    """
    path = Path(path)
    if path.is_dir():
        if (path / INDEX_NAME).is_file():
            path = path / INDEX_NAME
        elif (path / SINGLE_NAME).is_file():
            path = path / SINGLE_NAME
        else:
            found = sorted(p.name for p in path.glob("*.safetensors*"))[:5]
            hint = f" (found: {', '.join(found)}; pass a file path instead)" if found else ""
            raise CheckpointError(
                f"{path}: no {INDEX_NAME} or {SINGLE_NAME} in this directory{hint}"
            )
    elif not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if path.name.endswith(".json"):
        return path.parent, path, []
    if path.suffix == ".safetensors":
        return path.parent, None, [path.name]
    raise CheckpointError(
        f"{path}: not a safetensors checkpoint (expected a directory, a .safetensors file "
        f"or a {INDEX_NAME})"
    )


def _read_index(index: Path) -> tuple[bytes, dict[str, str]]:
    try:
        raw = index.read_bytes()
        data = json.loads(raw)
    except OSError as e:
        raise CheckpointError(f"{index}: cannot read: {e.strerror}") from None
    except ValueError as e:
        raise CheckpointError(f"{index}: not valid JSON: {e}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(
            f"{index}: expected an object with a \"weight_map\" of tensor name -> shard file name"
        )
    return raw, weight_map


def _read_header(file: Path, problems: list[str]) -> tuple[bytes, int, dict] | None:
    """Read one shard's header: (header bytes, file size, parsed JSON), or None on error."""
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
    try:
        header = json.loads(raw)
    except ValueError as e:
        problems.append(f"{file.name}: header is not valid JSON: {e}")
        return None
    if not isinstance(header, dict):
        problems.append(f"{file.name}: header is not a JSON object")
        return None
    return raw, size, header


def _parse_tensors(shard: str, header: dict, header_len: int, size: int,
                   problems: list[str]) -> dict[str, TensorInfo]:
    """Type and check every entry of one header.

    The common case (a well-formed entry) runs in a handful of operations per
    tensor; anything unusual falls through to `_entry_problem` for the message.
    """
    data_len = size - 8 - header_len
    base = 8 + header_len
    out: dict[str, TensorInfo] = {}
    spans = []
    bits = BITS
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = entry["dtype"]
            shape = tuple(entry["shape"])
            begin, end = entry["data_offsets"]
            want, rem = divmod(bits[dtype] * prod(shape), 8)
            ok = (not rem and type(want) is int and type(begin) is int and type(end) is int
                  and 0 <= begin and end - begin == want and end <= data_len
                  and (not shape or min(shape) >= 0))
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            problems.append(_entry_problem(f"{shard}: tensor {name}", entry, data_len))
            continue
        spans.append((begin, end, name))
        out[name] = TensorInfo(name, dtype, shape, want, shard, base + begin)
    spans.sort()
    # Compare each span with the one reaching furthest so far: a long tensor
    # that swallows several later ones is reported against each of them.
    if spans:
        b0, e0, n0 = spans[0]
        for b1, e1, n1 in spans[1:]:
            if b1 < e0 and b1 < e1:  # an empty tensor occupies no bytes
                problems.append(f"{shard}: tensors {n0} [{b0}, {e0}) and {n1} [{b1}, {e1}) overlap")
            if e1 > e0:
                b0, e0, n0 = b1, e1, n1
    return out


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


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Read and validate a checkpoint's index and every shard header (no weight data)."""
    with no_gc():
        return _open_checkpoint(path)


def _open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    root, index, shards = resolve(path)
    problems: list[str] = []
    digest = hashlib.sha256()
    weight_map: dict[str, str] | None = None
    if index is not None:
        raw, weight_map = _read_index(index)
        digest.update(b"index\0" + raw)
        shards = sorted(set(weight_map.values()))
    tensors_by_shard: dict[str, dict[str, TensorInfo]] = {}
    metadata: dict[str, str] = {}
    for shard in shards:
        file = root / shard
        if not file.is_file():
            if weight_map is not None:
                names = [n for n, s in weight_map.items() if s == shard]
                problems.append(
                    f"{shard}: shard file missing (the index maps {len(names)} tensors to it, "
                    f"e.g. {names[0]})"
                )
            continue
        got = _read_header(file, problems)
        if got is None:
            continue
        raw, size, header = got
        digest.update(f"shard\0{shard}\0{size}\0".encode() + raw)
        meta = header.get("__metadata__")
        if isinstance(meta, dict) and index is None:
            metadata = {str(k): str(v) for k, v in meta.items()}
        tensors_by_shard[shard] = _parse_tensors(shard, header, len(raw), size, problems)

    if weight_map is None:
        tensors = next(iter(tensors_by_shard.values()), {})
    else:
        tensors = {}
        for name, shard in weight_map.items():
            found = tensors_by_shard.get(shard)
            if found is None:
                continue  # already reported
            info = found.get(name)
            if info is None:
                problems.append(f"{shard}: tensor {name} is in the index but not in this shard")
            else:
                tensors[name] = info
        for shard, found in tensors_by_shard.items():
            for name in found:
                if weight_map.get(name) != shard:
                    problems.append(
                        f"{shard}: tensor {name} is in this shard but the index "
                        + ("does not list it" if name not in weight_map
                           else f"maps it to {weight_map[name]}")
                    )
    if problems:
        where = index if index is not None else root / shards[0]
        raise CheckpointError(f"{where}: the checkpoint is invalid ({len(problems)} problems)", problems)
    if not tensors:
        raise CheckpointError(f"{root}: the checkpoint holds no tensors")
    return Checkpoint(root, index, tensors, "sha256:" + digest.hexdigest(), metadata)
