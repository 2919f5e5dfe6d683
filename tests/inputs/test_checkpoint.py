"""Reading a checkpoint's inventory from headers only, and every way a checkpoint can be broken."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from headeronly import MiB, entries, toy, write_index, write_raw_shard
from planner.errors import CheckpointError
from planner.inputs.checkpoint import TensorInfo, open_checkpoint, resolve
from planner.inputs.dtypes import BITS, nbytes
from synthetic import deepseek_v3, write_header_only


def problems_of(path) -> list[str]:
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(path)
    return e.value.problems


# ---------------------------------------------------------------- agreement with safetensors

def test_agrees_with_the_safetensors_library_on_a_real_file(tmp_path):
    arrays = {
        "model.embed_tokens.weight": np.arange(12, dtype=np.float16).reshape(3, 4),
        "model.layers.0.mlp.w": np.ones((2, 3, 4), dtype=np.float32),
        "model.layers.0.ids": np.array([1, 2, 3], dtype=np.int64),
        "model.layers.0.mask": np.array([True, False]),
        "model.layers.0.q": np.zeros((5,), dtype=np.uint8),
        "model.scalar": np.array(7, dtype=np.int32),
    }
    save_file(arrays, tmp_path / "model.safetensors", metadata={"format": "np"})
    ckpt = open_checkpoint(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "np") as f:
        want = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
    assert {n: (t.dtype, t.shape) for n, t in ckpt.tensors.items()} == want
    assert {n: t.nbytes for n, t in ckpt.tensors.items()} == {n: a.nbytes for n, a in arrays.items()}
    assert ckpt.metadata == {"format": "np"}
    assert ckpt.index is None
    # The recorded offsets point at the real data.
    raw = (tmp_path / "model.safetensors").read_bytes()
    t = ckpt.tensors["model.embed_tokens.weight"]
    assert raw[t.offset:t.offset + t.nbytes] == arrays["model.embed_tokens.weight"].tobytes()


def test_reads_a_hand_written_file(tmp_path):
    header, n = entries(("b", "BF16", (2, 3)), ("a", "F4", (4, 2)))
    header["__metadata__"] = {"k": "v"}
    write_raw_shard(tmp_path / "x.safetensors", header, n)
    ckpt = open_checkpoint(tmp_path / "x.safetensors")
    hlen = len(json.dumps(header).encode())
    assert ckpt.tensors == {
        "b": TensorInfo("b", "BF16", (2, 3), 12, "x.safetensors", 8 + hlen),
        "a": TensorInfo("a", "F4", (4, 2), 4, "x.safetensors", 8 + hlen + 12),
    }
    assert ckpt.metadata == {"k": "v"} and ckpt.total_bytes == 16 and ckpt.shards == ["x.safetensors"]


@pytest.mark.parametrize("dtype", sorted(BITS))
def test_every_dtype(tmp_path, dtype):
    shape = (2, 8, 3)  # 48 elements: whole bytes even at 4 and 6 bits
    header, n = entries(("t", dtype, shape))
    write_raw_shard(tmp_path / "model.safetensors", header, n)
    t = open_checkpoint(tmp_path).tensors["t"]
    assert (t.dtype, t.shape, t.nbytes) == (dtype, shape, BITS[dtype] * 48 // 8)


def test_named_dtype_sizes():
    want = {"F8_E4M3": 1, "F8_E5M2": 1, "U8": 1, "BF16": 2, "F16": 2, "F32": 4, "I64": 8, "BOOL": 1}
    assert {d: nbytes(d, (1,)) for d in want} == want
    assert nbytes("F4", (3, 2)) == 3 and nbytes("F4", (3,)) is None
    assert nbytes("F6_E2M3", (4,)) == 3


# ---------------------------------------------------------------- paths and index

def test_path_forms(tmp_path, toy_ckpt):
    a = open_checkpoint(toy_ckpt)
    b = open_checkpoint(toy_ckpt / "model.safetensors.index.json")
    assert a.tensors == b.tensors and a.fingerprint == b.fingerprint
    assert a.shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert list(a.tensors) == sorted(n for n, _, _ in toy(4))  # index order
    single = write_header_only(tmp_path / "single", toy(2), single=True)
    assert resolve(single) == (single, None, ["model.safetensors"])
    assert open_checkpoint(single / "model.safetensors").tensors == open_checkpoint(single).tensors


def test_path_errors(tmp_path):
    with pytest.raises(CheckpointError, match=r"nowhere: no such file or directory"):
        open_checkpoint(tmp_path / "nowhere")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "model-1.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"no model.safetensors.index.json or model.safetensors "
                       r"in this directory \(found: model-1.safetensors; pass a file path instead\)"):
        open_checkpoint(tmp_path / "d")
    (tmp_path / "x.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="not a safetensors checkpoint"):
        open_checkpoint(tmp_path / "x.bin")


def test_bad_index(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text("{nope")
    with pytest.raises(CheckpointError, match=r"model.safetensors.index.json: not valid JSON"):
        open_checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": [1]}')
    with pytest.raises(CheckpointError, match=r'expected an object with a "weight_map"'):
        open_checkpoint(tmp_path)


# ---------------------------------------------------------------- no data is read

def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux /proc/self/io")
def test_reads_headers_only_on_a_multi_gb_sparse_checkpoint(tmp_path):
    tensors = deepseek_v3(layers=6, dense_layers=1, experts=32, vocab=32000)
    ckpt_dir = write_header_only(tmp_path / "ds", tensors, shard_bytes=2 * 10**9)
    on_disk = sum(f.stat().st_size for f in ckpt_dir.iterdir())
    assert on_disk > 8 * 10**9  # the real size, as a sparse hole
    headers = 0
    for shard in ckpt_dir.glob("*.safetensors"):
        with open(shard, "rb") as f:
            headers += 8 + int.from_bytes(f.read(8), "little")
    before = _rchar()
    ckpt = open_checkpoint(ckpt_dir)
    read = _rchar() - before
    assert len(ckpt.tensors) == len(tensors)
    assert ckpt.total_bytes == sum(nbytes(d, s) for _, d, s in tensors)
    index = (ckpt_dir / "model.safetensors.index.json").stat().st_size
    assert read <= index + headers + 2 * MiB, f"read {read} bytes"


# ---------------------------------------------------------------- validation

def test_header_length_past_the_file_size(tmp_path):
    header, n = entries(("w", "F32", (4,)))
    path = write_raw_shard(tmp_path / "model.safetensors", header, n, header_len=10**6)
    assert problems_of(tmp_path) == [
        f"model.safetensors: header length 1000000 exceeds the file size {path.stat().st_size} "
        "(truncated or not a safetensors file)"]


def test_file_too_short(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x01\x02")
    assert problems_of(tmp_path) == [
        "model.safetensors: file is 2 bytes, too short for a safetensors header"]


def test_bad_json(tmp_path):
    raw = b'{"w": {"dtype": "F32",'
    (tmp_path / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw)
    (msg,) = problems_of(tmp_path)
    assert msg.startswith("model.safetensors: header is not valid JSON: ")
    raw = b'[1, 2]'
    (tmp_path / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw)
    assert problems_of(tmp_path) == ["model.safetensors: header is not a JSON object"]


def test_every_entry_problem_is_collected_naming_shard_and_tensor(tmp_path):
    header = {
        "ok": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "size": {"dtype": "F32", "shape": [2, 2], "data_offsets": [8, 16]},
        "dtype": {"dtype": "F12", "shape": [2], "data_offsets": [16, 20]},
        "past": {"dtype": "U8", "shape": [100], "data_offsets": [20, 120]},
        "shape": {"dtype": "U8", "shape": [-1], "data_offsets": [20, 20]},
        "offsets": {"dtype": "U8", "shape": [2], "data_offsets": [4, 2]},
        "bits": {"dtype": "F4", "shape": [3], "data_offsets": [20, 22]},
        "junk": {"dtype": "U8"},
    }
    write_raw_shard(tmp_path / "model.safetensors", header, 24)
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(tmp_path)
    assert e.value.problems == [
        "model.safetensors: tensor size: data_offsets [8, 16] hold 8 bytes but F32 x [2, 2] needs 16",
        "model.safetensors: tensor dtype: unknown dtype 'F12' (known: " + ", ".join(BITS) + ")",
        "model.safetensors: tensor past: data_offsets end 120 lies past the data region "
        "(24 bytes; file truncated?)",
        "model.safetensors: tensor shape: shape [-1] must be non-negative integers",
        "model.safetensors: tensor offsets: data_offsets [4, 2] must be integers 0 <= begin <= end",
        "model.safetensors: tensor bits: F4 x [3] is not a whole number of bytes",
        "model.safetensors: tensor junk: expected {dtype, shape, data_offsets: [begin, end]}",
    ]
    assert str(e.value).startswith(f"{tmp_path / 'model.safetensors'}: the checkpoint is invalid (7 problems)\n")


def test_overlapping_tensors_are_all_reported(tmp_path):
    header = {
        "big": {"dtype": "U8", "shape": [100], "data_offsets": [0, 100]},
        "a": {"dtype": "U8", "shape": [10], "data_offsets": [10, 20]},
        "b": {"dtype": "U8", "shape": [10], "data_offsets": [30, 40]},
        "c": {"dtype": "U8", "shape": [10], "data_offsets": [100, 110]},
    }
    write_raw_shard(tmp_path / "model.safetensors", header, 110)
    assert problems_of(tmp_path) == [
        "model.safetensors: tensors big [0, 100) and a [10, 20) overlap",
        "model.safetensors: tensors big [0, 100) and b [30, 40) overlap",
    ]


def test_index_problems_name_shard_and_tensor(tmp_path):
    h1, n1 = entries(("model.a", "F16", (2,)), ("model.extra", "F16", (2,)), ("model.moved", "F16", (2,)))
    write_raw_shard(tmp_path / "s1.safetensors", h1, n1)
    h2, n2 = entries(("model.b", "F16", (2,)))
    write_raw_shard(tmp_path / "s2.safetensors", h2, n2)
    write_index(tmp_path, {
        "model.a": "s1.safetensors",
        "model.ghost": "s1.safetensors",
        "model.b": "s2.safetensors",
        "model.moved": "s2.safetensors",
        "model.lost": "s3.safetensors",
    })
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(tmp_path)
    assert e.value.problems == [
        "s3.safetensors: shard file missing (the index maps 1 tensors to it, e.g. model.lost)",
        "s1.safetensors: tensor model.ghost is in the index but not in this shard",
        "s2.safetensors: tensor model.moved is in the index but not in this shard",
        "s1.safetensors: tensor model.extra is in this shard but the index does not list it",
        "s1.safetensors: tensor model.moved is in this shard but the index maps it to s2.safetensors",
    ]
    assert e.value.headline == f"{tmp_path / 'model.safetensors.index.json'}: the checkpoint is invalid (5 problems)"


def test_problems_across_shards_are_raised_once(tmp_path):
    write_header_only(tmp_path, toy(2), shard_bytes=6 * MiB)
    shards = sorted(tmp_path.glob("*.safetensors"))
    for s in shards[:2]:
        data = bytearray(s.read_bytes()[:16])
        data[8:16] = b"not json"
        s.write_bytes(bytes(data))
    got = problems_of(tmp_path)
    assert [p.split(":")[0] for p in got] == [shards[0].name, shards[1].name]


def test_empty_checkpoint(tmp_path):
    write_raw_shard(tmp_path / "model.safetensors", {"__metadata__": {}}, 0)
    with pytest.raises(CheckpointError, match="the checkpoint holds no tensors"):
        open_checkpoint(tmp_path)


def test_header_length_over_the_safetensors_limit(tmp_path):
    header, n = entries(("w", "F32", (4,)))
    write_raw_shard(tmp_path / "model.safetensors", header, 200 * MiB, header_len=150 * MiB)
    assert problems_of(tmp_path) == [
        f"model.safetensors: header length {150 * MiB} exceeds safetensors' limit of "
        f"{100 * MiB} bytes (not a safetensors file?)"]


def test_without_orjson_the_same_tensors_are_read_by_json(tmp_path):
    """orjson parses the headers and the index where it is installed (a dependency); a stack installed without it
    (the GPU machine's) falls back to json, with the same result, and a header that is not JSON says so either way.
    The fallback runs in a process of its own, where `import orjson` fails."""
    import subprocess
    import sys

    from planner.inputs import shard_header
    write_header_only(tmp_path / "ckpt", deepseek_v3(4), shard_bytes=64 * MiB)
    assert shard_header.loads.__module__ == "orjson"
    raw = b'{"w": {"dtype": "F32",'
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw)
    script = (
        "import json, sys\n"
        "sys.modules['orjson'] = None  # import orjson: ImportError\n"
        "from planner.errors import CheckpointError\n"
        "from planner.inputs import shard_header\n"
        "from planner.inputs.checkpoint import open_checkpoint\n"
        "assert shard_header.loads is json.loads\n"
        "tensors = open_checkpoint(sys.argv[1]).tensors\n"
        "try:\n"
        "    open_checkpoint(sys.argv[2])\n"
        "except CheckpointError as e:\n"
        "    bad = str(e)\n"
        "print(json.dumps([[list(t) for t in tensors.values()], bad]))\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "ckpt"), str(tmp_path / "bad")],
                          capture_output=True, text=True, check=True)
    tensors, bad = json.loads(done.stdout)
    assert tensors == json.loads(json.dumps([list(t) for t in open_checkpoint(tmp_path / "ckpt").tensors.values()]))
    assert "model.safetensors: header is not valid JSON: " in bad
