"""The prefetch engine's two operations as `torch.library` custom ops, for torch.compile and CUDA graphs.

The prefill stager (prefill.py) uses `prefetch_wait` too: its `wait(layer)`
stages the layer and starts the next one's copy. It adds a third:
`offplan::expert_fill(rows, engine, unit)`: copy a staged experts module's
host rows from the expert ring (ring.py) into `rows`, the rows its experts
forward gathered (experts.py), which it mutates. The lookahead (lookahead.py)
adds two more, for decode of one token: `offplan::ahead_begin` and
`offplan::ahead_read`. Experts on cpu (host/engine.py) add `offplan::host_begin`
and `offplan::host_end`, which experts.py calls under torch.compile only (elsewhere
it calls the engine directly: no op's dispatch), and their kernel
`offplan::host_gated` (host/kernel.py).

`offplan::prefetch_wait(x, engine, layer)`: make the current stream wait for
`layer`'s copy, then return a copy of `x` (the layer's input activations).
`offplan::prefetch_start(y, engine, layer)`: start the copies `layer`'s forward
frees a slot for, then return a copy of `y` (its output activations).

Why activations in and out: the layer's kernels read `wait`'s output, and the
next layer reads `start`'s, so the compiler cannot run a layer before its
weights arrived, nor start a copy before the previous user of the slot is done.
The weights themselves stay out of the graph's data flow: they alias the slot
buffers, and a graph that mutated them (or the slots) as inputs would have to
copy them. The activation copies cost a few kilobytes per layer at decode.

To torch.compile the ops are opaque (they are traced, not inlined), so Dynamo
sees no stream or event objects: no graph breaks. The ops look their engine up
by id in a weak registry, because custom ops take only tensors and scalars.
"""
from __future__ import annotations

import itertools
import weakref

import torch

# The one module-level registry in the runtime: custom ops take only tensors and scalars, so they
# find their engine by a key. Keys come from a counter (never reused, unlike id()), and the
# registry holds engines weakly: it keeps nothing alive.
_ENGINES: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_KEYS = itertools.count(1)


def register(engine) -> int:
    """Make `engine` reachable from the ops; returns its key."""
    key = next(_KEYS)
    _ENGINES[key] = engine
    return key


def engine(key: int):
    """The engine registered under `key`."""
    found = _ENGINES.get(key)
    if found is None:
        raise RuntimeError("offplan: this model's offload handle was removed; load it again")
    return found


_engine = engine


@torch.library.custom_op("offplan::prefetch_wait", mutates_args=())
def prefetch_wait(x: torch.Tensor, engine: int, layer: int) -> torch.Tensor:
    _engine(engine).wait(layer)
    return x.clone()


@prefetch_wait.register_fake
def _(x, engine, layer):
    return torch.empty_like(x)


@torch.library.custom_op("offplan::prefetch_start", mutates_args=())
def prefetch_start(y: torch.Tensor, engine: int, layer: int) -> torch.Tensor:
    _engine(engine).start_after(layer)
    return y.clone()


@prefetch_start.register_fake
def _(y, engine, layer):
    return torch.empty_like(y)


@torch.library.custom_op("offplan::expert_fill", mutates_args=("rows",))
def expert_fill(rows: list[torch.Tensor], engine: int, unit: int) -> None:
    _engine(engine).fill(unit, rows)


@expert_fill.register_fake
def _(rows, engine, unit):
    return None


@torch.library.custom_op("offplan::ahead_begin", mutates_args=())
def ahead_begin(ids: torch.Tensor, x: torch.Tensor, engine: int, index: int) -> torch.Tensor:
    """Before experts module `index`'s gathers (lookahead.py): stop the side read of its guessed experts and
    wait for it, if the module before guessed for it; then guess the next module's experts from `x`, on the
    side stream. Returns a copy of `ids` (its routed experts), which the gathers read: they cannot run
    before the wait."""
    look = _engine(engine)
    if look.reads(index):
        look.join(index)
    if look.guesses(index):
        look.guess(index, x)
    return ids.clone()


@ahead_begin.register_fake
def _(ids, x, engine, index):
    return torch.empty_like(ids)


@torch.library.custom_op("offplan::ahead_read", mutates_args=())
def ahead_read(x: torch.Tensor, gathered: list[torch.Tensor], engine: int, index: int) -> torch.Tensor:
    """Once `gathered` (module `index`'s gathered rows) is enqueued, read the guessed experts of the next
    module on the side stream, if it guesses for one (lookahead.py). Returns a copy of `x`, which the module's
    GEMVs read: the read, and every gather, is enqueued before them (torch.compile would otherwise be free to
    put the first GEMV between two gathers, and the link would idle through it)."""
    look = _engine(engine)
    if look.guesses(index):
        look.read(index)
    return x.clone()


@ahead_read.register_fake
def _(x, gathered, engine, index):
    return torch.empty_like(x)


@torch.library.custom_op("offplan::host_begin", mutates_args=())
def host_begin(ids: torch.Tensor, x: torch.Tensor, engine: int, index: int) -> torch.Tensor:
    """At experts module `index` with experts on cpu (host/engine.py): hand the tokens `x` and their routed
    experts `ids` to the host. Returns a copy of `ids`, which the module's gathers read: the hand-over is
    enqueued before the GPU's experts, which it overlaps."""
    _engine(engine).begin(index, x, ids)
    return ids.clone()


@host_begin.register_fake
def _(ids, x, engine, index):
    return torch.empty_like(ids)


@torch.library.custom_op("offplan::host_end", mutates_args=())
def host_end(out: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, engine: int, index: int) -> torch.Tensor:
    """The pair outputs `out` [T*k, H] of the GPU, with the host's where the expert is on cpu
    (host/engine.py): taken after the GPU's experts, which its input is."""
    return _engine(engine).end(index, out, x, ids)


@host_end.register_fake
def _(out, x, ids, engine, index):
    return torch.empty_like(out)


@torch.library.custom_op("offplan::host_gated", mutates_args=())
def host_gated(x: torch.Tensor, tokens: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
               experts: torch.Tensor, kernel: int) -> torch.Tensor:
    """host/kernel.py's compiled kernel, always called through this op: Dynamo guards on the thread's dispatch
    state, which a custom op's implementation sets alike wherever it is called from (the engine's worker,
    another op's implementation)."""
    return _engine(kernel).compiled_gated(x, tokens, gate_up, down, experts)
