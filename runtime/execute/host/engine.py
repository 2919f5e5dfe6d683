"""Experts on cpu: the host CPU computes the plan's cpu experts for the tokens routed to them, beside the GPU.

At an experts module with experts on cpu (experts.py), a forward of T tokens with top-k routing, T <= `max_tokens`:

1. `begin`: the tokens' activations [T, H] and routed experts [T*k] are copied into pinned memory (copy engine);
2. the GPU computes its own pairs (experts on the GPU or on uva) meanwhile, gathering no row of an expert on cpu;
3. the host computes, for each (token, expert) pair whose expert is on cpu, that expert's output for that token (the
   rounding of batched_mm's GEMVs) into pinned memory `y` [T*k, H], reading the expert's rows where the arena holds
   them;
4. `end`: `y` is copied to the GPU (T*k*H*2 bytes, 32 KiB a token at Qwen3-30B-A3B's shape), and per pair the GPU
   takes the host's output where the expert is on cpu and its own elsewhere (`torch.where`); the module then weights
   and sums the pairs as batched_mm does.

Who computes step 3 (module.py): native.cpp, for gated experts (Qwen3-MoE, Mixtral, DeepSeek, Qwen2-MoE), bf16 or
block-scaled FP8, where it is built: a C function over its own threads, which needs no GIL; otherwise the engine's
own Python thread (its worker, kernel.py: Inductor's kernel or the eager loop; never FP8), woken and awaited through
two barriers (handoff.py). How the GPU hands the work over:
- in a step captured in a CUDA graph (decode's fast path): on a side stream forked from the current one, the two
  copies, then one host node, then the copy of `y`; the current stream joins the side stream before step 4's
  `where`. The GPU's experts run on the current stream in between, so the two sides overlap. The host node is
  native.cpp's `offplan_run` itself, with the call's job (native.py `Job`) as its argument. For the worker it is a
  copy of the call's number into pinned memory and two host nodes, libc's barrier wait itself (the first wakes the
  worker, the second holds the side stream until it is done); the worker needs the GIL, so the generator keeps at
  most two replays in flight and sleeps otherwise (generation.py). Why host nodes: a CUDA graph replays them with no
  Python; a GPU kernel spinning on a flag in pinned memory would hold an SM for the whole wait. Why native: native.py,
  and a host node running the kernel in Python took 1.58x the main thread's time (docs/host-experts);
- eager on CUDA, native.cpp's modules: as in a capture, the job a host function on the side stream (one job per
  (module, token count), which the stream's calls share one after another), so the Python thread never waits for
  the host: it goes on launching the step's kernels, as a replay would;
- eager on CUDA, the worker's modules: the copies on the side stream; `end`, called once the GPU's experts are
  enqueued, waits for the copies, meets the barriers (the host computes meanwhile, while the GPU computes its own
  pairs), then copies `y` in on the side stream;
- on the CPU: `end` does the same through the same buffers in plain memory.

Above `max_tokens` tokens (a long prompt) the host computes nothing: the GPU reads those experts as it reads uva
ones (experts.py). `max_tokens` is the plan's prefill threshold, above which a GEMM on the GPU over copied weights
beats a GEMV per pair on the host.

A failure on the host (which a host function cannot report) fills `y` with NaN, so the step's outputs show it, and
a later `end` or `check` raises it: in the worker, any exception; in native.cpp, a pair routed to no expert. One
stream at a time hands work over: the buffers and the barriers are the engine's one set, so an eager forward on
another stream while a replay's host nodes wait would meet the driver's thread instead of the worker.

The worker holds the engine weakly: an engine dropped without `close` (its model and handle dropped) stops its
worker, and its pool's threads, as it is collected.

Lifecycle: `HostExperts(...)` -> `kernel.start` (compiling, where the worker computes gated experts, while the load
runs) -> `add` per module -> `finish` (the exchange buffers, native.cpp's pool, the worker where one is needed) ->
`ready` -> forwards -> `close` (both stopped: no graph captured over the engine may be replayed after it)."""
from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass

import torch

from ...place.arena import PinnedArena, named_views
from .. import ops
from . import native
from .handoff import Handoff, serve, stop
from .kernel import Kernel, gated_like
from .module import HostModule, computed_natively

_EAGER = -1  # the call slot's value for `end`'s own call, besides a captured call's number (1, 2, ...) and STOP
MAX_CALLS = 1 << 14  # captured calls over the engine's life: host modules x captured steps


@dataclass(frozen=True)
class HostSlot:
    """What an experts module with experts on cpu carries (`module._offplan_host`, set by bind.py):
    its engine, the engine's key for the custom ops, and its index there."""

    engine: "HostExperts"
    key: int
    index: int


class HostExperts:
    """The experts that the plan puts on cpu, for every experts module that has some (module doc)."""

    def __init__(self, device: torch.device, threads: int, max_tokens: int, compile: bool = True):
        self.device, self.cuda = device, device.type == "cuda"
        self.threads, self.max_tokens = threads, max_tokens
        self.kernel = Kernel(threads, compile)
        self.modules: list[HostModule] = []
        self.key = ops.register(self)
        self.lib = native.library()  # None where it is not built: every module through the worker
        self.native: native.Jobs | None = None  # native.cpp's pool and jobs, where it computes some module
        self.error: BaseException | None = None
        self._times: dict[int, tuple[int, float]] = {}  # the worker's: `times`
        self._calls: dict[int, tuple[int, int]] = {}  # a captured call's number -> (module, tokens)
        self._eager = (0, 0)  # the (module, tokens) of the call `end` hands over itself
        self._arena: PinnedArena | None = None
        self._by_size: dict[tuple[int, int], tuple] = {}  # `_sized`'s views
        self._stream = self._event = self._copied = None
        self._handoff, self._worker = None, None  # Handoff, threading.Thread: where the worker computes some module

    def add(self, module: torch.nn.Module, weights: dict[str, torch.Tensor], on_cpu: list[int], top_k: int,
            fp8: tuple[dict[str, torch.Tensor], tuple[int, int], torch.dtype] | None = None) -> int:
        """Register an experts module; `weights`: its fused parameters' host tensors (pinned arena views); `fp8`
        for block-scaled FP8 ones: (their scales' host tensors by fused parameter, the block, the model's dtype),
        which native.cpp computes (module.py). Returns its index, which its forward passes to `begin` / `end`."""
        mask = torch.zeros(module.num_experts, dtype=torch.bool)
        mask[on_cpu] = True
        gated = gated_like(module)
        fast = computed_natively(self.lib, gated, weights, fp8 is not None)
        if fp8 is not None and not fast:  # bind.py `check` refuses these before the load
            raise RuntimeError("offplan: FP8 experts on cpu that native.cpp does not compute reached the engine")
        scales, block, dtype = fp8 if fp8 is not None else ({}, (0, 0), weights["down_proj"].dtype)
        self.modules.append(HostModule(module, weights, mask, mask.to(self.device), top_k, gated, fast,
                                       mask.to(torch.uint8), dtype, scales, block))
        return len(self.modules) - 1

    def finish(self) -> None:
        """The exchange buffers, sized for `max_tokens` tokens of the widest module, and the worker."""
        hidden = max(m.hidden for m in self.modules)
        pairs = self.max_tokens * max(m.top_k for m in self.modules)
        dtype = self.modules[0].dtype
        layout = (("x", dtype, (self.max_tokens, hidden)), ("ids", torch.long, (pairs,)),
                  ("y", dtype, (pairs, hidden)), ("call", torch.long, (1,)))
        self._arena, self._views = named_views(layout, self.cuda, self.device)
        if self.cuda:
            self._y = torch.empty((pairs, hidden), dtype=dtype, device=self.device)  # the host's outputs, copied in
            self._numbers = torch.arange(MAX_CALLS, device=self.device)  # a captured call copies its own
            self._stream = torch.cuda.Stream(self.device)
            self._event, self._copied = torch.cuda.Event(), torch.cuda.Event()
        if any(m.native for m in self.modules):
            self.native = native.Jobs(self.lib, self.threads)
        if all(m.native for m in self.modules):
            return  # native.cpp computes every module: no worker
        self._handoff = Handoff()
        self._worker = threading.Thread(target=serve, args=(weakref.ref(self), self._handoff, self._views["call"]),
                                        name="offplan-host-experts", daemon=True)
        self._worker.start()
        self._stop = weakref.finalize(self, stop, self._worker, self._handoff, self._views["call"])

    def ready(self) -> None:
        """Wait for the kernel's compile (kernel.py)."""
        self.kernel.ready()

    def takes(self, tokens: int) -> bool:
        """Whether the host computes a forward of `tokens` tokens (module doc)."""
        return tokens <= self.max_tokens

    # ------------------------------------------------------------------ the forward's two halves

    def begin(self, index: int, x: torch.Tensor, ids: torch.Tensor) -> None:
        """Step 1 (and, in a capture, the hand-over to the worker and the copy back). x [T, H], ids [T*k]."""
        if not self.cuda:
            return
        tokens, pairs = x.shape[0], ids.numel()
        host_x, host_ids, host_y, y = self._sized(tokens, pairs)
        fast = self.modules[index].native
        capturing = torch.cuda.is_current_stream_capturing()
        if capturing and not fast and len(self._calls) + 1 >= MAX_CALLS:  # before anything is enqueued
            raise RuntimeError(f"offplan: more than {MAX_CALLS - 1} captured calls of experts on cpu: capture "
                               "fewer steps, or remove the handle and load again")
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            host_x.copy_(x, non_blocking=True)  # copies by the copy engine (memcpy)
            host_ids.copy_(ids, non_blocking=True)
            self._copied.record(self._stream)
            if fast:  # native.cpp itself is the host function (node): no worker, no GIL, no wait in Python
                self._enqueue(index, tokens, capturing)
            elif capturing:
                call = len(self._calls) + 1
                self._calls[call] = (index, tokens)
                self._views["call"].copy_(self._numbers[call:call + 1], non_blocking=True)
                self._handoff.enqueue(self._stream.cuda_stream)
            if fast or capturing:
                y.copy_(host_y, non_blocking=True)
        # the GPU's experts after the copies: else its gathers, which fill the SMs, can hold the copies (and the
        # host's start) back until they end
        current.wait_event(self._copied)

    def end(self, index: int, out: torch.Tensor, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Step 3 handed to the worker here (eagerly), then step 4: out [T*k, H], the GPU's pair outputs."""
        self.check()
        tokens, pairs = x.shape[0], ids.numel()
        host_x, host_ids, host_y, y = self._sized(tokens, pairs)
        m = self.modules[index]
        if not self.cuda:  # through the same buffers: the compiled kernel sees the tensors it was compiled for
            host_x.copy_(x)
            host_ids.copy_(ids)
            self._hand_over(index, tokens)
            return torch.where(m.on_cpu[ids].unsqueeze(1), host_y, out)
        if not m.native and not torch.cuda.is_current_stream_capturing():  # the worker, eagerly
            self._event.record(self._stream)
            self._event.synchronize()
            self._hand_over(index, tokens)
            with torch.cuda.stream(self._stream):
                y.copy_(host_y, non_blocking=True)
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        return torch.where(m.on_cpu_device[ids].unsqueeze(1), y, out)

    def _sized(self, tokens: int, pairs: int) -> tuple:
        """The exchange buffers' views for a call of `tokens` tokens and `pairs` pairs: the host's x, ids, y, and
        y's copy on the GPU (None on the CPU), sliced once per size: an eager step's pace is its Python's."""
        got = self._by_size.get((tokens, pairs))
        if got is None:
            v = self._views
            got = self._by_size[tokens, pairs] = (v["x"][:tokens], v["ids"][:pairs], v["y"][:pairs],
                                                  self._y[:pairs] if self.cuda else None)
        return got

    @property
    def host_calls(self) -> int:
        """Step 3 runs, by the worker and by native.cpp (tests and benchmarks)."""
        return sum(calls for calls, _ in self.times().values())

    def times(self) -> dict[int, tuple[int, float]]:
        """Tokens -> (step 3 runs of that many tokens, their seconds in the host's calling thread) so far."""
        out = dict(self._times)
        if self.native is not None:
            self.native.times(out)
        return out

    def check(self) -> None:
        """Raise the worker's error, or a native job's, once (module doc)."""
        if self.native is not None:
            self.error = self.native.error() if self.error is None else self.error
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError(f"offplan: computing experts on the host CPU failed: {error!r}") from error

    # ------------------------------------------------------------------ step 3

    def clear(self) -> None:
        """Forget the errors of calls already failed (generation.py)."""
        self.error = None
        if self.native is not None:
            self.native.error()

    def _job(self, index: int, tokens: int) -> native.Job:
        return self.modules[index].job(self.native.pool, self._views["x"], self._views["ids"], self._views["y"],
                                       tokens)

    def _enqueue(self, index: int, tokens: int, capturing: bool) -> None:
        """Step 3 by native.cpp as a host function on the side stream (a host node in a capture): a captured call
        has its own job, which its graph keeps; eager calls of one (module, tokens) share one."""
        if capturing:
            self.native.capture(self._stream.cuda_stream, self._job(index, tokens))
        else:
            self.native.enqueue(self._stream.cuda_stream, (index, tokens), lambda: self._job(index, tokens))

    def _hand_over(self, index: int, tokens: int) -> None:
        """Step 3 by native.cpp on this thread and the pool's, or by the worker, this thread waiting at the
        barriers (the GIL released either way)."""
        if self.modules[index].native:
            self.native.run((index, tokens), lambda: self._job(index, tokens))
        else:
            self._eager = (index, tokens)
            self._views["call"][0] = _EAGER
            self._handoff.start()
            self._handoff.finish()
        self.check()

    def work(self, call: int) -> None:
        """One call's step 3, on the worker (handoff.py `serve`): a failure fills `y` with NaN and is kept for
        `check`."""
        y = self._views["y"]
        try:
            self.kernel.own()
            index, tokens = self._eager if call == _EAGER else self._calls[call]
            m = self.modules[index]
            x, ids, y, _ = self._sized(tokens, tokens * m.top_k)
            self._compute(m, x, ids, y)
        except BaseException as e:  # noqa: BLE001 - a replay cannot take it: the outputs show it, `check` raises it
            self.error = e
            y.fill_(float("nan"))

    def _compute(self, m: HostModule, x: torch.Tensor, ids: torch.Tensor, y: torch.Tensor) -> None:
        """y[p] = expert ids[p]'s output for token p // k, for each pair p whose expert is on cpu."""
        start = time.perf_counter()
        try:
            self.kernel.pairs(m.module, m.weights, m.on_cpu, m.top_k, m.gated, x, ids, y)
        finally:
            calls, seconds = self._times.get(x.shape[0], (0, 0.0))
            self._times[x.shape[0]] = (calls + 1, seconds + time.perf_counter() - start)

    def close(self) -> None:
        """Stop the worker and drop the buffers; a graph captured over them must not be replayed after this."""
        if self.cuda and (self._worker is not None or self.native is not None):
            torch.cuda.synchronize(self.device)  # no replay is left to meet the barriers or run a job
        if self._worker is not None:
            self._stop()
            self._worker = None
        if self.native is not None:
            self.native.close()
            self.native = None
        self._calls.clear()
        self._views, self._by_size = {}, {}
        if self._arena is not None:
            self._arena.release()
            self._arena = None
        self.modules = []

