"""The decode loops the benchmarks time: the same prompts for every plan, transformers' `generate` (eager), and
the runtime's generation (static cache; a captured decode step replayed, or a torch.compile'd one), which is what
`plan apply` and `handle.generate` run."""
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


def decode_static(model, handle, ids: torch.Tensor, new: int, mode: str, batch: int = 1,
                  prepared=lambda: None) -> tuple[float, list]:
    """Greedy decode of `batch` sequences through the runtime's generation (runtime/execute/generation.py: static
    KV cache, the loop `plan apply` runs): `graph` replays one captured decode step (CUDA graph), `compiled` runs a
    torch.compile'd step, `compiled-graph` replays one captured step of it (Inductor's fused kernels). `prepare`
    captures and warms up (then `prepared()` is called); the call is timed. Returns (decode steps per second, the
    first `new` tokens)."""
    generator = handle.generator(eager=mode == "compiled", compile=mode in ("compiled", "compiled-graph"))
    generator.prepare(ids[:batch], new + 1)  # capture (and compile), warm-up
    prepared()
    got = generator(ids[:batch], new + 1)
    return got.decode_tokens_per_s, [t[:new] for t in got.tokens]
