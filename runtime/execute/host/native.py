"""The host's native kernel (native.cpp) through ctypes: gated experts, bf16 or block-scaled FP8 (converted as read),
computed by its own threads, with no Python and no GIL in the way, so that a captured decode step runs it as a CUDA
host node.

    lib = native.library()               # None where it is not built (`why_not` says why)
    pool = native.Pool(lib, threads=15)  # its workers start; `pool.close()` joins them
    job = native.job(pool, module's host weights, on_cpu mask, x, ids, y, tokens, top_k)  # FP8: scales=, block=
    native.run(lib, job)                 # or, in a capture: cuLaunchHostFunc(stream, lib.offplan_run, job)
    job.error, job.calls, job.nanos

`Jobs` is the engine's (engine.py): its pool, and its jobs, kept alive as long as a captured graph may run them.

Why native: torch's own ops and an Inductor-compiled kernel were measured on the H200 machine's host
(docs/host-experts/README.md): 26-44 GB/s for a decode step's 8 experts, and at batch 1 a fixed cost of about
0.6 ms a call (the Python around the kernel, the hand-over to a Python worker, the waking of OpenMP's threads),
which made experts on cpu slower than reading them over the link. native.cpp reads each weight row once for
every token routed to its expert, with its threads kept spinning between a step's layers.

Built by `pip install -e .` (pyproject.toml's `[[tool.setuptools.ext-modules]]`, optional) as a plain shared
library with a C interface, loaded by path: it needs no Python headers at run time and no torch ABI. Where it is
not built (no C++ compiler at install), the engine's Python worker computes gated experts (engine.py, kernel.py),
and `plan apply` says so.
"""
from __future__ import annotations

import ctypes
import importlib.machinery
import weakref
from pathlib import Path

import torch

from .handoff import launch_host_func

_HERE = Path(__file__).resolve().parent
ISAS = ("plain C", "AVX2 + FMA", "AVX512-BF16")  # offplan_pool_isa's numbers
SPIN_US = 5000  # how long a worker spins for the next call before it sleeps: a decode step's layers come sooner


class Job(ctypes.Structure):
    """native.cpp's `Job`: one experts module's call (its fields, in its order)."""

    _fields_ = [("x", ctypes.c_void_p), ("ids", ctypes.c_void_p), ("y", ctypes.c_void_p),
                ("gate_up", ctypes.c_void_p), ("down", ctypes.c_void_p),
                ("gate_up_scale", ctypes.c_void_p), ("down_scale", ctypes.c_void_p), ("on_cpu", ctypes.c_void_p),
                ("pool", ctypes.c_void_p),
                ("tokens", ctypes.c_int64), ("top_k", ctypes.c_int64), ("hidden", ctypes.c_int64),
                ("inter", ctypes.c_int64), ("experts", ctypes.c_int64),
                ("format", ctypes.c_int64), ("block_rows", ctypes.c_int64), ("block_cols", ctypes.c_int64),
                ("calls", ctypes.c_int64), ("nanos", ctypes.c_int64),
                ("error", ctypes.c_int64), ("bad", ctypes.c_int64)]


why_not = ""  # why `library()` found none


def library():
    """The built library, loaded once per process; None where it is not built or cannot load (`why_not`)."""
    global _lib, why_not
    if _lib is not False:
        return _lib
    paths = [_HERE / f"_native{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES]
    found = [p for p in paths if p.exists()]
    _lib = None
    if not found:
        why_not = (f"the host kernel is not built ({paths[0].name} is not in {_HERE}): `pip install -e .` builds "
                   "it, with a C++ compiler")
        return None
    try:
        lib = ctypes.CDLL(str(found[0]))
    except OSError as e:
        why_not = f"the host kernel {found[0]} does not load: {e}"
        return None
    lib.offplan_pool_new.argtypes, lib.offplan_pool_new.restype = [ctypes.c_int, ctypes.c_int64], ctypes.c_void_p
    lib.offplan_pool_isa.argtypes, lib.offplan_pool_isa.restype = [ctypes.c_void_p, ctypes.c_int], ctypes.c_int
    lib.offplan_pool_free.argtypes, lib.offplan_pool_free.restype = [ctypes.c_void_p], None
    lib.offplan_run.argtypes, lib.offplan_run.restype = [ctypes.c_void_p], None  # ctypes releases the GIL
    _lib = lib
    return lib


_lib = False  # not looked for yet


class Pool:
    """native.cpp's thread pool: `threads` in all, the calling thread one of them."""

    def __init__(self, lib, threads: int, spin_us: int = SPIN_US):
        self.lib = lib
        self.threads = threads
        self.handle = lib.offplan_pool_new(threads, spin_us)
        self._free = weakref.finalize(self, lib.offplan_pool_free, self.handle)  # once, by close or collection

    def isa(self, force: int = -1) -> str:
        """The dot product's instruction set (ISAS), or `force` it (tests); a set the CPU lacks is refused."""
        got = self.lib.offplan_pool_isa(self.handle, force)
        if got < 0:
            raise ValueError(f"offplan: this CPU cannot run the host kernel's {ISAS[force]} path")
        return ISAS[got]

    def close(self) -> None:
        """Join the workers: no job may run on the pool after this."""
        self._free()
        self.handle = None


def job(pool: Pool, gate_up, down, on_cpu, x, ids, y, tokens: int, top_k: int, scales=None,
        block: tuple[int, int] = (0, 0)) -> Job:
    """A call of one experts module over `tokens` tokens: gate_up [E, 2I, H], down [E, H, I] bf16 (host tensors),
    or FP8 E4M3 with `scales` (gate_up's [E, ceil(2I/b0), ceil(H/b1)], down's [E, ceil(H/b0), ceil(I/b1)] f32)
    one per `block` (b0, b1) of elements (native.cpp computes dequant.py's values from them); on_cpu [E] uint8,
    x [>=T, H], ids [>=T*k] int64, y [>=T*k, H] bf16 (the exchange buffers); each tensor contiguous and kept
    alive by the caller for the job's life. A shape or dtype native.cpp would misread is a ValueError."""
    experts, double, hidden = gate_up.shape
    fp8 = gate_up.dtype == torch.float8_e4m3fn
    if down.dtype != gate_up.dtype or not (fp8 or gate_up.dtype == torch.bfloat16) or (scales is None) == fp8:
        raise ValueError(f"offplan: the host kernel takes bf16 experts, or FP8 E4M3 ones with their scales: got "
                         f"{gate_up.dtype} and {down.dtype}, {'with' if scales is not None else 'without'} scales")
    if fp8:
        b0, b1 = block
        want = [(experts, -(-double // b0), -(-hidden // b1)), (experts, -(-hidden // b0), -(-(double // 2) // b1))]
        got = [tuple(s.shape) for s in scales]
        if b0 < 1 or b1 < 1 or got != want or any(s.dtype != torch.float32 for s in scales):
            raise ValueError(f"offplan: FP8 experts' scales {got} are not their {block} block scales {want} (f32)")
    gate_up_scale, down_scale = (s.data_ptr() for s in scales) if fp8 else (None, None)
    return Job(x=x.data_ptr(), ids=ids.data_ptr(), y=y.data_ptr(), gate_up=gate_up.data_ptr(),
               down=down.data_ptr(), gate_up_scale=gate_up_scale, down_scale=down_scale, on_cpu=on_cpu.data_ptr(),
               pool=pool.handle, tokens=tokens, top_k=top_k, hidden=hidden, inter=double // 2, experts=experts,
               format=int(fp8), block_rows=block[0] if fp8 else 0, block_cols=block[1] if fp8 else 0)


def run(lib, job: Job) -> None:
    """The job, by this thread and the pool's (the GIL released meanwhile)."""
    lib.offplan_run(ctypes.byref(job))


def address(lib) -> int:
    """`offplan_run`'s address: a CUDA host function."""
    return ctypes.cast(lib.offplan_run, ctypes.c_void_p).value


class Jobs:
    """An engine's pool and jobs: a captured call's each (its graph's host node points at it), and the eager
    calls' own, one per (module, tokens) (module doc)."""

    def __init__(self, lib, threads: int):
        self.lib = lib
        self.pool = Pool(lib, threads)
        self._captured: list[Job] = []
        self._eager: dict[tuple[int, int], Job] = {}

    def capture(self, stream: int, job: Job) -> None:
        """`job` as a host function on CUDA stream `stream` (a host node in the graph being captured)."""
        self._captured.append(job)
        launch_host_func(stream, address(self.lib), ctypes.addressof(job))

    def run(self, key: tuple[int, int], make) -> None:
        """The eager call `key` (module, tokens) on this thread, its job made by `make()` the first time."""
        run(self.lib, self._eager_job(key, make))

    def enqueue(self, stream: int, key: tuple[int, int], make) -> None:
        """The eager call `key` as a host function on CUDA stream `stream` (one job per key: the stream runs a
        key's calls one after another, so they may share it)."""
        launch_host_func(stream, address(self.lib), ctypes.addressof(self._eager_job(key, make)))

    def _eager_job(self, key: tuple[int, int], make) -> Job:
        job = self._eager.get(key)
        if job is None:
            job = self._eager[key] = make()
        return job

    def all(self) -> list[Job]:
        return self._captured + list(self._eager.values())

    def times(self, out: dict[int, tuple[int, float]]) -> None:
        """Add each job's (calls, seconds) to `out`'s entry for its token count."""
        for job in self.all():
            calls, seconds = out.get(job.tokens, (0, 0.0))
            out[job.tokens] = (calls + job.calls, seconds + job.nanos * 1e-9)

    def error(self) -> Exception | None:
        """The first failed job's error, every job's flag cleared."""
        error = None
        for job in self.all():
            if job.error:
                job.error = 0
                error = error or IndexError(f"a pair was routed to expert {job.bad}, not one of the module's "
                                            f"{job.experts}")
        return error

    def close(self) -> None:
        """Join the pool's threads; no job may run after this (no graph captured over them be replayed)."""
        self.pool.close()
        self._captured, self._eager = [], {}
