"""The host CPU's arithmetic for experts on cpu: each (token, expert) pair's expert output, read where the rows lie.

`Kernel.gated(x, tokens, gate_up, down, experts)`: for pair p, token
tokens[p] of x [T, H] through expert experts[p] of gate_up [E, 2I, H] and
down [E, H, I], gated as silu(gate) * up (the first half of the gate_up rows
the gate: Qwen3-MoE, Mixtral, DeepSeek, Qwen2-MoE) -> [P, H]. Each projection is
summed in fp32 and rounded to the weights' dtype, and the gate rounds where
transformers' eager bf16 ops do, so the pairs the host computes round where
batched_mm's GEMVs do (the sums run in another order: a value may differ by
one unit in its last place).

Why compiled: written as broadcast multiplies and sums, torch.compile's
Inductor (C++ backend) fuses each gather, product and sum into one loop nest
over the weights' rows, each weight byte read once from host memory, in
parallel over rows, the gate between the two. Measured on the H200 machine's
host (16 vCPUs, Qwen3-30B-A3B's expert shape, experts not in the cache:
docs/host-experts/kernel_dram.py): 8 experts at 26-44 GB/s (15 or 8
threads), against 26-27 for torch's per-expert `F.linear` (oneDNN), and 64 at
55-62; index_select + bmm copies every row first (4.3 GB/s on a 2-CPU VM).
Each projection compiled on its own ran 15x slower there (Inductor tiles the
lone reduction otherwise), so the layer is one function.

`Kernel.project(x, w, experts, transposed)`: one projection by the eager loop
(`F.linear` per pair, the same rounding), for experts gated otherwise (gpt-oss
interleaves its gate and up and clamps them) or transposed or with biases:
correct everywhere, at the eager loop's speed.

Compiling costs time once per machine: Inductor writes the C++ and builds it
with the system's compiler on first use (35-67 s on the H200 machine cold,
under a second with its cache warm: TORCHINDUCTOR_CACHE_DIR). `start` does it
on a thread while the load fills the arena, over every shape the model will
call it with, and `ready` waits for it; `gated` never compiles (a forward
would stall on it): a call the compiled kernel does not
cover runs the eager path and counts in `misses`. Dynamo guards on the
thread's dispatch state, which differs inside a custom op's implementation,
so the kernel is always called through a custom op of its own
(`offplan::host_gated`) from a thread of the engine's, compiled and used in
one state.
Where compiling fails (no C++ compiler, say), `compiled` is False with the
reason in `why_eager`, and every call runs the eager path.

Threads: Inductor's C++ kernels take their OpenMP thread count at compile time
from the compiling thread (and Dynamo guards on it), torch's eager ops from
the calling one, so `start`'s thread and every call run at `threads`, the
caller's own count restored after (`_threads`).
"""
from __future__ import annotations

import contextlib
import threading
import time

import torch
import torch.nn.functional as F

from .. import ops


def _gated(x: torch.Tensor, tokens: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
           experts: torch.Tensor) -> torch.Tensor:
    dtype = gate_up.dtype
    rows = x.float().index_select(0, tokens)  # [P, H]
    u = (gate_up.index_select(0, experts).float() * rows[:, None, :]).sum(-1).to(dtype)  # [P, 2I]
    gate, up = u.chunk(2, dim=-1)
    h = (F.silu(gate.float()).to(dtype).float() * up.float()).to(dtype)  # [P, I], rounded as eager bf16 ops round
    return (down.index_select(0, experts).float() * h.float()[:, None, :]).sum(-1).to(dtype)  # [P, H]


def gated_eager(x, tokens, gate_up, down, experts) -> torch.Tensor:
    """`_gated`'s arithmetic by the eager loop (the compiled kernel's reference)."""
    rows = x.index_select(0, tokens)
    gate, up = project(rows, gate_up, experts, False).chunk(2, dim=-1)
    return project(F.silu(gate) * up, down, experts, False)


def project(x: torch.Tensor, w: torch.Tensor, experts: torch.Tensor, transposed: bool) -> torch.Tensor:
    """x [P, in], w [E, out, in] ([E, in, out] transposed), experts [P] -> [P, out]: one `F.linear` per pair."""
    out = torch.empty((x.shape[0], w.shape[-1] if transposed else w.shape[-2]), dtype=w.dtype)
    for p, e in enumerate(experts.tolist()):
        we = w[e].t() if transposed else w[e]
        out[p] = F.linear(x[p:p + 1].to(w.dtype), we)[0]
    return out


class Kernel:
    """The module doc's kernels, `gated` compiled once (`start`, `ready`) for `threads` host threads."""

    def __init__(self, threads: int, compile: bool = True):
        self.threads = threads
        self.compiled = False
        self.why_eager = "not compiled yet"
        self.misses = 0  # calls of `gated` the compiled kernel did not cover
        self.last_miss = ""  # why the last one missed (Dynamo's guard failure)
        self.seconds = 0.0  # in the compiled kernel's calls, for benchmarks
        self._fn = None
        self._thread: threading.Thread | None = None
        self._want = compile
        self.key = ops.register(self)
        self._own: set[int] = set()

    @contextlib.contextmanager
    def _threads(self):
        """This thread's torch/OpenMP thread count at `threads` for the call (the compiled kernel's guards
        hold it too), then as it was where the caller is the model's own thread; a thread of the engine's
        (`own`) keeps it."""
        before = torch.get_num_threads()
        if before != self.threads:
            torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            if before != self.threads and threading.get_ident() not in self._own:
                torch.set_num_threads(before)

    def own(self) -> None:
        """This thread is the engine's (its worker): it keeps `threads` between calls."""
        self._own.add(threading.get_ident())

    def start(self, examples: list[tuple[torch.Tensor, torch.Tensor, int]]) -> None:
        """Compile `gated` on a thread, over `examples` (gate_up, down, top_k): each shape of the model's
        gated experts, at `top_k` pairs (the compiler tunes its loops to the size it sees first; `gated`
        passes at least two tokens and two pairs, since a size of one is a shape of its own to it)."""
        if not self._want or self._thread is not None or not examples:
            return

        def build():
            try:
                fn = torch.compile(_gated, dynamic=True, options={"emulate_precision_casts": True})  # round as eager
                with torch.no_grad(), self._threads():
                    self._fn = fn
                    for gate_up, down, top_k in examples:
                        pairs = max(3, top_k)  # not 2, the tokens': equal sizes are assumed equal ("duck" sizes)
                        x = torch.zeros((2, gate_up.shape[-1]), dtype=gate_up.dtype)
                        args = (x, torch.zeros(pairs, dtype=torch.long), gate_up, down,
                                torch.zeros(pairs, dtype=torch.long))  # two index tensors: aliasing is guarded
                        ops.host_gated(*args, self.key)  # as `gated` calls it
                self.compiled, self.why_eager = True, ""
            except Exception as e:  # noqa: BLE001 - any failure leaves the eager path, with its reason
                self._fn = None
                self.why_eager = f"torch.compile failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"

        self._thread = threading.Thread(target=build, name="offplan-host-kernel-compile", daemon=True)
        self._thread.start()

    def ready(self) -> None:
        """Wait for `start`'s compile, if one runs."""
        if self._thread is not None:
            self._thread.join()

    def gated(self, x: torch.Tensor, tokens: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
              experts: torch.Tensor) -> torch.Tensor:
        """The module doc's gated experts, compiled where `start` covered the call, never compiling here."""
        with self._threads():
            if self._fn is not None:
                pairs = tokens.numel()
                if x.shape[0] == 1:  # a size of one is a shape of its own to the compiler: two rows instead
                    x = torch.cat([x, x])
                if pairs == 1:  # likewise: the pair twice, the result once
                    tokens, experts = tokens.repeat(2), experts.repeat(2)
                try:
                    start = time.perf_counter()
                    with torch.compiler.set_stance("fail_on_recompile"), torch.no_grad():  # as compiled
                        out = ops.host_gated(x, tokens, gate_up, down, experts, self.key)[:pairs]
                    self.seconds += time.perf_counter() - start
                    return out
                except Exception as e:  # noqa: BLE001 - a guard missed: the eager path computes the same
                    self.misses += 1
                    self.last_miss = str(e).splitlines()[-1][:300]
            return gated_eager(x, tokens, gate_up, down, experts)

    def compiled_gated(self, x, tokens, gate_up, down, experts) -> torch.Tensor:
        """The compiled function itself (`offplan::host_gated` calls it)."""
        return self._fn(x, tokens, gate_up, down, experts)

    def project(self, x: torch.Tensor, w: torch.Tensor, experts: torch.Tensor, transposed: bool) -> torch.Tensor:
        with self._threads():
            return project(x, w, experts, transposed)

    def pairs(self, module: torch.nn.Module, weights: dict[str, torch.Tensor], on_cpu: torch.Tensor, top_k: int,
              gated: bool, x: torch.Tensor, ids: torch.Tensor, y: torch.Tensor) -> None:
        """y[p] = expert ids[p]'s output for token p // top_k, for each pair p whose expert is `on_cpu` ([E]
        bool): `gated` ones by `gated`, the rest (another gate, transposed or with biases) by batched_mm's
        steps, one projection at a time. `weights`: the module's fused parameters (host tensors)."""
        with torch.no_grad():
            pairs = on_cpu[ids].nonzero().squeeze(1)
            if pairs.numel() == 0:
                return
            experts = ids.index_select(0, pairs)
            tokens = pairs // top_k
            if gated:
                out = self.gated(x, tokens, weights["gate_up_proj"], weights["down_proj"], experts)
            else:
                first = "gate_up_proj" if module.has_gate else "up_proj"
                up = self.project(x.index_select(0, tokens), weights[first], experts, module.is_transposed)
                if module.has_bias:
                    up = up + weights[f"{first}_bias"].index_select(0, experts)
                up = module._apply_gate(up) if module.has_gate else module.act_fn(up)
                out = self.project(up, weights["down_proj"], experts, module.is_transposed)
                if module.has_bias:
                    out = out + weights["down_proj_bias"].index_select(0, experts)
            y.index_copy_(0, pairs, out.to(y.dtype))


def gated_like(module: torch.nn.Module) -> bool:
    """Whether the compiled kernel computes `module`'s experts (kernel.py `gated`): fused gate and up rows,
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
