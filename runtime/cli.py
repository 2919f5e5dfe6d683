"""`plan apply PLAN`: load the plan's checkpoint with transformers per the plan, report, generate."""
from __future__ import annotations

import json
import time

import torch

from planner.errors import OffplanError
from planner.report import human

from .hf import from_pretrained


def apply_command(args) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise OffplanError("--device cuda: no CUDA device here (leave --device out to use the CPU)")
    model, handle = from_pretrained(args.plan, device=args.device)
    try:
        stats = handle.stats()
        gen = _generate(model, handle, args.prompt, args.max_new_tokens)
        if args.json:
            print(json.dumps({"stats": stats, **gen}, indent=2))
            return 0
        s = stats
        print(f"loaded {args.plan} on {s['device']} in {s['load_seconds']:.2f} s "
              f"({s['load_gb_per_s'] or 0:.2f} GB/s)")
        where = "GPU" if s["device"].startswith("cuda") else "CPU (no CUDA: uva stays in host memory, prefetch copies synchronously)"
        print(f"  resident {human(s['gpu_bytes'])}, uva {human(s['uva_bytes'])}, prefetch {human(s['prefetch_bytes'])}"
              f" (+{human(s['gpu_buffer_bytes'])} prefetch buffers), on the {where}")
        if s["pinned_host_bytes"]:
            print(f"  pinned host memory {human(s['pinned_host_bytes'])} "
                  f"({s['pinned_ratio']:.3f}x the offloaded bytes)")
        if s["device"].startswith("cuda"):
            print(f"  peak GPU memory during the load {human(s['peak_gpu_bytes_during_load'])}")
        print(f"generated {gen['new_tokens']} tokens in {gen['seconds']:.2f} s ({gen['tokens_per_s']:.1f} tok/s)")
        print(f"  {gen['text']!r}" if gen["text"] is not None else f"  token ids {gen['token_ids']}")
        return 0
    finally:
        handle.remove(restore=False)


def _generate(model, handle, prompt: str, max_new_tokens: int) -> dict:
    """Greedy decode; uses the checkpoint's tokenizer when it has one, else the prompt's bytes as ids."""
    tokenizer = None
    root = handle.checkpoint.root
    if (root / "tokenizer.json").is_file() or (root / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(root)
    vocab = model.get_input_embeddings().num_embeddings
    if tokenizer is not None:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
    else:
        ids = torch.tensor([[b % vocab for b in prompt.encode()]])
    ids = ids.to(handle.device)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False)  # warm-up
        if handle.cuda:
            torch.cuda.synchronize(handle.device)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False)
        if handle.cuda:
            torch.cuda.synchronize(handle.device)
        seconds = time.perf_counter() - start
    new = out[0, ids.shape[1]:].tolist()
    return {"new_tokens": len(new), "seconds": seconds, "tokens_per_s": len(new) / seconds,
            "token_ids": new, "text": tokenizer.decode(new) if tokenizer is not None else None}
