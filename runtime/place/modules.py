"""The model's module for each module path a plan names: checkpoint names, mapped as the tensors are.

A plan names modules as the checkpoint names its tensors (planner/layers/graph.py: a
layer is the module that owns its tensors), and the runtime hooks their
forwards (a prefetch schedule's `Transfer.module`, a prefill staging's
`StagedLayer.module`). transformers 5.x often names the model's modules
otherwise: it keeps VLM checkpoints in their original layout and renames at
load (Qwen2-VL's `visual.blocks.0` is the model's `model.visual.blocks.0`,
`model.layers.0` is `model.language_model.layers.0`; LLaVA's
`language_model.model.layers.0` is `model.language_model.layers.0`).
checkpoint_names.py already maps every checkpoint tensor to its model tensor
with transformers' own conversion list; a module's path follows from those
pairs:

    checkpoint `visual.blocks.0.attn.qkv.weight` -> model `model.visual.blocks.0.attn.qkv.weight`
    same tail `attn.qkv.weight`, so module `visual.blocks.0` -> `model.visual.blocks.0`

Each whole (unfused) tensor under the plan's module votes for the model path
that puts its tail at the same place; tensors whose tail was renamed too
(Mixtral's `block_sparse_moe` -> `mlp`) or fused (experts) do not vote. A
module whose tensors all disagree is reported, as is one with no voter that the
model does not have under the plan's own path.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from .names import Target


def module_paths(model: torch.nn.Module, targets: Iterable[Target], paths: Iterable[str]
                 ) -> tuple[dict[str, str], list[str]]:
    """The model's path for each of `paths` (checkpoint naming), and a problem line for each not found."""
    wanted = set(paths)
    votes: dict[str, set[str]] = {p: set() for p in wanted}
    for t in targets:
        for piece in t.pieces:
            if piece.index:
                continue  # a fused piece: its tail names no model tensor
            parts = piece.source.split(".")
            # the alias the source became: the longest common tail (a tied embedding is also `lm_head.weight`)
            tails = {a: _common_tail(parts, a.split(".")) for a in t.aliases}
            best = max(tails.values())
            for cut in range(len(parts) - 1, len(parts) - best - 1, -1):
                owner = ".".join(parts[:cut])
                if owner in wanted:
                    votes[owner].update(".".join(a.split(".")[:cut - len(parts)]) for a, k in tails.items()
                                        if k == best)
    found, problems = {}, []
    for path in sorted(wanted):
        ballot = votes[path]
        if len(ballot) == 1:
            found[path] = ballot.pop()
        elif ballot:
            problems.append(f"{path}: its tensors live in several modules of the model ({', '.join(sorted(ballot))})")
        elif _has(model, path):
            found[path] = path
        else:
            problems.append(f"{path}: the plan hooks this module, which the model does not have, and none of its "
                            "tensors maps to a module of the model")
    return found, problems


def _common_tail(a: list[str], b: list[str]) -> int:
    """How many trailing segments two names share."""
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


def _has(model: torch.nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True
