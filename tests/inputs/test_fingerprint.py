"""The checkpoint's fingerprint (planner/inputs/checkpoint.py): what it covers, and that `open_checkpoint`, which
hashes on a thread beside the headers' parsing, and `fingerprint`, which hashes in its caller's, give the one the
module doc defines."""
from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest
from safetensors.numpy import save_file

from headeronly import write_index
from planner.errors import CheckpointError
from planner.inputs.checkpoint import fingerprint, open_checkpoint


def test_fingerprint_tracks_headers_not_values(tmp_path):
    arrays = {"w": np.zeros((4,), dtype=np.float32)}
    save_file(arrays, tmp_path / "model.safetensors")
    first = open_checkpoint(tmp_path).fingerprint
    assert first.startswith("sha256:") and len(first) == 7 + 64
    save_file({"w": np.ones((4,), dtype=np.float32)}, tmp_path / "model.safetensors")
    assert open_checkpoint(tmp_path).fingerprint == first
    save_file({"w": np.ones((2, 2), dtype=np.float32)}, tmp_path / "model.safetensors")
    assert open_checkpoint(tmp_path).fingerprint != first


def test_fingerprint_is_the_documented_digest_and_its_thread_ends(tmp_path):
    """The module doc's sha256 (the index's bytes, then each shard's name, file size and header bytes, in name
    order), the same from `open_checkpoint` (hashed on a thread beside the parsing) and from `fingerprint` (in the
    caller's thread); the hashing thread is gone after a call, and after one that fails."""
    names = {"b": "model-00002-of-00002.safetensors", "a": "model-00001-of-00002.safetensors"}
    save_file({"b": np.ones((2, 3), dtype=np.float16)}, tmp_path / names["b"])
    save_file({"a": np.zeros((4,), dtype=np.float32)}, tmp_path / names["a"])
    index = write_index(tmp_path, names)
    want = hashlib.sha256(b"index\0" + index.read_bytes())
    for shard in sorted(names.values()):
        data = (tmp_path / shard).read_bytes()
        want.update(f"shard\0{shard}\0{len(data)}\0".encode() + data[8:8 + int.from_bytes(data[:8], "little")])
    assert open_checkpoint(tmp_path).fingerprint == fingerprint(tmp_path) == "sha256:" + want.hexdigest()
    (tmp_path / names["b"]).write_bytes(b"\x05" + bytes(7) + b"{nope")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        open_checkpoint(tmp_path)
    assert not [t for t in threading.enumerate() if t.name == "offplan-fingerprint"]
