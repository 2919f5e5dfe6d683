"""One process per GPU for a tensor-parallel plan: started here, or by torchrun.

`run_ranks(fn, gpus, ...)` starts `gpus` processes (spawned: a fresh
interpreter each, as CUDA requires), initializes torch.distributed in each
(NCCL between GPUs, process `r` on `cuda:r`; gloo on the CPU) over a TCP
rendezvous on a free local port, runs `fn(rank, *args)` in each and returns
every rank's result, in rank order. A rank that raises ends the run: its
error comes back to the caller, an `OffplanError` (a problem the user can fix)
as itself, anything else with its traceback.

`from_torchrun()` says whether torchrun started this process (its
environment: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), the one
place offplan reads them; `init_from_torchrun` then joins the group.

The processes inherit the environment, so NCCL settings made before the call
hold in every rank.
"""
from __future__ import annotations

import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import torch

from planner.errors import InputError, OffplanError

TIMEOUT = timedelta(minutes=10)  # a rank that waits longer than this for the others fails instead of hanging


def available_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_gpus(gpus: int) -> None:
    """Refuse, before anything is started or loaded, a plan that needs more GPUs than this machine has."""
    have = available_gpus()
    if gpus > have:
        raise OffplanError(f"the plan needs {gpus} GPUs (parallel.gpus: {gpus}), one per process, but this machine "
                           f"has {have}: rebuild it with `gpus: {have}` in its policy" if have > 1 else
                           f"the plan needs {gpus} GPUs (parallel.gpus: {gpus}), one per process, but this machine "
                           f"has {have}: rebuild it for one GPU (no `gpus:` in its policy), or run it on the CPU "
                           "(--device cpu)")


def from_torchrun() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when torchrun started this process, else None."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))


def init_from_torchrun(device: str) -> int:
    """Join torchrun's process group (env:// rendezvous); returns this process's rank."""
    import torch.distributed as dist
    rank, world, local = from_torchrun()
    if device == "cuda":
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world,
                                timeout=TIMEOUT, **({"device_id": torch.device("cuda", local)}
                                                    if device == "cuda" else {}))
    return rank


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads_per_rank(ranks: int) -> int:
    """The CPU threads each of `ranks` processes on this host may use: OMP_NUM_THREADS where the user set it,
    else the cores shared out. Each process would otherwise start one torch thread per core, and the ranks'
    threads, oversubscribing the cores, spin against each other in every parallel copy of the load
    (measured on 2 CPUs, 2 ranks loading their shares of 2 Qwen3-30B-A3B layers: 15.7 s each with 2 threads
    per rank, 7.6 s with 1). torchrun sets OMP_NUM_THREADS=1 for the same reason."""
    if os.environ.get("OMP_NUM_THREADS"):
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    return max(1, (os.cpu_count() or 1) // ranks)


def _rank(rank: int, gpus: int, port: int, device: str, fn: Callable, args: tuple, results) -> None:
    import torch.distributed as dist
    try:
        torch.set_num_threads(threads_per_rank(gpus))
        if device == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=gpus, timeout=TIMEOUT,
                                **({"device_id": torch.device("cuda", rank)} if device == "cuda" else {}))
        out = ("ok", fn(rank, *args))
    except OffplanError as e:
        out = ("offplan", (type(e), str(e), getattr(e, "headline", None), getattr(e, "problems", None)))
    except BaseException:  # a bug: its traceback goes to the caller
        out = ("bug", traceback.format_exc())
    try:  # by value: torch's queue pickler would hand tensors over in shared memory, gone with this process
        results.put(pickle.dumps((rank, *out)))
    finally:
        if dist.is_initialized():
            if out[0] == "ok":
                dist.barrier()
            dist.destroy_process_group()


def run_ranks(fn: Callable, gpus: int, *args, device: str = "cuda") -> list:
    """`fn(rank, *args)` in `gpus` processes with torch.distributed initialized (module doc); every rank's
    result in rank order. `fn` and `args` must be picklable (a module-level function)."""
    if device == "cuda":
        check_gpus(gpus)
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, gpus, port, device, fn, args, results), daemon=False)
             for r in range(gpus)]
    for p in procs:
        p.start()
    got: dict[int, tuple] = {}
    failed = None
    while len(got) < gpus:
        if results.empty() and not any(p.is_alive() for p in procs):
            failed = failed or ("bug", "a rank ended without a result (killed, or out of memory?)")
            break
        if results.empty():
            time.sleep(0.05)
            continue
        rank, kind, value = pickle.loads(results.get())
        got[rank] = (kind, value)
        if kind != "ok" and failed is None:
            failed = (kind, value)
            for p in procs:  # the others may wait for the failed rank in a collective: end them
                if p.is_alive() and p.pid != procs[rank].pid:
                    p.terminate()
            break
    for p in procs:  # a rank that has put its result but hangs on its way out is ended
        p.join(15)
        if p.is_alive():
            p.kill()
    if failed is not None:
        kind, value = failed
        if kind == "offplan":
            cls, message, headline, problems = value
            err = cls.__new__(cls)
            Exception.__init__(err, message)
            if issubclass(cls, InputError):
                err.headline, err.problems = headline, problems
            raise err
        raise RuntimeError(f"a rank of the tensor-parallel run failed:\n{value}")
    return [got[r][1] for r in range(gpus)]
