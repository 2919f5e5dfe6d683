"""Generation through the front door: prompts in, tokens out, each decode step replayed from a CUDA graph.

transformers' `generate` on an offloaded model runs every decode step eagerly:
its Python launches some 650 kernels a step at Qwen3-30B-A3B's shape, and the
GPU waits for them (10 tok/s where the link allows 80). A `Generator` runs the
loop the benchmarks time instead, and the benchmarks time it:

1. the prompts, token ids of one length or of several (then left-padded with
   `pad_id`, and an attention mask [B, cache] keeps the pads out), go through
   one eager prefill forward over a static KV cache, so that the plan's prefill
   staging runs (prefill.py); its last logits give the first new token;
2. each further token is one decode step over static inputs (token ids [B, 1],
   cache position [1], the mask): on CUDA, captured once in a CUDA graph
   through the handle (`OffloadHandle.capture`: prefetch copies and lookahead
   reads joined into the capture) and replayed; on the CPU, or `eager=True`,
   run as it is. `compile=True` runs the step under torch.compile (Inductor's
   fused kernels), captured too unless eager;
3. the next token is the argmax of the step's logits, or a sample (`temperature`,
   `top_k`, a seeded generator on the device) when `do_sample`; a sequence that
   emits a stop token is done (its later tokens are not returned), and the loop
   ends when all are.

The static cache and the captured step are kept per (batch, cache length) and
reused by later calls of the same generator: a capture costs a few warm-up
steps, a replay costs none. The cache length is the prompt plus the new tokens,
rounded up to `CACHE_QUANTUM`, so calls of nearby lengths share a graph. The host
reads each step's tokens only when it must (an `on_token` callback, stop
tokens): otherwise the CPU queues every replay ahead of the GPU and reads the
tokens once, at the end. Experts on cpu are the exception: each replay hands
work to the engine's worker, which needs the GIL (host/engine.py) that a loop
queuing replays holds. So the loop keeps at most two steps in flight, asleep on
a blocking event until the older one is done (a spinning wait takes a core).

Greedy tokens are those of transformers' `generate` on the same model and prompts with a static cache of the same
length, eager on the CPU (tests/execute/test_generation.py) and replayed on CUDA (test_generation_gpu.py); gpt-oss's
replayed tokens, its mask and sliding cache made replayable by tokens.py, its own eager steps' (test_quantized_gpu.py).
With a cache of another length, attention rounds otherwise, and an MoE router's top-k can then pick another expert
some tokens later.

Limits: one prompt length per batch is fastest (no mask, the kernels the
benchmarks time); decoder-only text models; the cache's dtype is the model's."""
from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .tokens import CACHE_QUANTUM, batch_prompts, hit_stop, replayable, sampler, until_stop

WARMUP = 3  # eager steps before a capture (allocator, lazy kernels, compilation)


@dataclass(frozen=True)
class Generation:
    """What a `Generator` call produced and how long it took."""

    tokens: list[list[int]]  # per sequence, the new tokens (up to and with a stop token)
    prompt_tokens: int  # the longest prompt
    mode: str  # "graph", "eager", "compiled" or "compiled-graph"
    ttft_s: float  # prefill and the first token, as the caller waits for it
    decode_s: float  # the decode steps after it
    decode_steps: int

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Decode steps per second: new tokens per second per sequence, the first (prefill's) aside."""
        return self.decode_steps / self.decode_s if self.decode_steps and self.decode_s > 0 else None


@dataclass
class _Step:
    """A static KV cache and the decode step's static inputs, and its captured graph (None: run eagerly)."""

    cache: object
    ids: torch.Tensor  # [B, 1]
    pos: torch.Tensor  # [1]
    mask: torch.Tensor | None  # [B, cache length], left pads 0
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # the graph's output


def capture_graph(step: Callable[[], object], device: torch.device, warmup: int = 2,
                  join: Callable[[], None] = lambda: None, synchronize: Callable[[], None] = lambda: None):
    """Capture one call of `step` in a CUDA graph: (graph, what the call returned). Warm-up calls run on a side
    stream first, as CUDA graphs require; `join` ends each call (an offloaded model's copies in flight joined),
    `synchronize` waits for work the capture must not depend on (events recorded before it)."""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
            join()
    current.wait_stream(side)
    synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
        join()
    synchronize()
    return graph, out


class Generating:
    """What owns generators (an `OffloadHandle`, a `PlainHandle`): one per (eager, compile), made at first use, its
    caches and captured steps kept for later calls. The owner has `model`, `device`, `cuda`, `join`, `capture`."""

    generators: dict[tuple[bool, bool], "Generator"]

    def generator(self, eager: bool = False, compile: bool = False) -> "Generator":
        if (eager, compile) not in self.generators:
            self.generators[eager, compile] = Generator(self.model, self, eager=eager, compile=compile)
        return self.generators[eager, compile]

    def generate(self, prompts, max_new_tokens: int, *, eager: bool = False, compile: bool = False,
                 **kw) -> "Generation":
        """Generate after `prompts` (token ids: a [B, T] tensor, or lists): each decode step replayed from a CUDA
        graph on a GPU, unless `eager` (module doc; `kw`: sampling, stop tokens, a callback)."""
        return self.generator(eager, compile)(prompts, max_new_tokens, **kw)


class PlainHandle(Generating):
    """The handle of a model that transformers loaded alone: the same generation, nothing of offplan's to join
    (the benchmarks' all-GPU baselines)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.device = next(model.parameters()).device
        self.cuda = self.device.type == "cuda"
        self.generators = {}

    def join(self) -> None:
        pass

    def capture(self, step, warmup: int = 2):
        return capture_graph(step, self.device, warmup)

    def remove(self, restore: bool = True) -> None:
        self.generators = {}


class Generator:
    """Generation for one model and its handle (module doc): an `OffloadHandle` (most simply
    `handle.generate(...)`) or a `PlainHandle`. Lifecycle: made -> `prepare` (optional) and calls -> `release()`
    (the handle's `remove()` does it)."""

    def __init__(self, model: torch.nn.Module, handle, *, eager: bool = False, compile: bool = False):
        self.model, self.handle, self.device = model, handle, handle.device
        self.replay = handle.cuda and not eager
        if self.replay:
            self.mode = "compiled-graph" if compile else "graph"
        else:
            self.mode = "compiled" if compile else "eager"
        self.forward = torch.compile(model) if compile else model
        self.steps: dict[tuple[int, int, bool], _Step] = {}
        # the prefill's last logits only: 8192 tokens' over Llama-3.1-8B's vocabulary would take 2.1 GB (bf16)
        keeps = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._last_only = {"logits_to_keep": 1} if keeps else {}

    def prepare(self, prompts, max_new_tokens: int, *, pad_id: int = 0) -> None:
        """Pay a call's one-time costs before it is timed: make (and capture) the decode step of its shape, then
        run the call's loop for its prefill and `WARMUP` decode steps (greedy, tokens dropped). A first replay
        uploads the graph, and the loop's own small kernels load at their first launch."""
        ids, _, step = self._shape(prompts, max_new_tokens, pad_id)
        self._loop(ids, step, min(max_new_tokens, WARMUP + 1), sampler(False, 1.0, None, 0, self.device))

    def __call__(self, prompts: torch.Tensor | Sequence[Sequence[int]], max_new_tokens: int, *,
                 pad_id: int = 0, stop: Sequence[int] = (), do_sample: bool = False, temperature: float = 1.0,
                 top_k: int | None = None, seed: int = 0,
                 on_token: Callable[[int, list[int]], None] | None = None) -> Generation:
        """Generate `max_new_tokens` tokens after each prompt (fewer after a stop token). `on_token(i, tokens)`
        is called with each step's new token of every sequence, as it comes."""
        ids, _, step = self._shape(prompts, max_new_tokens, pad_id)
        return self._loop(ids, step, max_new_tokens, sampler(do_sample, temperature, top_k, seed, self.device),
                          stop, on_token)

    def _loop(self, ids: torch.Tensor, step: _Step, max_new_tokens: int, sample, stop: Sequence[int] = (),
              on_token: Callable[[int, list[int]], None] | None = None) -> Generation:
        """Prefill, then the decode steps over `step` (module doc), timed."""
        batch, length = ids.shape
        stops = torch.tensor(list(stop), dtype=torch.long, device=self.device) if stop else None
        eager_host = on_token is not None or stops is not None  # the host reads every step's tokens
        host = getattr(self.handle, "host_experts", None)  # experts on cpu (host/engine.py)
        # at most two replays in flight, this thread asleep otherwise (module doc)
        in_flight = [torch.cuda.Event(blocking=True) for _ in range(2)] if host is not None and self.replay else None
        with torch.no_grad(), self._host_failures(host):
            self._sync()
            start = time.perf_counter()
            token = sample(self._prefill(step, ids)[:, -1])  # [B]
            out = [token]
            done = hit_stop(token, stops, None)
            if on_token is not None:
                on_token(0, token.tolist())
            self._sync()
            first = time.perf_counter()
            steps = 0
            for i in range(1, max_new_tokens):
                if eager_host and bool(done.all()):
                    break
                step.ids.copy_(token.view(batch, 1))
                step.pos.fill_(length + i - 1)
                if step.graph is not None:
                    if in_flight is not None:
                        in_flight[i % 2].synchronize()  # the replay before last (the GIL released)
                        host.check()
                    step.graph.replay()
                    logits = step.logits
                    if in_flight is not None:
                        in_flight[i % 2].record()
                else:
                    logits = self._run(step)
                token = sample(logits[:, -1])
                out.append(token)
                steps += 1
                done = hit_stop(token, stops, done)
                if on_token is not None:
                    on_token(i, token.tolist())
            self._sync()
            end = time.perf_counter()
        if host is not None:
            host.check()  # a failure in the last replays' host work
        tokens = torch.stack(out, dim=1).tolist()
        return Generation([until_stop(t, stop) for t in tokens], length, self.mode, first - start, end - first,
                          steps)

    @contextlib.contextmanager
    def _host_failures(self, host):
        """A call that fails with experts on cpu (host/engine.py) waits for its replays in flight, whose failures
        are its own, raised now: the next call does not inherit them."""
        try:
            yield
        except BaseException:
            if host is not None:
                self._sync()
                host.clear()
            raise

    def _shape(self, prompts, max_new_tokens: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor | None, _Step]:
        """(ids [B, T], their mask or None, the decode step of this shape with its mask set)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, not {max_new_tokens}")
        ids, mask = batch_prompts(prompts, pad_id, self.device)
        length = ids.shape[1]
        cache_len = -(-(length + max_new_tokens) // CACHE_QUANTUM) * CACHE_QUANTUM
        step = self._step(ids.shape[0], cache_len, mask is not None)
        if step.mask is not None:
            step.mask.fill_(1)
            step.mask[:, :length].copy_(mask)
        return ids, mask, step

    def _prefill(self, step: _Step, ids: torch.Tensor) -> torch.Tensor:
        """The prompts' forward over the emptied cache (the plan's prefill staging runs): logits [B, 1 or T, V]."""
        step.cache.reset()
        logits = self.model(ids, past_key_values=step.cache, attention_mask=step.mask,
                            cache_position=torch.arange(ids.shape[1], device=self.device), **self._last_only).logits
        self.handle.join()
        return logits

    def _step(self, batch: int, cache_len: int, masked: bool) -> _Step:
        """The static cache and decode step for this shape, made (and captured) at its first use."""
        key = (batch, cache_len, masked)
        if key in self.steps:
            return self.steps[key]
        from transformers import StaticCache
        cache = StaticCache(config=self.model.config, max_cache_len=cache_len)
        if self.replay:
            replayable(cache, cache_len, type(self.model).__name__, masked)  # tokens.py: mask and cache
        step = _Step(cache, torch.zeros(batch, 1, dtype=torch.long, device=self.device),
                     torch.zeros(1, dtype=torch.long, device=self.device),
                     torch.ones(batch, cache_len, dtype=torch.long, device=self.device) if masked else None)
        with torch.no_grad():
            # a prefill of one token fills the cache's tensors (transformers allocates them lazily, on first use)
            self.model(step.ids, past_key_values=cache, attention_mask=step.mask, cache_position=step.pos)
            self.handle.join()
            if self.replay:
                step.graph, step.logits = self.handle.capture(lambda: self._run(step, join=False), warmup=WARMUP)
            else:
                for _ in range(WARMUP if self.forward is not self.model else 0):  # compilation
                    self._run(step)
        self.steps[key] = step
        return step

    def _run(self, step: _Step, join: bool = True) -> torch.Tensor:
        logits = self.forward(step.ids, past_key_values=step.cache, attention_mask=step.mask,
                              cache_position=step.pos).logits
        if join:
            self.handle.join()
        return logits

    def _sync(self) -> None:
        if self.handle.cuda:
            torch.cuda.synchronize(self.device)

    def release(self) -> None:
        """Drop the caches and captured graphs (their GPU memory goes back to the allocator)."""
        self.steps = {}
