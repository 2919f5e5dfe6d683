"""The decode loops the benchmarks time: the same prompts for every plan, transformers' `generate` (eager), and
a static-cache loop that replays a captured decode step (CUDA graph) or runs a torch.compile'd one."""
from __future__ import annotations

import time

import torch

PROMPT_LEN = 16


def prompts(vocab: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(3, vocab, (32, PROMPT_LEN), generator=g).to(device)


def sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def decode(model, ids: torch.Tensor, batch: int, new: int, device) -> tuple[float, list]:
    """(decode steps per second, greedy tokens) for `new` tokens at `batch`."""
    x = ids[:batch]
    mask = torch.ones_like(x)
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=0)

    def gen(n):
        sync(device)
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(x, max_new_tokens=n, min_new_tokens=n, **kw)
        sync(device)
        return time.perf_counter() - t, out

    gen(3)  # warm-up
    t1, _ = gen(1)
    tn, out = gen(new + 1)
    return new / max(tn - t1, 1e-9), out[:, PROMPT_LEN:].tolist()


def decode_static(model, handle, ids: torch.Tensor, new: int, mode: str, batch: int = 1) -> tuple[float, list]:
    """Greedy decode of `batch` sequences with a static KV cache: `compiled` runs a torch.compile'd forward,
    `graph` replays one captured decode step (CUDA graph), `compiled-graph` one captured step of the
    torch.compile'd forward (Inductor's fused kernels, replayed). Returns (steps per second, tokens)."""
    from transformers import StaticCache
    prompt = ids[:batch]
    pos = torch.arange(PROMPT_LEN, device=prompt.device)
    cache = StaticCache(config=model.config, max_cache_len=PROMPT_LEN + new + 8)
    static_ids = torch.zeros(batch, 1, dtype=torch.long, device=prompt.device)
    static_pos = torch.tensor([PROMPT_LEN], device=prompt.device)
    step = torch.compile(model) if mode in ("compiled", "compiled-graph") else model
    replayed = mode in ("graph", "compiled-graph")
    with torch.no_grad():
        def prefill():
            cache.reset()
            out = model(prompt, past_key_values=cache, cache_position=pos).logits
            handle.join()
            return out[:, -1:].argmax(-1)
        prefill()
        if replayed:
            graph, static_logits = handle.capture(
                lambda: step(static_ids, past_key_values=cache, cache_position=static_pos).logits, warmup=3)
        else:
            for _ in range(3):  # warm-up and compilation
                step(static_ids, past_key_values=cache, cache_position=static_pos)
                handle.join()
        token = prefill()
        tokens = [token]
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(new):
            static_ids.copy_(token)
            static_pos.fill_(PROMPT_LEN + i)
            if replayed:
                graph.replay()
                logits = static_logits
            else:
                logits = step(static_ids, past_key_values=cache, cache_position=static_pos).logits
                handle.join()
            token = logits[:, -1:].argmax(-1)
            tokens.append(token)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t
    return new / seconds, torch.cat(tokens, 1)[:, :new].tolist()


class Plain:
    """decode_static's handle for a model that transformers loaded alone: nothing to join or remove."""

    def join(self) -> None:
        pass

    def capture(self, step, warmup: int = 2):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capturing stream, as CUDA graphs require
            for _ in range(warmup):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        return graph, out

    def remove(self, restore: bool = True) -> None:
        pass
