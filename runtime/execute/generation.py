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
tokens once, at the end.

Greedy tokens are those of transformers' `generate` on the same model and
prompts with a static cache of the same length, eager on the CPU
(tests/execute/test_generation.py) and replayed on CUDA (test_generation_gpu.py).
With a cache of another length, attention rounds otherwise, and an MoE router's
top-k can then pick another expert some tokens later.

Limits: one prompt length per batch is fastest (no mask, the kernels the
benchmarks time); decoder-only text models; the cache's dtype is the model's.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

CACHE_QUANTUM = 128  # cache lengths are rounded up to a multiple of this, so nearby calls share a captured step
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


class _Plain:
    """The handle of a model that transformers loaded alone (nothing of offplan's to join)."""

    def __init__(self, model: torch.nn.Module):
        self.device = next(model.parameters()).device
        self.cuda = self.device.type == "cuda"

    def join(self) -> None:
        pass

    def capture(self, step, warmup: int = 2):
        return capture_graph(step, self.device, warmup)


class Generator:
    """Generation for one model (module doc): loaded by offplan (`handle`, its `OffloadHandle`; most simply
    `handle.generate(...)`) or by transformers alone (`handle` None: the same loop, for comparison). Lifecycle:
    made -> calls -> `release()` (an offplan handle's `remove()` does it)."""

    def __init__(self, model: torch.nn.Module, handle=None, *, eager: bool = False, compile: bool = False):
        self.model = model
        self.handle = handle if handle is not None else _Plain(model)
        self.device = self.handle.device
        self.replay = self.handle.cuda and not eager
        self.mode = ("compiled-" if compile else "") + ("graph" if self.replay else "eager")
        if self.mode == "compiled-eager":
            self.mode = "compiled"
        self.forward = torch.compile(model) if compile else model
        self.steps: dict[tuple[int, int, bool], _Step] = {}

    def __call__(self, prompts: torch.Tensor | Sequence[Sequence[int]], max_new_tokens: int, *,
                 pad_id: int = 0, stop: Sequence[int] = (), do_sample: bool = False, temperature: float = 1.0,
                 top_k: int | None = None, seed: int = 0,
                 on_token: Callable[[int, list[int]], None] | None = None) -> Generation:
        """Generate `max_new_tokens` tokens after each prompt (fewer after a stop token). `on_token(i, tokens)`
        is called with each step's new token of every sequence, as it comes."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, not {max_new_tokens}")
        ids, mask = _batch(prompts, pad_id, self.device)
        batch, length = ids.shape
        total = length + max_new_tokens
        cache_len = -(-total // CACHE_QUANTUM) * CACHE_QUANTUM
        step = self._step(batch, cache_len, mask is not None)
        if step.mask is not None:
            step.mask.fill_(1)
            step.mask[:, :length].copy_(mask)
        sample = _sampler(do_sample, temperature, top_k, seed, self.device)
        stops = torch.tensor(list(stop), dtype=torch.long, device=self.device) if stop else None
        eager_host = on_token is not None or stops is not None  # the host reads every step's tokens
        with torch.no_grad():
            self._sync()
            start = time.perf_counter()
            step.cache.reset()
            logits = self.model(ids, past_key_values=step.cache, attention_mask=step.mask,
                                cache_position=torch.arange(length, device=self.device)).logits
            self.handle.join()
            token = sample(logits[:, -1])  # [B]
            out = [token]
            done = _done(token, stops, None)
            if eager_host:
                self._emit(on_token, 0, token)
            self._sync()
            first = time.perf_counter()
            steps = 0
            for i in range(1, max_new_tokens):
                if eager_host and bool(done.all()):
                    break
                step.ids.copy_(token.view(batch, 1))
                step.pos.fill_(length + i - 1)
                if step.graph is not None:
                    step.graph.replay()
                    logits = step.logits
                else:
                    logits = self._run(step)
                token = sample(logits[:, -1])
                out.append(token)
                steps += 1
                done = _done(token, stops, done)
                if eager_host:
                    self._emit(on_token, i, token)
            self._sync()
            end = time.perf_counter()
        tokens = torch.stack(out, dim=1).tolist()
        return Generation([_until_stop(t, stop) for t in tokens], length, self.mode, first - start, end - first,
                          steps)

    def _step(self, batch: int, cache_len: int, masked: bool) -> _Step:
        """The static cache and decode step for this shape, made (and captured) at its first use."""
        key = (batch, cache_len, masked)
        if key in self.steps:
            return self.steps[key]
        from transformers import StaticCache
        cache = StaticCache(config=self.model.config, max_cache_len=cache_len)
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

    @staticmethod
    def _emit(on_token, i: int, token: torch.Tensor) -> None:
        if on_token is not None:
            on_token(i, token.tolist())

    def release(self) -> None:
        """Drop the caches and captured graphs (their GPU memory goes back to the allocator)."""
        self.steps = {}


def _batch(prompts, pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """([B, T] ids, left-padded to the longest prompt; [B, T] mask of the real tokens, None without pads)."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2 or prompts.shape[1] < 1:
            raise ValueError(f"prompts: a [batch, tokens] tensor of token ids, not shape {tuple(prompts.shape)}")
        return prompts.to(device=device, dtype=torch.long), None
    rows = [list(p) for p in prompts]
    if not rows or not all(rows):
        raise ValueError("prompts: one or more prompts of one or more token ids each")
    length = max(map(len, rows))
    ids = torch.tensor([[pad_id] * (length - len(r)) + r for r in rows], dtype=torch.long, device=device)
    if all(len(r) == length for r in rows):
        return ids, None
    mask = torch.tensor([[0] * (length - len(r)) + [1] * len(r) for r in rows], dtype=torch.long, device=device)
    return ids, mask


def _sampler(do_sample: bool, temperature: float, top_k: int | None, seed: int, device):
    """logits [B, V] -> tokens [B]: argmax, or a sample at `temperature` among the `top_k` likeliest."""
    if not do_sample:
        return lambda logits: logits.argmax(dim=-1)
    if temperature <= 0:
        raise ValueError(f"temperature must be above 0, not {temperature}")
    generator = torch.Generator(device=device).manual_seed(seed)

    def sample(logits: torch.Tensor) -> torch.Tensor:
        scores = logits.float() / temperature
        if top_k is not None:
            kth = scores.topk(min(top_k, scores.shape[-1]), dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        return torch.multinomial(scores.softmax(dim=-1), 1, generator=generator).view(-1)
    return sample


def _done(token: torch.Tensor, stops: torch.Tensor | None, done: torch.Tensor | None) -> torch.Tensor:
    hit = torch.isin(token, stops) if stops is not None else torch.zeros_like(token, dtype=torch.bool)
    return hit if done is None else done | hit


def _until_stop(tokens: list[int], stop: Sequence[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[:i + 1]
    return tokens
