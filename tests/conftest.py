"""Shared test setup: the `gpu` marker skips without CUDA."""
from __future__ import annotations

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def toy_ckpt(tmp_path):
    """A 4-layer header-only checkpoint at tmp_path/ckpt, in two shards (see headeronly.toy)."""
    from headeronly import toy
    from synthetic import write_header_only
    return write_header_only(tmp_path / "ckpt", toy(4), shard_bytes=16 * 2**20)
