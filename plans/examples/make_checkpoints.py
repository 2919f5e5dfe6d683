"""Regenerate the header-only checkpoints that the example policies plan.

    python plans/examples/make_checkpoints.py            # only what is missing or outdated
    python plans/examples/make_checkpoints.py --force    # rewrite them all

Each checkpoint under `checkpoints/<name>/` has real shard sizes and real
headers (from `tests/synthetic.py`), but its data regions are sparse holes: a
60 GB model costs a few megabytes of disk. They are git-ignored; the plans
built from them are committed, and `tests/test_examples.py` fails when a plan
drifts from what `plan build` produces.

Shards are cut at about the size the published checkpoints use (Llama-3.1-8B:
4 shards of at most 5 GB; Qwen3-30B-A3B: 16 shards of about 4 GB), so the
plans' shard counts look like the real ones. Shard names, tensor names, dtypes
and shapes are what matter to the planner.

Idempotence: each checkpoint directory holds a `.synthetic.sha256` stamp of
the tensor list and shard size it was written from. A checkpoint is rewritten
only when the stamp is missing, differs (tests/synthetic.py changed), or a file
the index names is gone.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The header-only architectures are the tests' fixtures (tests/synthetic.py); the examples plan the same ones.
sys.path.insert(0, str(HERE.parent.parent / "tests"))
import synthetic  # noqa: E402

ROOT = HERE / "checkpoints"
STAMP = ".synthetic.sha256"

# name -> (tensor list factory, shard size in bytes)
MODELS: dict[str, tuple[Callable[[], list[synthetic.Tensor]], int]] = {
    "Qwen3-30B-A3B": (synthetic.qwen3_moe, 4 * 10**9),
    "Llama-3.1-8B": (synthetic.llama, 5 * 10**9),
}


def _stamp(tensors: list[synthetic.Tensor], shard_bytes: int) -> str:
    spec = json.dumps({"shard_bytes": shard_bytes, "tensors": tensors}, separators=(",", ":"))
    return hashlib.sha256(spec.encode()).hexdigest()


def _current(directory: Path, stamp: str) -> bool:
    """True if `directory` already holds the checkpoint `stamp` describes, every shard present."""
    try:
        if (directory / STAMP).read_text().strip() != stamp:
            return False
        index = json.loads((directory / "model.safetensors.index.json").read_text())
    except (OSError, ValueError):
        return False
    return all((directory / shard).is_file() for shard in set(index["weight_map"].values()))


def make(name: str, root: Path = ROOT, force: bool = False) -> tuple[Path, bool]:
    """Write checkpoint `name` under `root` unless it is current; returns (directory, written)."""
    factory, shard_bytes = MODELS[name]
    tensors = factory()
    stamp = _stamp(tensors, shard_bytes)
    directory = root / name
    if not force and _current(directory, stamp):
        return directory, False
    if directory.exists():
        shutil.rmtree(directory)  # the shard count may change: no stale shards left behind
    synthetic.write_header_only(directory, tensors, shard_bytes=shard_bytes)
    (directory / STAMP).write_text(stamp + "\n")
    return directory, True


def make_all(root: Path = ROOT, force: bool = False) -> list[tuple[Path, bool]]:
    return [make(name, root, force) for name in MODELS]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--force", action="store_true", help="rewrite even the checkpoints that are current")
    args = ap.parse_args(argv)
    for directory, written in make_all(force=args.force):
        shards = len(list(directory.glob("*.safetensors")))
        print(f"{'wrote' if written else 'up to date:'} {directory} ({shards} shards)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
