"""Experts on cpu: the host CPU computes the plan's cpu experts for the tokens routed to them, beside the GPU.

At an experts module with experts on cpu (experts.py), a forward of T tokens
with top-k routing, T <= `max_tokens`:

1. `begin`: the tokens' activations [T, H] and routed experts [T*k] are copied
   into pinned memory (by the copy engine);
2. the GPU computes its own pairs (experts on the GPU or on uva) meanwhile; it
   reads no row of an expert on cpu (experts.py leaves them out of its gather);
3. the host computes, for each (token, expert) pair whose expert is on cpu,
   that expert's output for that token (host_kernel.py, the rounding of
   batched_mm's GEMVs) into pinned memory `y` [T*k, H], reading the expert's
   rows where the arena holds them;
4. `end`: `y` is copied to the GPU (T*k*H*2 bytes, 32 KiB a token at
   Qwen3-30B-A3B's shape), and per pair the GPU takes the host's output where
   the expert is on cpu and its own elsewhere (`torch.where`); the module then
   weights and sums the pairs as batched_mm does. (An earlier version wrote and
   read the pinned buffers in place through zero-copy views, and failed the
   same way: see ../README.md.)

How the GPU hands the work to the host and takes it back:
- in a step captured in a CUDA graph (decode's fast path): on a side stream
  forked from the current one, the two copies, then a host node
  (`cuLaunchHostFunc`) that runs step 3, then the copy of `y`; the current
  stream joins the side stream before step 4's `where`. The GPU's experts run on the current stream in
  between, so the two sides overlap, and a replay needs no Python thread of
  ours: the driver calls the host function once the copies land. A host node
  rather than a worker thread polling a flag in pinned memory: it keeps no
  core spinning (the host's cores are what this placement spends), needs no
  spinning GPU kernel, and is the mechanism CUDA graphs have for this. Its
  cost is the driver's callback latency plus ours in Python, measured per
  layer by benchmarks/host_experts.py. The host function takes the GIL, so
  the generator synchronizes after each replayed step rather than queueing
  steps ahead from Python (generation.py);
- eager on CUDA: the copies on the side stream; `end`, called once the GPU's
  experts are enqueued, waits for the copies and has the engine's worker
  thread run step 3 while the GPU computes (a host function would wait for
  the GIL that this launching thread holds). The worker, like the host
  function's thread, is the engine's: the kernel runs there as it was
  compiled, not in the custom op's dispatch state (host_kernel.py);
- on the CPU: step 3 on the worker, through the same buffers (plain memory).

Above `max_tokens` tokens (a long prompt) the host computes nothing: the GPU
reads those experts as it reads uva ones (experts.py). `max_tokens` is the
plan's prefill threshold, above which a GEMM on the GPU over copied weights
beats a GEMV per pair on the host.

A failure in the host function (which CUDA cannot report) fills `y` with NaN,
so the step's outputs show it, and `end` or `check` raises it.

Lifecycle: `HostExperts(...)` -> `kernel.start` (compiling while the load runs)
-> `add` per module -> `finish` (the exchange buffers) -> `ready` -> forwards -> `close`.
"""
from __future__ import annotations

import ctypes
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..place.arena import PinnedArena, align, typed
from . import ops
from .host_kernel import Kernel


@dataclass(frozen=True)
class HostSlot:
    """What an experts module with experts on cpu carries (`module._offplan_host`, set by load_steps.py):
    its engine, the engine's key for the custom ops, and its index there."""

    engine: "HostExperts"
    key: int
    index: int


@dataclass
class _Module:
    module: torch.nn.Module
    weights: dict[str, torch.Tensor]  # fused parameter -> its host tensor (the arena's CPU view)
    on_cpu: torch.Tensor  # [E] bool, CPU: experts the host computes
    on_cpu_device: torch.Tensor  # the same on the model's device
    top_k: int
    gated: bool  # the compiled kernel computes it (`gated_like`)


class HostExperts:
    """The experts that the plan puts on cpu, for every experts module that has some (module doc)."""

    def __init__(self, device: torch.device, threads: int, max_tokens: int, compile: bool = True):
        self.device = device
        self.cuda = device.type == "cuda"
        self.threads = threads
        self.max_tokens = max_tokens
        self.kernel = Kernel(threads, compile)
        self.modules: list[_Module] = []
        self.key = ops.register(self)
        self.error: BaseException | None = None
        self.host_calls = 0  # step 3 runs, for tests and benchmarks
        self.host_seconds = 0.0  # their time in the host's thread
        self.durations: list[float] = []  # each one's (the first 100k), for benchmarks
        self._calls: dict[int, tuple[int, int]] = {}  # a captured host node's id -> (module, tokens)
        self._arena: PinnedArena | None = None
        self._stream = self._event = self._hostfn = self._launch = None
        self._worker: ThreadPoolExecutor | None = None

    def add(self, module: torch.nn.Module, weights: dict[str, torch.Tensor], on_cpu: list[int], top_k: int) -> int:
        """Register an experts module; `weights`: its fused parameters' host tensors (pinned arena views).
        Returns its index, which its forward passes to `ops.host_begin` / `host_end`."""
        mask = torch.zeros(module.num_experts, dtype=torch.bool)
        mask[on_cpu] = True
        self.modules.append(_Module(module, weights, mask, mask.to(self.device), top_k, gated_like(module)))
        return len(self.modules) - 1

    def finish(self) -> None:
        """The exchange buffers, sized for `max_tokens` tokens of the widest module."""
        hidden = max(_hidden(m) for m in self.modules)
        pairs = self.max_tokens * max(m.top_k for m in self.modules)
        dtype = next(iter(self.modules[0].weights.values())).dtype
        sizes = [self.max_tokens * hidden * dtype.itemsize, pairs * 8, pairs * hidden * dtype.itemsize]
        offsets = [0, align(sizes[0]), align(sizes[0]) + align(sizes[1])]
        self._arena = PinnedArena(offsets[2] + sizes[2], cuda=self.cuda, device=self.device)
        self._views = {}
        for name, offset, size, d, shape in (("x", offsets[0], sizes[0], dtype, (self.max_tokens, hidden)),
                                             ("ids", offsets[1], sizes[1], torch.long, (pairs,)),
                                             ("y", offsets[2], sizes[2], dtype, (pairs, hidden))):
            self._views[name] = (typed(self._arena.host_view(offset, size), d, shape),
                                 typed(self._arena.device_view(offset, size), d, shape))
        if self.cuda:
            self._y = torch.empty((pairs, hidden), dtype=dtype, device=self.device)  # the host's outputs, copied in
            self._stream = torch.cuda.Stream(self.device)
            self._event = torch.cuda.Event()
            self._launch, self._hostfn = _host_function(self._host_node)

    def ready(self) -> None:
        """Wait for the kernel's compile (host_kernel.py)."""
        self.kernel.ready()

    def takes(self, tokens: int) -> bool:
        """Whether the host computes a forward of `tokens` tokens (module doc)."""
        return tokens <= self.max_tokens

    # ------------------------------------------------------------------ the forward's two halves

    def begin(self, index: int, x: torch.Tensor, ids: torch.Tensor) -> None:
        """Step 1 (and, in a capture, step 3's host node). x [T, H], ids [T*k]."""
        if not self.cuda:
            return
        tokens = x.shape[0]
        stream = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(stream)
        with torch.cuda.stream(self._stream):
            self._views["x"][0][:tokens].copy_(x, non_blocking=True)  # copies by the copy engine (memcpy)
            self._views["ids"][0][:ids.numel()].copy_(ids, non_blocking=True)
            if torch.cuda.is_current_stream_capturing():
                call = len(self._calls) + 1
                self._calls[call] = (index, tokens)
                self._launch(self._stream.cuda_stream, call)
                self._y[:ids.numel()].copy_(self._views["y"][0][:ids.numel()], non_blocking=True)

    def end(self, index: int, out: torch.Tensor, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Step 3 where it runs in this thread, then step 4: out [T*k, H], the GPU's pair outputs."""
        self.check()
        tokens, pairs = x.shape[0], ids.numel()
        m = self.modules[index]
        host_x, host_ids, host_y = (self._views[n][0] for n in ("x", "ids", "y"))
        if not self.cuda:  # through the same buffers: the compiled kernel sees the tensors it was compiled for
            host_x[:tokens].copy_(x)
            host_ids[:pairs].copy_(ids)
            self._on_worker(m, host_x[:tokens], host_ids[:pairs], host_y[:pairs])
            return torch.where(m.on_cpu[ids].unsqueeze(1), host_y[:pairs], out)
        stream = torch.cuda.current_stream(self.device)
        if not torch.cuda.is_current_stream_capturing():
            self._event.record(self._stream)
            self._event.synchronize()
            self._on_worker(m, host_x[:tokens], host_ids[:pairs], host_y[:pairs])
            with torch.cuda.stream(self._stream):
                self._y[:pairs].copy_(host_y[:pairs], non_blocking=True)
        stream.wait_stream(self._stream)
        return torch.where(m.on_cpu_device[ids].unsqueeze(1), self._y[:pairs], out)

    def check(self) -> None:
        """Raise the error of a host function that failed (module doc)."""
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError(f"offplan: computing experts on the host CPU failed: {error!r}") from error

    # ------------------------------------------------------------------ step 3

    def _on_worker(self, m: _Module, x: torch.Tensor, ids: torch.Tensor, y: torch.Tensor) -> None:
        """Step 3 on the engine's worker thread, this one waiting (the GIL released): there the kernel runs as
        in a host function, on a thread of the engine's, not in this custom op's dispatch state (host_kernel.py)."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="offplan-host-experts",
                                              initializer=self.kernel.own)
        self._worker.submit(self._compute, m, x, ids, y).result()

    def _host_node(self, call: int) -> None:
        self.kernel.own()
        index, tokens = self._calls[call]
        m = self.modules[index]
        pairs = tokens * m.top_k
        host_x, host_ids, host_y = (self._views[n][0] for n in ("x", "ids", "y"))
        try:
            self._compute(m, host_x[:tokens], host_ids[:pairs], host_y[:pairs])
        except BaseException as e:  # noqa: BLE001 - CUDA cannot take it: the outputs show it, `check` raises it
            self.error = e
            host_y[:pairs].fill_(float("nan"))

    def _compute(self, m: _Module, x: torch.Tensor, ids: torch.Tensor, y: torch.Tensor) -> None:
        """y[p] = expert ids[p]'s output for token p // k, for each pair p whose expert is on cpu."""
        self.host_calls += 1
        start = time.perf_counter()
        try:
            self._pairs(m, x, ids, y)
        finally:
            took = time.perf_counter() - start
            self.host_seconds += took
            if len(self.durations) < 100_000:
                self.durations.append(took)

    def _pairs(self, m: _Module, x: torch.Tensor, ids: torch.Tensor, y: torch.Tensor) -> None:
        with torch.no_grad():
            pairs = m.on_cpu[ids].nonzero().squeeze(1)
            if pairs.numel() == 0:
                return
            experts = ids.index_select(0, pairs)
            tokens = pairs // m.top_k
            module = m.module
            if m.gated:
                out = self.kernel.gated(x, tokens, m.weights["gate_up_proj"], m.weights["down_proj"], experts)
            else:  # another gate, transposed or with biases: batched_mm's steps, one projection at a time
                first = "gate_up_proj" if module.has_gate else "up_proj"
                up = self.kernel.project(x.index_select(0, tokens), m.weights[first], experts, module.is_transposed)
                if module.has_bias:
                    up = up + m.weights[f"{first}_bias"].index_select(0, experts)
                up = module._apply_gate(up) if module.has_gate else module.act_fn(up)
                out = self.kernel.project(up, m.weights["down_proj"], experts, module.is_transposed)
                if module.has_bias:
                    out = out + m.weights["down_proj_bias"].index_select(0, experts)
            y.index_copy_(0, pairs, out.to(y.dtype))

    def close(self) -> None:
        """Drop the buffers; a graph captured over them must not be replayed after this."""
        self._calls.clear()
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None
        self._views = {}
        if self._arena is not None:
            self._arena.release()
            self._arena = None
        self.modules = []


def gated_like(module: torch.nn.Module) -> bool:
    """Whether the compiled kernel computes `module`'s experts (host_kernel.py `gated`): fused gate and up rows,
    not transposed, no biases, and a gate that is silu(first half) * second half, as its own `_apply_gate`
    computes on a test row."""
    if not module.has_gate or module.is_transposed or module.has_bias:
        return False
    u = torch.linspace(-4, 4, 24, dtype=torch.bfloat16).view(2, 12)
    gate, up = u.chunk(2, dim=-1)
    try:
        return torch.equal(module._apply_gate(u), torch.nn.functional.silu(gate) * up)
    except Exception:  # noqa: BLE001 - a gate that cannot run on a test row is not this one
        return False


def _hidden(m: _Module) -> int:
    w = m.weights["down_proj"]  # [E, H, I] ([E, I, H] transposed)
    return w.shape[-1] if m.module.is_transposed else w.shape[-2]


def _host_function(fn):
    """(launch(stream, call), the C callback): `launch` enqueues `fn(call)` on a CUDA stream as a host function
    (the driver's `cuLaunchHostFunc`: a host node when the stream is being captured). The callback must outlive
    every graph that holds it: the engine keeps it."""
    driver = ctypes.CDLL("libcuda.so.1")
    prototype = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
    driver.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, prototype, ctypes.c_void_p]
    driver.cuLaunchHostFunc.restype = ctypes.c_int
    callback = prototype(lambda data: fn(int(data or 0)))

    def launch(stream: int, call: int) -> None:
        status = driver.cuLaunchHostFunc(stream, callback, call)
        if status != 0:
            raise RuntimeError(f"offplan: cuLaunchHostFunc failed (CUresult {status})")

    return launch, callback
