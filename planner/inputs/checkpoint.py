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
layout changes it; rewriting weight values in place does not. `fingerprint`
computes it alone, parsing no shard header (`plan check`'s quick answer).

One shard's header, read, typed and checked, is shard_header.py (`TensorInfo`
lives there, and is this module's too).
"""
from __future__ import annotations

import hashlib
import os
import queue
import re
import threading
from contextlib import closing
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path

from ..errors import CheckpointError
from ..nogc import no_gc
from .shard_header import TensorInfo, loads, parse_tensors, read_header, read_raw

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_NBYTES, _SHARD = itemgetter(3), itemgetter(4)  # of a TensorInfo


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
        return sum(map(_NBYTES, self.tensors.values()))

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
            shards = [n for n in found if (of := _SHARD_OF.search(n)) and int(of[2]) > 1]
            hint = (f" (found: {', '.join(found)}: shards of a checkpoint whose {INDEX_NAME} is missing; put it "
                    "back, as the checkpoint's writer made it)" if shards else
                    f" (found: {', '.join(found)}; pass a file path instead)" if found else "")
            raise CheckpointError(
                f"{path}: no {INDEX_NAME} or {SINGLE_NAME} in this directory{hint}"
            )
    elif not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if path.name.endswith(".json"):
        return path.parent, path, []
    if path.suffix == ".safetensors":
        _refuse_one_of_many(path)
        return path.parent, None, [path.name]
    raise CheckpointError(
        f"{path}: not a safetensors checkpoint (expected a directory, a .safetensors file "
        f"or a {INDEX_NAME})"
    )


_SHARD_OF = re.compile(r"-(\d+)-of-(\d+)\.safetensors$")  # transformers' shard names: model-00001-of-00004


def _refuse_one_of_many(path: Path) -> None:
    """A .safetensors file that the index beside it lists among several shards, or whose name says it is one of
    several (`model-00001-of-00004.safetensors`) with no index beside it, is part of a checkpoint: planning it alone
    would plan a fraction of the model's tensors, which only the load would find wrong."""
    index = path.parent / INDEX_NAME
    if not index.is_file():
        of = _SHARD_OF.search(path.name)
        if of and int(of[2]) > 1:
            raise CheckpointError(f"{path}: its name says it is shard {int(of[1])} of {int(of[2])}, and no "
                                  f"{INDEX_NAME} beside it lists the others: planned alone, it would be part of the "
                                  f"model; put the index back and point `checkpoint:` at the folder, {path.parent}")
        return
    try:
        _, weight_map, shards = _read_index(index)
    except CheckpointError:
        return  # not this file's problem: it is planned as given
    if path.name in shards and len(shards) > 1:
        mine = sum(1 for s in weight_map.values() if s == path.name)
        raise CheckpointError(f"{path}: one of the {len(shards)} shards that {index.name} beside it indexes (it holds "
                              f"{mine} of the checkpoint's {len(weight_map)} tensors): point `checkpoint:` at the "
                              f"folder, {path.parent}")


class _Digest:
    """A sha256 fed on a thread of its own, pieces in the order given: hashlib lets go of the GIL over each piece
    of 2 KiB or more, so the headers hash on another core while this thread parses them (DeepSeek-V3's 21 MB took
    0.11 s of a 0.65 s `plan build` on a 2-CPU VM, Kimi-K2's 32 MB 0.18 s of 0.96). With nothing else to do
    meanwhile, the hand-overs cost more than they save (`fingerprint` took 1.5x as long): `threaded=False` hashes in
    the caller's thread. `close` ends the thread (`open_checkpoint` holds it in `contextlib.closing`: an error too)."""

    def __init__(self, threaded: bool = True):
        self._hash, self._pieces = hashlib.sha256(), queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="offplan-fingerprint", daemon=True)
        if threaded:
            self._thread.start()

    def close(self) -> None:
        """End the thread once every piece given is digested (idempotent)."""
        if self._thread.is_alive():
            self._pieces.put(None)
            self._thread.join()

    def _run(self) -> None:
        while (pieces := self._pieces.get()) is not None:
            for piece in pieces:
                self._hash.update(piece)

    def update(self, *pieces: bytes) -> None:
        """Digest `pieces` in order, as hashlib's `update` of each would: a call's pieces are one hand-over."""
        if self._thread.is_alive():
            self._pieces.put(pieces)
        else:
            for piece in pieces:
                self._hash.update(piece)

    def hexdigest(self) -> str:
        self.close()
        return self._hash.hexdigest()


def _add_index(digest, raw: bytes) -> None:
    """What the index adds to the fingerprint (module doc): its bytes, after a tag. Fed in two pieces, which
    digest as their concatenation would, without copying megabytes into one."""
    digest.update(b"index\0", raw)


def _add_shard(digest, shard: str, size: int, raw: bytes) -> None:
    """What a shard adds to the fingerprint (module doc): its name, file size and header bytes (as `_add_index`)."""
    digest.update(f"shard\0{shard}\0{size}\0".encode(), raw)


def fingerprint(path: str | os.PathLike) -> str | None:
    """The checkpoint's fingerprint as `open_checkpoint` computes it, from the index and the shards' header
    bytes alone (no header parsed, nothing checked); None where any of them cannot be read."""
    try:
        root, index, shards = resolve(path)
        digest = _Digest(threaded=False)  # nothing to parse beside it: a thread's hand-overs would cost more
        if index is not None:
            raw, weight_map, names = _read_index(index)
            _add_index(digest, raw)
            shards = sorted(names)
    except CheckpointError:
        return None
    problems: list[str] = []
    for shard in shards:
        got = read_raw(root / shard, problems)
        if got is None:
            return None
        _add_shard(digest, shard, got[1], got[0])
    return "sha256:" + digest.hexdigest()


def _read_index(index: Path) -> tuple[bytes, dict[str, str], set[str]]:
    """The index's bytes, its weight map and the shard names it maps to. The values' types are checked on the
    distinct ones (the shard names, a few hundred, which the callers want anyway), not on all 90k values:
    a list or an object among them fails the set, any other type the check."""
    try:
        raw = index.read_bytes()
        data = loads(raw)
    except OSError as e:
        raise CheckpointError(f"{index}: cannot read: {e.strerror}") from None
    except ValueError as e:
        raise CheckpointError(f"{index}: not valid JSON: {e}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    try:  # JSON keys are strings; the values must be too (the parser makes no str subclass: their types say it at once)
        shards = set(weight_map.values()) if isinstance(weight_map, dict) else None
    except TypeError:  # unhashable: a list or an object
        shards = None
    if shards is None or not set(map(type, shards)) <= {str}:
        raise CheckpointError(
            f"{index}: expected an object with a \"weight_map\" of tensor name -> shard file name"
        )
    return raw, weight_map, shards


def _as_indexed(weight_map: dict[str, str], tensors_by_shard: dict[str, dict[str, TensorInfo]]
                ) -> dict[str, TensorInfo] | None:
    """The tensors in index order when the index and the headers agree exactly (every name in the shard
    the index names, no other); None when they do not, and the caller's loops say where.

    A copy of the index keeps its order, and the headers' tensors replace its shard names. The headers
    list as many tensors as the index and add no name to it, so a name in two headers leaves one of the
    index's shard names unreplaced; then each tensor's shard is the index's, compared in one walk of both
    (a leftover shard name is no TensorInfo: `_SHARD` of it is a character, or an IndexError)."""
    if sum(map(len, tensors_by_shard.values())) != len(weight_map):
        return None
    tensors: dict = dict(weight_map)
    for found in tensors_by_shard.values():
        tensors.update(found)
    try:
        if len(tensors) != len(weight_map) or list(map(_SHARD, tensors.values())) != list(weight_map.values()):
            return None
    except IndexError:
        return None
    return tensors


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Read and validate a checkpoint's index and every shard header (no weight data)."""
    with no_gc(), closing(_Digest()) as digest:
        return _open_checkpoint(path, digest)


def _open_checkpoint(path: str | os.PathLike, digest: _Digest) -> Checkpoint:
    root, index, shards = resolve(path)
    problems: list[str] = []
    weight_map: dict[str, str] | None = None
    if index is not None:
        raw, weight_map, names = _read_index(index)
        _add_index(digest, raw)
        shards = sorted(names)
    tensors_by_shard: dict[str, dict[str, TensorInfo]] = {}
    metadata: dict[str, str] = {}
    known: dict[tuple, tuple] = {}  # (dtype, shape) -> the objects its tensors share (parse_tensors)
    rejected: set[str] = set()  # names whose header entries are bad (parse_tensors said why)
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
        got = read_header(file, problems)
        if got is None:
            continue
        raw, size, header = got
        _add_shard(digest, shard, size, raw)
        meta = header.get("__metadata__")
        if isinstance(meta, dict) and index is None:
            metadata = {str(k): str(v) for k, v in meta.items()}
        tensors_by_shard[shard] = parse_tensors(shard, header, len(raw), size, problems, known, rejected)

    if weight_map is None:
        tensors = next(iter(tensors_by_shard.values()), {})
    elif problems or (tensors := _as_indexed(weight_map, tensors_by_shard)) is None:
        tensors = {}
        for name, shard in weight_map.items():
            found = tensors_by_shard.get(shard)
            if found is None:
                continue  # already reported
            info = found.get(name)
            if info is None and name not in rejected:  # one its header lists badly is reported already
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
        count = f"{len(problems)} problem{'s' * (len(problems) > 1)}"
        raise CheckpointError(f"{where}: the checkpoint is invalid ({count})", problems)
    if not tensors:
        raise CheckpointError(f"{root}: the checkpoint holds no tensors")
    return Checkpoint(root, index, tensors, "sha256:" + digest.hexdigest(), metadata)
