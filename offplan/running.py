"""`plan apply` and `plan calibrate`, two of the commands that need torch (the third, `plan profile`, is profiling.py).

`plan apply PLAN`: load the plan's checkpoint with transformers per the plan, report, generate.

What the report says about the checkpoint, and how it knows:
- no tokenizer: none of the files transformers reads one from (`TOKENIZER_FILES`)
  sits beside the weights; the prompt's UTF-8 bytes are then the input ids and
  the output is token ids;
- random weights: nothing in a checkpoint tells trained weights from random
  ones, so only a declaration counts: `"offplan_random_weights": true` in its
  config.json, which `plans/examples/make_tiny.py` writes for the bundled
  example. Without it the report says nothing either way.
The predicted decode step comes from the plan (its cost model and hardware
profile), the measured one from this run's greedy generation.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from planner.errors import OffplanError
from planner.files import write_atomic
from planner.inputs.hardware import dumps_hardware
from planner.units import human, ms
from runtime.execute.handle import LoadStats
from runtime.hf import from_pretrained
from runtime.measure.calibrate import calibrate

from .output import emit

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
RANDOM_WEIGHTS_KEY = "offplan_random_weights"


def check_device(args) -> None:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise OffplanError("--device cuda: no CUDA device here (leave --device out to use the CPU)")


def apply_command(args) -> int:
    check_device(args)
    # The bar on a terminal; elsewhere nothing from the loader, since the report below says it all.
    model, handle = from_pretrained(args.plan, device=args.device, progress=None if sys.stderr.isatty() else False)
    try:
        stats = handle.stats()
        root = Path(handle.checkpoint.root)
        facts = {"tokenizer": has_tokenizer(root), "random_weights": declares_random_weights(root)}
        gen = _generate(model, handle, args.prompt, args.max_new_tokens, facts["tokenizer"])
        plan = handle.plan
        predicted = plan.summary.predicted_step_us if plan.cost else None
        measured_us = gen["seconds"] / gen["new_tokens"] * 1e6
        if args.json:
            print(json.dumps({"stats": {**dataclasses.asdict(stats), "pinned_ratio": stats.pinned_ratio,
                                        "load_bytes_per_s": stats.load_bytes_per_s},
                              **facts, "predicted_step_us": predicted,
                              "measured_us_per_token": round(measured_us), **gen}, indent=2))
            return 0
        for line in report(args.plan, stats, facts, gen, plan, root, measured_us):
            print(line)
        return 0
    finally:
        handle.remove(restore=False)


def has_tokenizer(root: Path) -> bool:
    return any((root / name).is_file() for name in TOKENIZER_FILES)


def declares_random_weights(root: Path) -> bool:
    """True when the checkpoint's config.json says `"offplan_random_weights": true` (see the module doc)."""
    try:
        return json.loads((root / "config.json").read_text()).get(RANDOM_WEIGHTS_KEY) is True
    except (OSError, ValueError, AttributeError):
        return False


def report(plan_path, s: LoadStats, facts: dict, gen: dict, plan, root: Path, measured_us: float) -> list[str]:
    """The lines `plan apply` prints (bytes in binary units, times in milliseconds)."""
    total = s.gpu_bytes + s.uva_bytes + s.prefetch_bytes
    rate = f", {human(total / s.load_seconds)}/s" if s.load_seconds else ""
    cuda = s.device.startswith("cuda")
    where = "GPU" if cuda else "CPU (no CUDA: uva stays in host memory, prefetch copies synchronously)"
    buffers = f" (+{human(s.gpu_buffer_bytes)} prefetch buffers)" if s.gpu_buffer_bytes else ""
    out = [f"loaded {plan_path} on {s.device} in {s.load_seconds:.2f} s ({human(total)}{rate})",
           f"  resident {human(s.gpu_bytes)}, uva {human(s.uva_bytes)}, prefetch "
           f"{human(s.prefetch_bytes)}{buffers}, on the {where}"]
    if s.pinned_host_bytes:
        out.append(f"  pinned host memory {human(s.pinned_host_bytes)} "
                   f"({s.pinned_ratio:.3f}x the offloaded bytes)")
    if cuda:
        out.append(f"  peak GPU memory during the load {human(s.peak_gpu_bytes_during_load)}")
    if facts["random_weights"]:
        out.append(f"note: the weights are random (its config.json says \"{RANDOM_WEIGHTS_KEY}\": true): the "
                   "generated tokens mean nothing; the run shows that the plan loads and runs")
    if not facts["tokenizer"]:
        out.append(f"note: no tokenizer beside the weights ({', '.join(TOKENIZER_FILES)} are missing from "
                   f"{root}): the prompt's UTF-8 bytes are the input ids, and the output is token ids")
    out.append(f"generated {gen['new_tokens']} tokens in {gen['seconds']:.2f} s ({gen['tokens_per_s']:.1f} tok/s)")
    out.append(f"  measured {ms(measured_us)} per token here ({s.device}, greedy generation, prefill of the "
               "prompt included)")
    if plan.cost is not None:
        c = plan.cost
        mode = "CUDA graph replay" if c.cuda_graphs else "eager"
        unlike = ("this run is on the CPU" if not cuda else
                  "this run is eager at batch 1" if c.cuda_graphs or c.batch_size != 1 else "")
        out.append(f"  predicted {ms(plan.summary.predicted_step_us)} per decode step by the plan, for batch "
                   f"{c.batch_size}, {mode}, on {c.hardware}" + (f"; {unlike}: they do not compare" if unlike else ""))
    out.append(f"  {gen['text']!r}" if gen["text"] is not None else f"  token ids {gen['token_ids']}")
    return out


def _generate(model, handle, prompt: str, max_new_tokens: int, tokenizer_files: bool) -> dict:
    """Greedy decode; uses the checkpoint's tokenizer when it has one, else the prompt's bytes as ids."""
    tokenizer = None
    if tokenizer_files:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(handle.checkpoint.root)
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


def calibrate_command(args) -> int:
    """`plan calibrate -o PROFILE`: measure this GPU (runtime/measure/calibrate.py), write a hardware profile."""
    cal = calibrate()
    hw = cal.hardware
    write_atomic(Path(args.output), dumps_hardware(hw), "hardware profile")
    steps = ", ".join(f"{n}: {us:.0f}" for n, us in cal.step_us_by_layers.items())
    emit(args, {"profile": args.output, **hw.__dict__, "step_us_by_layers": cal.step_us_by_layers, "r2": cal.r2,
                "stage_ms": {m: list(t) for m, t in cal.stage_ms.items()},
                "replay_us_by_layers": cal.replay_us_by_layers},
          f"wrote {args.output}: {hw.name}: H2D copy {hw.h2d_copy_gbps} GB/s, UVA read {hw.uva_read_gbps} GB/s, "
          f"HBM read {hw.hbm_read_gbps} GB/s; CPU {hw.layer_overhead_us} us per layer + {hw.step_overhead_us} us "
          f"per step (eager decode step by layer count, us: {steps}; R^2 {cal.r2:.4f}); GPU {hw.layer_gpu_us} us "
          f"per dense layer, {hw.moe_layer_gpu_us} us per MoE layer + {hw.step_gpu_us} us per step beyond "
          f"reading weights (CUDA-graph replays of tiny models); prefill: GEMMs "
          f"{hw.matmul_tflops} TFLOP/s, uva layers staged above {hw.stage_above_tokens} tokens")
    return 0
