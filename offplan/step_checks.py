"""What `plan apply`'s decode step can run on a GPU, checked before it runs: --compile's grouped GEMMs take bf16
only; a replayed step cannot roll a sliding-window cache; and a step that a CUDA graph capture refuses."""
from __future__ import annotations

import contextlib

import torch

from planner.errors import OffplanError
from runtime.execute import experts
from runtime.execute.generation import CACHE_QUANTUM
from runtime.place.dequant import quantized


@contextlib.contextmanager
def capture_refused():
    """A capture's refusal (torch's RuntimeError naming the capture, or CUDA's "stream is capturing") as one error
    naming --eager. gpt-oss is such a model: transformers' eager attention mask takes its 0 from a host scalar, a
    copy a capture refuses."""
    try:
        yield
    except RuntimeError as e:
        if "captur" not in str(e):
            raise
        raise OffplanError(f"the decode step could not be captured in a CUDA graph ({e}): run with --eager (gpt-oss's "
                           "eager attention builds its mask from a host scalar)") from None


def check_replays(config, tokens: int) -> None:
    """A replayed decode step repeats the branches its capture took. transformers' static sliding-window cache
    (StaticSlidingWindowLayer: gpt-oss, Gemma 2 and 3, Llama 4's chunks) counts its tokens in a Python int and rolls
    its buffer once that count reaches its window: a captured step never rolls it, so past the window it would
    attend to stale keys, silently. Below the window it never rolls. So a generation whose cache (`tokens`, rounded
    up as generation.py does) is longer than a sliding layer's window is refused, naming --eager."""
    from transformers import StaticCache
    cache_len = -(-tokens // CACHE_QUANTUM) * CACHE_QUANTUM
    cache = StaticCache(config=config, max_cache_len=cache_len)  # its tensors are made at first use: none here
    windows = [layer.max_cache_len for layer, sliding in zip(cache.layers, cache.is_sliding) if sliding]
    if windows and min(windows) < cache_len:
        raise OffplanError(f"the model's sliding-window attention keeps {min(windows)} tokens, and a decode step "
                           f"replayed from a CUDA graph cannot roll that window (transformers' static cache counts "
                           f"it in Python): {tokens} prompt and new tokens need a cache of {cache_len}; run with "
                           f"--eager, or keep the prompt and --max-new-tokens within {min(windows)}")


def check_compiles(model, handle, batch: int) -> None:
    """--compile: where a step's offloaded experts run a grouped GEMM (experts.py `arithmetic`), torch.compile traces
    it for bf16 only; refuse other dtypes before compiling."""
    k = getattr(model.config, "num_experts_per_tok", None)
    odd = {next(iter(q.values())).dtype if (q := quantized(m)) else m.down_proj.dtype  # each one's arithmetic
           for m in handle.bound_experts} - {torch.bfloat16}
    if odd and (k is None or experts.arithmetic(batch * k) == "grouped_mm"):
        dtype = ", ".join(sorted(str(d).removeprefix("torch.") for d in odd))
        most = max((b for b in range(1, batch) if experts.arithmetic(b * k) != "grouped_mm"), default=0) if k else 0
        fits = f", or run at batch {most} or less" if most else ""
        raise OffplanError(f"--compile: at batch {batch} the decode step's offloaded experts run a grouped GEMM, which "
                           f"torch.compile takes in bf16 only, and this model is {dtype}: leave --compile out{fits}")
