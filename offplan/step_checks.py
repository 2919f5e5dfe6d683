"""What `plan apply`'s decode step can run on a GPU, checked before it runs: --compile's grouped GEMMs take bf16
only; a replayed step's sliding-window cache (prompts of several lengths past a window); and a step that a CUDA graph
capture refuses."""
from __future__ import annotations

import contextlib

import torch

from planner.errors import OffplanError
from runtime.execute import experts
from runtime.execute.generation import CACHE_QUANTUM
from runtime.execute.tokens import check_window
from runtime.place.dequant import quantized


@contextlib.contextmanager
def capture_refused():
    """A capture's refusal (torch's RuntimeError naming the capture, or CUDA's "stream is capturing") as one error
    naming --eager: a model whose step copies from the host (as transformers' eager attention mask did before
    tokens.py `replayable` registered a capturable one) cannot be replayed."""
    try:
        yield
    except RuntimeError as e:
        if "captur" not in str(e):
            raise
        raise OffplanError(f"the decode step could not be captured in a CUDA graph ({e}): run with --eager") from None


def check_replays(config, tokens: int, model_name: str, masked: bool = False) -> None:
    """The runtime's own refusals of a replayed decode step (runtime/execute/tokens.py `check_window`, which the
    generator runs again at capture), from the config alone: a sliding-window cache layer the runtime does not make
    replayable, and, for prompts of several lengths (`masked`), a cache of `tokens` longer than a sliding window."""
    from transformers import StaticCache
    cache_len = -(-tokens // CACHE_QUANTUM) * CACHE_QUANTUM  # as generation.py rounds it
    cache = StaticCache(config=config, max_cache_len=cache_len)  # its tensors are made at first use: none here
    try:
        check_window(cache, cache_len, model_name, masked)
    except ValueError as e:
        raise OffplanError(str(e)) from None


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
