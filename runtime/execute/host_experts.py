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
   weights and sums the pairs as batched_mm does.

How the GPU hands the work to the host and takes it back:
- on CUDA: the copies on a side stream forked from the current one; `end`,
  called once the GPU's experts are enqueued, waits for the copies and has
  the engine's worker thread run step 3 while the GPU computes, then copies
  `y` in on the side stream, which the current stream joins. The worker is
  the engine's own thread: the kernel runs there as it was compiled, not in
  the custom op's dispatch state (host_kernel.py);
- on the CPU: step 3 on the worker, through the same buffers (plain memory).

Not in a CUDA graph yet: `begin` refuses a capture, and the runtime's
generation runs such a plan eagerly (generation.py). A host node
(`cuLaunchHostFunc`) running step 3 replays an experts module, and a chain of
them with routing in the graph, exactly; a whole decoder step captured with it
did not (docs/pending/host-experts-graphs says what was measured).

Above `max_tokens` tokens (a long prompt) the host computes nothing: the GPU
reads those experts as it reads uva ones (experts.py). `max_tokens` is the
plan's prefill threshold, above which a GEMM on the GPU over copied weights
beats a GEMV per pair on the host.

Lifecycle: `HostExperts(...)` -> `kernel.start` (compiling while the load runs)
-> `add` per module -> `finish` (the exchange buffers) -> `ready` -> forwards -> `close`.
"""
from __future__ import annotations

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
        self.host_calls = 0  # step 3 runs, for tests and benchmarks
        self.host_seconds = 0.0  # their time in the host's thread
        self.durations: list[float] = []  # each one's (the first 100k), for benchmarks
        self._arena: PinnedArena | None = None
        self._stream = self._event = None
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
            self._views[name] = typed(self._arena.host_view(offset, size), d, shape)
        if self.cuda:
            self._y = torch.empty((pairs, hidden), dtype=dtype, device=self.device)  # the host's outputs, copied in
            self._stream = torch.cuda.Stream(self.device)
            self._event = torch.cuda.Event()

    def ready(self) -> None:
        """Wait for the kernel's compile (host_kernel.py)."""
        self.kernel.ready()

    def takes(self, tokens: int) -> bool:
        """Whether the host computes a forward of `tokens` tokens (module doc)."""
        return tokens <= self.max_tokens

    # ------------------------------------------------------------------ the forward's two halves

    def begin(self, index: int, x: torch.Tensor, ids: torch.Tensor) -> None:
        """Step 1. x [T, H], ids [T*k]."""
        if not self.cuda:
            return
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("offplan: a plan with experts on cpu runs eagerly: its steps are not captured in "
                               "CUDA graphs yet (handle.generate runs them eagerly; do not call handle.capture)")
        tokens = x.shape[0]
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            self._views["x"][:tokens].copy_(x, non_blocking=True)  # copies by the copy engine (memcpy)
            self._views["ids"][:ids.numel()].copy_(ids, non_blocking=True)
            self._event.record(self._stream)

    def end(self, index: int, out: torch.Tensor, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Step 3 (on the worker, while the GPU computes its own pairs), then step 4: out [T*k, H], the GPU's
        pair outputs."""
        tokens, pairs = x.shape[0], ids.numel()
        m = self.modules[index]
        host_x, host_ids, host_y = (self._views[n] for n in ("x", "ids", "y"))
        if not self.cuda:  # through the same buffers: the compiled kernel sees the tensors it was compiled for
            host_x[:tokens].copy_(x)
            host_ids[:pairs].copy_(ids)
            self._on_worker(m, host_x[:tokens], host_ids[:pairs], host_y[:pairs])
            return torch.where(m.on_cpu[ids].unsqueeze(1), host_y[:pairs], out)
        self._event.synchronize()
        self._on_worker(m, host_x[:tokens], host_ids[:pairs], host_y[:pairs])
        with torch.cuda.stream(self._stream):
            self._y[:pairs].copy_(host_y[:pairs], non_blocking=True)
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        return torch.where(m.on_cpu_device[ids].unsqueeze(1), self._y[:pairs], out)

    # ------------------------------------------------------------------ step 3

    def _on_worker(self, m: _Module, x: torch.Tensor, ids: torch.Tensor, y: torch.Tensor) -> None:
        """Step 3 on the engine's worker thread, this one waiting (the GIL released): the kernel runs there as it
        was compiled, not in this custom op's dispatch state (host_kernel.py); an error in it is raised here."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="offplan-host-experts",
                                              initializer=self.kernel.own)
        self._worker.submit(self._compute, m, x, ids, y).result()

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
        """Stop the worker and drop the buffers."""
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
