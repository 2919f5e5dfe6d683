"""Decode of one token: the next layer's experts read ahead, on a guess, while this layer computes.

At batch 1, a layer whose experts lie in pinned memory reads the k experts its
router picked over the link (experts.py), and the link then idles while the
rest of the step runs on the GPU: the experts' GEMVs, the next layer's
attention and router (about 2 ms of a 14 ms step at Qwen3-30B-A3B's shape on
the H100, 1.2 ms compiled; benchmarks/RESULTS.md). The next layer's pick is
unknown until its router runs, but a guess is cheap: its router applied to
this layer's experts input (pre-gating; benchmarks/moe_predict.py measured
its top expert among the 8 picked 83% of the time on random weights, 95%
under skewed routing). So, in a forward of one token, for each experts
module with experts in pinned memory that the next such module follows:

1. before the module's gathers (`offplan::ahead_begin`), a side stream
   applies the next module's router to this module's input and keeps its
   top `count` experts among those the link would read: not those resident
   in HBM, nor those the host computes (experts on cpu, host/engine.py),
   where a module has any (the ids of two consecutive modules alternate, so
   this module's gathers still find their own);
2. once the gathers are enqueued (`offplan::ahead_read`), the side stream
   waits for them (the link is then free) and copies the guessed experts'
   rows that lie in pinned memory into a buffer in HBM: rank by rank, the
   projections' weights (the module's two largest stored tensors), in chunks
   of `BLOCK`. One kernel of `PROGRAMS` programs (eight read 51 GB/s on the
   H100, the link's rate), so the compute stream keeps the SMs. Before each
   chunk a program looks at `stop`;
3. the next module's `offplan::ahead_begin` sets `stop` to its index (it
   needs the link now) and makes the compute stream wait for the side
   stream: each program stores the chunk in flight and ends, recording how
   many it completed (`done`). Its gathers then take a guessed expert's
   block from the buffer where the side read completed it, from pinned
   memory otherwise (`Source`).

The read thus fills the time the link would idle and never holds the next
gather up for more than a chunk. A wrong guess costs only link time that was
idle. The outputs are bitwise the same either way: the buffer holds the
experts' own bytes. One buffer per stored tensor serves every module: a
module's gather reads it before the side stream writes it again (the read
waits for that gather). The side stream is joined at the next module, and at
the end of a forward (`OffloadHandle.join`), so a captured decode step holds
it whole and replays it. Forwards of more tokens (prefill, batches) neither
guess nor read: their gathers keep the link busy; nor do eager forwards on
CUDA, where the CPU's launches set the pace (experts.py says why).

Measured on the H100 (`benchmarks/moe.py --lookahead-ab`: Qwen3-30B-A3B's
shape, every expert in pinned memory, batch 1, count 2, off and on in the same
run): with 8 of its layers, 0.86x -> 0.93x the link floor under graph replay,
0.92x -> 0.948x compiled and replayed; with all 48, 0.875x -> 0.970x and
0.914x -> 0.963x. The buffer holds 2 experts' rows (19 MB); it counts in
`LoadStats.gpu_buffer_bytes`, and in the plan's GPU footprint as working memory (planner/decide/working.py).

Limits. The link still idles between steps: from the last layer's gathers,
through the head, to the next step's first router (measured with kernel
timestamps on the H100 at that shape: about 0.35 ms compiled, 0.5 ms in a
replay of the eager kernels). No guess fills it: the next step's experts
depend on a token the head has not picked yet. With 8 layers that time alone
bounds batch 1 at about 0.97x the floor compiled, 0.96x replayed eagerly; at
48 it is under 1% of a step. Kernel edges (some 5 us at each gather and side
read) and side reads that a wrong guess wastes take the rest. Tried on that
shape and not kept: guessing the first layer from its block's input (the
embedding, before attention), which on random weights named one of its experts
too rarely to pay for stopping the read; two chunks in flight per program,
which stopped later; sixteen programs, within the noise; a high-priority side
stream, no change.

Without CUDA the side stream is the current one and every chunk is read, in
order, so CI exercises the buffer: a row taken from it for the wrong expert
gives wrong outputs.

Lifecycle: `Lookahead(model, paths, names, count, device)` (buffers, stream,
each module's `_offplan_ahead`) -> forwards -> `remove()`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..place.dequant import stored
from . import ops
from .experts import slot_of
from .gather import as_words

PROGRAMS = 8  # programs of the side read: eight read 51 GB/s on the H100 (the link's rate), the SMs stay free
BLOCK = 8192  # elements (int32 words for quantized bytes) a program reads at a time, between looks at `stop`
LOOKAHEAD = 2  # experts guessed per module, read in rank order until the compute stream needs the link


@dataclass(frozen=True)
class AheadUse:
    """What an experts module's forward needs: the engine's key, its own index, and whether it reads the
    buffer (the module before it guesses for it) and guesses for the next one."""

    key: int
    index: int
    reads: bool
    guesses: bool


@dataclass(frozen=True)
class Source:
    """Where a gather finds guessed rows of one stored tensor: `rows` [count, ...] for the experts `ids`,
    chunk k of the side read (`BLOCK` elements) complete when k // PROGRAMS < done[k % PROGRAMS]; this
    tensor's chunks of a guess start at `first` of `per`."""

    ids: torch.Tensor
    rows: torch.Tensor
    done: torch.Tensor
    first: int
    per: int
    programs: int = PROGRAMS
    block: int = BLOCK


def router_of(model: torch.nn.Module, path: str) -> torch.nn.Module | None:
    """The router beside the experts module at `path`: a sibling `gate` or `router` with a [E, H] weight."""
    parent = model.get_submodule(path.rpartition(".")[0])
    experts = model.get_submodule(path)
    for name in ("gate", "router"):
        router = getattr(parent, name, None)
        weight = getattr(router, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] == experts.num_experts:
            return router
    return None


def _chunks(t: torch.Tensor) -> int:
    return -(-as_words(t)[0].numel() // BLOCK)


class Lookahead:
    """The side stream, the guessed experts and their rows in HBM, for the experts modules at `paths`
    (forward order, each bound to offplan's experts implementation; `names[path]`: its bound stored
    tensors, of which the two largest, its projections' weights, are read ahead)."""

    def __init__(self, model: torch.nn.Module, paths: list[str], names: dict[str, list[str]], count: int,
                 device: torch.device, unread: dict[str, torch.Tensor] | None = None):
        """`unread[path]`: [E] bool on `device`, the experts of that module which its gathers read other than over
        the link (resident in HBM, or computed by the host): a guess for it ranks them last."""
        self.count = count
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.pending = False  # work enqueued on the side stream that the current stream has not joined
        self.ids = torch.zeros(2, count, dtype=torch.long, device=device)  # by the guessed module's parity
        self.stop = torch.full((1,), -1, dtype=torch.int32, device=device)  # the index of the module waiting
        self.done = torch.zeros(PROGRAMS, dtype=torch.int32, device=device)  # chunks each program completed
        self.modules = [model.get_submodule(p) for p in paths]
        self.key = ops.register(self)
        routers = [router_of(model, p) for p in paths]
        self.names: list[list[str]] = []  # per module: the stored tensors read ahead for it, first read first
        self.chunks: list[dict[str, tuple[int, int]]] = []  # per module, per such tensor: (first, per) (Source)
        for path, module in zip(paths, self.modules):
            big = sorted(names[path], key=lambda n: -stored(module, n)[0].nbytes)[:2]
            self.names.append([n for n in names[path] if n in big])
            sizes = [_chunks(stored(module, n)) for n in self.names[-1]]
            self.chunks.append({n: (sum(sizes[:i]), sum(sizes)) for i, n in enumerate(self.names[-1])})
        self.rows: dict[str, torch.Tensor] = {}
        for i, module in enumerate(self.modules):
            reads = i > 0 and routers[i] is not None
            module._offplan_ahead = AheadUse(self.key, i, reads, i + 1 < len(paths) and routers[i + 1] is not None)
            for name in self.names[i] if reads else ():
                row = stored(module, name)[0]
                if name not in self.rows or self.rows[name][0].nbytes < row.nbytes:
                    self.rows[name] = torch.empty((count, *row.shape), dtype=row.dtype, device=device)
        self.routers = routers
        self.unread = [(unread or {}).get(p) for p in paths]

    def reads(self, index: int) -> bool:
        return self.modules[index]._offplan_ahead.reads

    def guesses(self, index: int) -> bool:
        return self.modules[index]._offplan_ahead.guesses

    @property
    def buffer_bytes(self) -> int:
        return sum(t.nbytes for t in self.rows.values())

    def source(self, index: int, name: str, full: torch.Tensor) -> Source | None:
        """Where module `index`'s gather of stored tensor `name` (`full`) finds guessed rows; None: nowhere."""
        if name not in self.chunks[index]:
            return None
        rows = self.rows[name].view(-1)[:self.count * full[0].numel()].view(self.count, *full.shape[1:])
        return Source(self.ids[index % 2], rows, self.done, *self.chunks[index][name])

    def _side(self):
        """Run what follows on the side stream, after the work enqueued on the current one so far."""
        if not self.cuda:
            return contextlib.nullcontext()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.pending = True
        return torch.cuda.stream(self.stream)

    def guess(self, index: int, x: torch.Tensor) -> None:
        """Before module `index`'s gathers: guess the next module's experts from `x` (its input), on the side
        stream (the ids of the two modules alternate: this module's gathers still read its own)."""
        router = self.routers[index + 1]
        if self.cuda:
            x.record_stream(self.stream)
        with self._side():
            # product and sum, not a GEMM: cuBLAS would give the side stream its own 32 MiB workspace (H100), for good
            logits = (x[-1] * router.weight).sum(-1, dtype=torch.float32)  # [E]
            if getattr(router, "bias", None) is not None:
                logits = logits + router.bias
            if self.unread[index + 1] is not None:  # the link reads none of them: guess among the others
                logits = logits.masked_fill(self.unread[index + 1], float("-inf"))
            self.ids[(index + 1) % 2].copy_(logits.topk(self.count, dim=-1).indices.view(-1))

    def read(self, index: int) -> None:
        """After module `index`'s gathers: read the next module's guessed experts, in rank order, until that
        module's forward sets `stop` (module doc, step 1)."""
        target = index + 1
        module = self.modules[target]
        with self._side():
            read_ahead(self, target, [stored(module, n) for n in self.names[target]],
                       [slot_of(module, n) for n in self.names[target]])

    def join(self, index: int | None = None) -> None:
        """Make the current stream wait for the side stream; `index`: module `index` needs the link, so its
        read stops at the chunks in flight."""
        if self.cuda and self.pending:  # else nothing to wait for: a wait on an event recorded outside a
            if index is not None:       # graph capture would invalidate the capture
                self.stop.fill_(index)
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self.pending = False

    def synchronize(self) -> None:
        """Wait on the host for the side stream (before a graph capture)."""
        if self.stream is not None:
            self.stream.synchronize()
            self.pending = False

    def remove(self) -> None:
        for module in self.modules:
            del module._offplan_ahead
        self.modules = []
        if self.stream is not None:
            self.stream.synchronize()
        self.rows = {}


def read_ahead(look: Lookahead, target: int, full: list[torch.Tensor], slots: list[torch.Tensor]) -> None:
    """Copy the guessed experts' rows of `full` (one or two stored tensors) into the buffers, rank by rank,
    chunk by chunk, until `stop` names `target`; experts resident in HBM are skipped (their gather reads them
    there). On CUDA one kernel of PROGRAMS programs; without, every chunk, at once."""
    ids = look.ids[target % 2]
    outs = [look.source(target, n, f).rows for n, f in zip(look.names[target], full)]
    if not look.cuda or triton is None:
        for f, slot, out in zip(full, slots, outs):
            host = (slot.index_select(0, ids) < 0).view(-1, *([1] * (f.dim() - 1)))
            out.copy_(torch.where(host, f.index_select(0, ids), out))
        look.done.fill_(-(-look.count * sum(_chunks(f) for f in full) // PROGRAMS))
        return
    look.stop.fill_(-1)
    (a, b), (sa, sb), (oa, ob) = ((x * 2)[:2] for x in (full, slots, outs))
    _read_kernel[(PROGRAMS,)](ids, look.stop, look.done, target, as_words(oa), as_words(a), sa, as_words(a)[0].numel(),
                              as_words(ob), as_words(b), sb, as_words(b)[0].numel(), look.count, len(full),
                              PROGRAMS=PROGRAMS, BLOCK=BLOCK, num_warps=16)


try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch
    triton = None

if triton is not None:
    @triton.jit
    def _read_kernel(ids, stop, done, target, out_a, full_a, slot_a, numel_a, out_b, full_b, slot_b, numel_b,
                     count, tensors, PROGRAMS: tl.constexpr, BLOCK: tl.constexpr):
        p = tl.program_id(0)
        ca = tl.cdiv(numel_a, BLOCK)
        per = ca + tl.cdiv(numel_b, BLOCK) * (tensors - 1)
        total = count * per
        offs = tl.arange(0, BLOCK)
        c = p
        n = 0
        while c < total:
            j = (c // per).to(tl.int64)
            r = c % per
            e = tl.load(ids + j)
            in_a = r < ca
            at_a = r.to(tl.int64) * BLOCK + offs
            at_b = (r - ca).to(tl.int64) * BLOCK + offs
            mask_a = (at_a < numel_a) & in_a & (tl.load(slot_a + e) < 0)  # resident experts: read in HBM
            mask_b = (at_b < numel_b) & (r >= ca) & (tl.load(slot_b + e) < 0)
            xa = tl.load(full_a + e * numel_a + at_a, mask=mask_a)
            xb = tl.load(full_b + e * numel_b + at_b, mask=mask_b)
            # every thread loads `stop` itself (while the chunk is in flight) and may see it change at a
            # different time: a reduction makes the program's choice one, so a chunk is stored whole or not
            seen = tl.load(stop + tl.arange(0, 512) * 0, volatile=True) == target
            if tl.max(seen.to(tl.int32), axis=0) != 0:
                c = total  # the module needs the link: this program's chunks from here on stay unread
            else:
                tl.store(out_a + j * numel_a + at_a, xa, mask=mask_a)
                tl.store(out_b + j * numel_b + at_b, xb, mask=mask_b)
                n += 1
                c += PROGRAMS
        tl.store(done + p, n)
