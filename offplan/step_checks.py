"""What `plan apply`'s decode step can run on a GPU, checked before it runs: --compile's grouped GEMMs take bf16
only; a replayed step cannot advance a sliding-window cache's count; and a step that a CUDA graph capture refuses."""
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
    naming --eager."""
    try:
        yield
    except RuntimeError as e:
        if "captur" not in str(e):
            raise
        raise OffplanError(f"the decode step could not be captured in a CUDA graph ({e}): run with --eager") from None


def check_replays(config) -> None:
    """`plan apply` runs this before loading, where its decode steps would be replayed: a replayed decode step
    repeats what its capture computed on the host. transformers' static sliding-window
    cache layer (StaticSlidingWindowLayer: Gemma 2 and 3, gpt-oss, Llama 4's chunks; transformers 5.17) keeps its
    length in a Python int, which its masks take as the query's offset (`get_seq_length`) and by which it rolls its
    window: a replay advances neither, so every replayed step would attend as at the capture's position (and past
    the window to stale keys), silently. So a model with such a layer is refused a replay, naming --eager. The full
    layers' StaticLayer keeps its length on the device, which a replay advances."""
    from transformers import StaticCache
    cache = StaticCache(config=config, max_cache_len=CACHE_QUANTUM)  # its tensors are made at first use: none here
    if any(cache.is_sliding):
        raise OffplanError("the model has sliding-window attention layers, whose masks transformers' static cache "
                           "builds from a count kept in Python: a decode step replayed from a CUDA graph would attend "
                           "as at the position it was captured at; run with --eager")


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
