"""Loading a header-only checkpoint (data regions left as holes in sparse files) is refused up front.

Both sides of the threshold on real files: a shard written in full is loaded,
however small; the same header over a hole is refused once its tensors need
1 MiB or more, and let through below that (too small to tell apart).
"""
from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")

import runtime  # noqa: E402
from headeronly import MiB, entries, write_index, write_raw_shard  # noqa: E402
from offplan.cli import main  # noqa: E402
from planner.errors import CheckpointError  # noqa: E402
from planner.inputs.checkpoint import open_checkpoint  # noqa: E402
from planner.units import human  # noqa: E402
from runtime.place.loader import check_holds_weights  # noqa: E402

NOTE = ("It is a header-only checkpoint, for planning only (plans/examples/make_checkpoints.py writes them). "
        "To load the model, download the real checkpoint, point the policy's `checkpoint:` at it and run "
        "`plan build` again")


def write_full_shard(path, header: dict, data_len: int) -> None:
    """A safetensors file whose data region is written byte by byte (random, so nothing compresses)."""
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + os.urandom(data_len))


@pytest.fixture
def holes_on_disk(tmp_path):
    probe = tmp_path / "probe"
    write_raw_shard(probe, {}, MiB)
    if probe.stat().st_blocks * 512 >= MiB // 16:
        pytest.skip("this file system does not keep sparse files sparse")
    probe.unlink()


def on_disk(*files) -> str:
    """Bytes the file system allocated to `files`, as the message prints them."""
    return human(sum(os.stat(f).st_blocks * 512 for f in files))


def one_shard(tmp_path, nbytes: int, full: bool):
    header, data_len = entries(("w", "U8", (nbytes,)))
    (write_full_shard if full else write_raw_shard)(tmp_path / "model.safetensors", header, data_len)
    return open_checkpoint(tmp_path)


@pytest.mark.parametrize("nbytes", [16, 4096, MiB, 8 * MiB])
def test_a_real_shard_is_loaded_whatever_its_size(tmp_path, nbytes):
    check_holds_weights(one_shard(tmp_path, nbytes, full=True))


def test_a_hole_of_1_mib_is_refused(tmp_path, holes_on_disk):
    with pytest.raises(CheckpointError) as e:
        check_holds_weights(one_shard(tmp_path, MiB, full=False))
    assert str(e.value) == (f"{tmp_path}: the checkpoint holds no weights: the data of its shards are holes in "
                            f"sparse files (1.0 MiB of tensors, {on_disk(tmp_path / 'model.safetensors')} on disk)."
                            f" {NOTE}")


def test_a_hole_below_1_mib_cannot_be_told_apart(tmp_path, holes_on_disk):
    check_holds_weights(one_shard(tmp_path, MiB - 1, full=False))


def test_some_shards_holes_are_listed(tmp_path, holes_on_disk):
    a, na = entries(("a", "U8", (2 * MiB,)))
    b, nb = entries(("b", "U8", (2 * MiB,)))
    write_full_shard(tmp_path / "s1.safetensors", a, na)
    write_raw_shard(tmp_path / "s2.safetensors", b, nb)
    write_index(tmp_path, {"a": "s1.safetensors", "b": "s2.safetensors"})
    with pytest.raises(CheckpointError) as e:
        check_holds_weights(open_checkpoint(tmp_path))
    assert e.value.headline.startswith(f"{tmp_path}: the checkpoint holds no weights: the data of 1 of its 2 "
                                       "shards are holes in sparse files (2.0 MiB of tensors, "
                                       f"{on_disk(tmp_path / 's2.safetensors')} on disk)")
    assert e.value.problems == [f"s2.safetensors: its tensors need 2.0 MiB, {on_disk(tmp_path / 's2.safetensors')} "
                                "is on disk"]


def test_runtime_load_refuses_before_allocating(tmp_path, toy_ckpt, holes_on_disk):
    (tmp_path / "p.policy.yaml").write_text("format_version: 1\ncheckpoint: ./ckpt\n")
    assert main(["build", str(tmp_path / "p.policy.yaml")]) == 0
    with torch.device("meta"):
        model = torch.nn.Linear(2, 2)  # never reached: the check runs before the plan is matched to the model
    with pytest.raises(CheckpointError, match="the checkpoint holds no weights"):
        runtime.load(model, tmp_path / "p.plan.yaml", device="cpu")


def test_plan_apply_says_the_checkpoint_holds_no_weights(tmp_path, toy_ckpt, holes_on_disk, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.policy.yaml").write_text("format_version: 1\ncheckpoint: ./ckpt\n")
    assert main(["build", "p.policy.yaml"]) == 0
    capsys.readouterr()
    assert main(["apply", "p.plan.yaml"]) == 1  # no config.json either: the holes are the news
    out, err = capsys.readouterr()
    shards = sorted(toy_ckpt.glob("*.safetensors"))
    assert (out, err) == ("", "error: ckpt: the checkpoint holds no weights: the data of its shards are holes in "
                              f"sparse files (21.0 MiB of tensors, {on_disk(*shards)} on disk). {NOTE}\n")
