"""`plan apply` of a tensor-parallel plan: one process per GPU, each loading its share and generating.

The plan's `parallel.gpus` processes are started here (runtime/distributed/launch.py),
or by torchrun (`torchrun --nproc-per-node 2 -m offplan apply PLAN`: each
process then joins torchrun's group). Every process loads its share of the
checkpoint and runs the same generation; the report is rank 0's, with each
GPU's resident bytes and load peak (their shares are alike, their peaks may
differ), and the tokens, which every rank picks alike.
"""
from __future__ import annotations

import json

import torch

from planner.errors import StalePlanError
from planner.units import human
from runtime.distributed.launch import from_torchrun, init_from_torchrun, run_ranks


def apply_parallel(req, planned: int, asked: int | None, apply_one) -> str:
    """Run `req` (running.py's Request) over the plan's `planned` GPUs with `apply_one(req, rank)` in each
    process (running.py's: a module-level function, as the processes need); `asked`: `--gpus`, which must agree."""
    if asked is not None and asked != planned:
        what = "one GPU (no parallel: section)" if planned == 1 else f"{planned} GPUs (parallel.gpus: {planned})"
        raise StalePlanError(f"--gpus {asked}: the plan was built for {what}; rebuild it with `gpus: {asked}` in "
                             "its policy, or leave --gpus out")
    if planned == 1:
        return apply_one(req)
    device = req.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if from_torchrun() is not None:
        rank = init_from_torchrun(device)
        out = _rank(rank, req, apply_one)
        return _joined([out]) if rank == 0 else ""
    return _joined(run_ranks(_rank, planned, req, apply_one, device=device))


def _rank(rank: int, req, apply_one) -> tuple[str, dict]:
    """One process of the run: rank 0's report, and every rank's own figures."""
    out = apply_one(req, rank)
    mine = {"rank": rank}
    if torch.cuda.is_available() and req.device != "cpu":
        mine["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    return (out if rank == 0 else ""), mine


def _joined(results: list[tuple[str, dict]]) -> str:
    text, _ = results[0]
    ranks = [r for _, r in results]
    if text.startswith("{"):
        got = json.loads(text)
        got["ranks"] = ranks
        return json.dumps(got, indent=2)
    lines = [text]
    if all("peak_gpu_bytes" in r for r in ranks):
        lines.append("  peak GPU memory per process: " + ", ".join(
            f"GPU {r['rank']} {human(r['peak_gpu_bytes'])}" for r in ranks))
    return "\n".join(lines)
