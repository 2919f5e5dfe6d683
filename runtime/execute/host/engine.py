"""Experts on cpu: the host CPU computes the plan's cpu experts for the tokens routed to them, beside the GPU.

At an experts module with experts on cpu (experts.py), a forward of T tokens
with top-k routing, T <= `max_tokens`:

1. `begin`: the tokens' activations [T, H] and routed experts [T*k] are copied
   into pinned memory (by the copy engine);
2. the GPU computes its own pairs (experts on the GPU or on uva) meanwhile; it
   reads no row of an expert on cpu (experts.py leaves them out of its gather);
3. the host computes, for each (token, expert) pair whose expert is on cpu,
   that expert's output for that token (kernel.py, the rounding of
   batched_mm's GEMVs) into pinned memory `y` [T*k, H], reading the expert's
   rows where the arena holds them;
4. `end`: `y` is copied to the GPU (T*k*H*2 bytes, 32 KiB a token at
   Qwen3-30B-A3B's shape), and per pair the GPU takes the host's output where
   the expert is on cpu and its own elsewhere (`torch.where`); the module then
   weights and sums the pairs as batched_mm does.

How the GPU hands the work to the host and takes it back: the engine's own
thread (its worker) computes step 3, always, woken and awaited through two
barriers (handoff.py):
- in a step captured in a CUDA graph (decode's fast path): on a side stream
  forked from the current one, the two copies and the copy of the call's
  number (which module, how many tokens) into pinned memory, then the two
  barriers as host nodes (the first wakes the worker, the second holds the
  side stream until it is done), then the copy of `y`; the current stream
  joins the side stream before step 4's `where`. The GPU's experts run on the
  current stream in between, so the two sides overlap. The host nodes are
  libc's barrier wait itself, so the driver's thread takes no GIL; the worker
  needs it, so the generator keeps at most two replays in flight and sleeps
  otherwise (generation.py). Why this and not the others tried:
  a host node running the kernel in Python took it 1.58x as long as the main
  thread did in one run (1.17 against 0.74 ms,
  docs/host-experts/host_node_timing.py), and a GPU kernel spinning on
  a flag in pinned memory would hold an SM for the whole wait;
- eager on CUDA: the copies on the side stream; `end`, called once the GPU's
  experts are enqueued, waits for the copies, meets the barriers itself (the
  worker computes meanwhile, while the GPU computes its own pairs), then
  copies `y` in on the side stream;
- on the CPU: `end` meets the barriers, the same buffers in plain memory.

Above `max_tokens` tokens (a long prompt) the host computes nothing: the GPU
reads those experts as it reads uva ones (experts.py). `max_tokens` is the
plan's prefill threshold, above which a GEMM on the GPU over copied weights
beats a GEMV per pair on the host.

A failure in the worker (which a replay cannot report) fills `y` with NaN,
so the step's outputs show it, and `end` or `check` raises it. One stream at a
time hands work over: the barriers are of two, so an eager forward on another
stream while a replay's host nodes wait would meet the driver's thread
instead of the worker.

The worker holds the engine weakly: an engine dropped without `close` (its
model and handle dropped) stops its worker as it is collected.

Lifecycle: `HostExperts(...)` -> `kernel.start` (compiling while the load runs)
-> `add` per module -> `finish` (the exchange buffers, the worker) -> `ready`
-> forwards -> `close` (the worker stopped: no graph captured over the engine
may be replayed after it).
"""
from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass

import torch

from ...place.arena import PinnedArena, align, typed
from .. import ops
from .handoff import Handoff, serve, stop
from .kernel import Kernel, gated_like

_EAGER = -1  # the call slot's value for `end`'s own call, besides a captured call's number (1, 2, ...) and STOP
MAX_CALLS = 1 << 14  # captured calls over the engine's life: host modules x captured steps


@dataclass(frozen=True)
class HostSlot:
    """What an experts module with experts on cpu carries (`module._offplan_host`, set by bind.py):
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
        self.durations: list[tuple[int, float]] = []  # each one's (tokens, seconds), the first 100k: benchmarks
        self._calls: dict[int, tuple[int, int]] = {}  # a captured call's number -> (module, tokens)
        self._eager = (0, 0)  # the (module, tokens) of the call `end` hands over itself
        self._arena: PinnedArena | None = None
        self._stream = self._event = None
        self._handoff: Handoff | None = None
        self._worker: threading.Thread | None = None

    def add(self, module: torch.nn.Module, weights: dict[str, torch.Tensor], on_cpu: list[int], top_k: int) -> int:
        """Register an experts module; `weights`: its fused parameters' host tensors (pinned arena views).
        Returns its index, which its forward passes to `ops.host_begin` / `host_end`."""
        mask = torch.zeros(module.num_experts, dtype=torch.bool)
        mask[on_cpu] = True
        self.modules.append(_Module(module, weights, mask, mask.to(self.device), top_k, gated_like(module)))
        return len(self.modules) - 1

    def finish(self) -> None:
        """The exchange buffers, sized for `max_tokens` tokens of the widest module, and the worker."""
        hidden = max(_hidden(m) for m in self.modules)
        pairs = self.max_tokens * max(m.top_k for m in self.modules)
        dtype = next(iter(self.modules[0].weights.values())).dtype
        layout = (("x", dtype, (self.max_tokens, hidden)), ("ids", torch.long, (pairs,)),
                  ("y", dtype, (pairs, hidden)), ("call", torch.long, (1,)))
        offsets, total = [], 0
        for _, d, shape in layout:
            offsets.append(total)
            total = align(total + d.itemsize * torch.Size(shape).numel())
        self._arena = PinnedArena(total, cuda=self.cuda, device=self.device)
        self._views = {name: typed(self._arena.host_view(offset, d.itemsize * torch.Size(shape).numel()), d, shape)
                       for (name, d, shape), offset in zip(layout, offsets)}
        if self.cuda:
            self._y = torch.empty((pairs, hidden), dtype=dtype, device=self.device)  # the host's outputs, copied in
            self._numbers = torch.arange(MAX_CALLS, device=self.device)  # a captured call copies its own
            self._stream = torch.cuda.Stream(self.device)
            self._event = torch.cuda.Event()
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
        capturing = torch.cuda.is_current_stream_capturing()
        if capturing and len(self._calls) + 1 >= MAX_CALLS:  # before anything is enqueued on the side stream
            raise RuntimeError(f"offplan: more than {MAX_CALLS - 1} captured calls of experts on cpu: capture "
                               "fewer steps, or remove the handle and load again")
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            self._views["x"][:tokens].copy_(x, non_blocking=True)  # copies by the copy engine (memcpy)
            self._views["ids"][:pairs].copy_(ids, non_blocking=True)
            if capturing:
                call = len(self._calls) + 1
                self._calls[call] = (index, tokens)
                self._views["call"].copy_(self._numbers[call:call + 1], non_blocking=True)
                self._handoff.enqueue(self._stream.cuda_stream)
                self._y[:pairs].copy_(self._views["y"][:pairs], non_blocking=True)

    def end(self, index: int, out: torch.Tensor, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Step 3 handed to the worker here (eagerly), then step 4: out [T*k, H], the GPU's pair outputs."""
        self.check()
        tokens, pairs = x.shape[0], ids.numel()
        m = self.modules[index]
        if not self.cuda:  # through the same buffers: the compiled kernel sees the tensors it was compiled for
            self._views["x"][:tokens].copy_(x)
            self._views["ids"][:pairs].copy_(ids)
            self._hand_over(index, tokens)
            return torch.where(m.on_cpu[ids].unsqueeze(1), self._views["y"][:pairs], out)
        if not torch.cuda.is_current_stream_capturing():
            self._event.record(self._stream)
            self._event.synchronize()
            self._hand_over(index, tokens)
            with torch.cuda.stream(self._stream):
                self._y[:pairs].copy_(self._views["y"][:pairs], non_blocking=True)
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        return torch.where(m.on_cpu_device[ids].unsqueeze(1), self._y[:pairs], out)

    def check(self) -> None:
        """Raise the worker's error, once (module doc)."""
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError(f"offplan: computing experts on the host CPU failed: {error!r}") from error

    # ------------------------------------------------------------------ step 3

    def _hand_over(self, index: int, tokens: int) -> None:
        """Step 3 by the worker, this thread waiting at the barriers (the GIL released)."""
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
            y = y[:tokens * m.top_k]
            self._compute(m, self._views["x"][:tokens], self._views["ids"][:y.shape[0]], y)
        except BaseException as e:  # noqa: BLE001 - a replay cannot take it: the outputs show it, `check` raises it
            self.error = e
            y.fill_(float("nan"))

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
                self.durations.append((x.shape[0], took))

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
        """Stop the worker and drop the buffers; a graph captured over them must not be replayed after this."""
        if self._worker is not None:
            if self.cuda:
                torch.cuda.synchronize(self.device)  # no replay is left to meet the barriers
            self._stop()
            self._worker = None
        self._calls.clear()
        self._views = {}
        if self._arena is not None:
            self._arena.release()
            self._arena = None
        self.modules = []


def _hidden(m: _Module) -> int:
    w = m.weights["down_proj"]  # [E, H, I] ([E, I, H] transposed)
    return w.shape[-1] if m.module.is_transposed else w.shape[-2]

