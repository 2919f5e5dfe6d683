"""What each process of the tensor-parallel tests does (tests/execute/test_parallel.py, test_parallel_gpu.py):
module-level functions, so that runtime.distributed.launch.run_ranks can start them in fresh processes."""
from __future__ import annotations

import dataclasses

import torch

from planner.errors import OffplanError
from tiny_models import logits

PROMPT = [[3, 1, 4, 1, 5, 9, 2, 6]]


def load_and_run(rank: int, plans: list[str], device: str, new_tokens: int = 8, eager: bool = True) -> list[dict]:
    """Per plan: this rank's logits (bf16 on the CPU), greedy tokens, load stats and the share's shapes."""
    from runtime.hf import from_pretrained
    out = []
    for plan in plans:
        model, handle = from_pretrained(plan, device=device, progress=False)
        try:
            got = logits(model, device)
            gen = handle.generate(torch.tensor(PROMPT), new_tokens, eager=eager)
            stats = handle.stats()
            out.append({"logits": got.cpu(), "tokens": gen.tokens, "mode": gen.mode,
                        "bytes": (stats.gpu_bytes, stats.uva_bytes, stats.prefetch_bytes),
                        "shapes": {n: tuple(p.shape) for n, p in model.named_parameters()},
                        "dtypes": {n: p.dtype for n, p in model.named_parameters()},
                        "buffers": {n: tuple(b.shape) for n, b in model.named_buffers()},
                        "peak": stats.peak_gpu_bytes_during_load,
                        "host": (handle.host_experts.threads, handle.host_experts.host_calls)
                        if handle.host_experts else None,
                        "hooks": (len(handle.parallel.reduced), len(handle.parallel.gathered))
                        if handle.parallel else None})
        finally:
            handle.remove(restore=False)
    return out


def load_with(rank: int, plan_path: str, split: tuple, device: str) -> str:
    """Load the plan with its `parallel.split` replaced by `split`: the error the runtime gives."""
    from planner.planfile import load_plan
    from runtime.hf import build_meta_model
    from runtime.load_steps import load
    plan = load_plan(plan_path)
    plan = dataclasses.replace(plan, parallel=dataclasses.replace(plan.parallel, split=split))
    ckpt = plan.checkpoint_dir(plan_path)
    try:
        load(build_meta_model(ckpt), plan, checkpoint=ckpt, device=device, progress=False)
    except OffplanError as e:
        return str(e)
    return ""
