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

Each also gets a `config.json` holding what a tensor-parallel plan needs
(`gpus:` above 1; planner/layers/shards.py): the model type, whose
transformers sharding plan applies, the attention and key/value heads, the
hidden size and whether the head is tied, as the published configs give them,
and for the MoE model its experts and experts per token, which the cost model
reads (without them it assumed every expert read each step). The layer count is
left out: the layers are found from the names.

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

# name -> (tensor list factory, shard size in bytes, config.json: the published config's tensor-parallel and
# routing facts)
MODELS: dict[str, tuple[Callable[[], list[synthetic.Tensor]], int, dict]] = {
    "Qwen3-30B-A3B": (synthetic.qwen3_moe, 4 * 10**9,
                      {"model_type": "qwen3_moe", "hidden_size": 2048, "num_attention_heads": 32,
                       "num_key_value_heads": 4, "tie_word_embeddings": False, "num_experts": 128,
                       "num_experts_per_tok": 8}),
    "Llama-3.1-8B": (synthetic.llama, 5 * 10**9,
                     {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
                      "num_key_value_heads": 8, "tie_word_embeddings": False}),
}


def _stamp(tensors: list[synthetic.Tensor], shard_bytes: int, config: dict) -> str:
    spec = json.dumps({"shard_bytes": shard_bytes, "tensors": tensors, "config": config}, separators=(",", ":"))
    return hashlib.sha256(spec.encode()).hexdigest()


def _current(directory: Path, stamp: str) -> bool:
    """True if `directory` already holds the checkpoint `stamp` describes, every shard present."""
    try:
        if (directory / STAMP).read_text().strip() != stamp:
            return False
        index = json.loads((directory / "model.safetensors.index.json").read_text())
    except (OSError, ValueError):
        return False
    files = {*index["weight_map"].values(), "config.json"}
    return all((directory / name).is_file() for name in files)


def make(name: str, root: Path = ROOT, force: bool = False) -> tuple[Path, bool]:
    """Write checkpoint `name` under `root` unless it is current; returns (directory, written)."""
    factory, shard_bytes, config = MODELS[name]
    tensors = factory()
    stamp = _stamp(tensors, shard_bytes, config)
    directory = root / name
    if not force and _current(directory, stamp):
        return directory, False
    if directory.exists():
        shutil.rmtree(directory)  # the shard count may change: no stale shards left behind
    synthetic.write_header_only(directory, tensors, shard_bytes=shard_bytes)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
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
