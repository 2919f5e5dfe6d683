"""The commands of `plan` that need torch: `apply`, `calibrate` and `profile`.

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

`plan profile CHECKPOINT_OR_PLAN -o PROFILE`: record a routing profile
(runtime/routing.py) with the model all on one device, or loaded per a plan.
The prompts: a text file, one per line, tokenized with the checkpoint's
tokenizer (`--prompts`; a checkpoint without one cannot tokenize them), else
random token ids from a fixed seed (`--random-prompts`, the default), which
the output and the profile say: routing on random input is not a workload's.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

from planner.errors import OffplanError, PlanFileError
from planner.files import relpath, write_atomic
from planner.inputs import yamlio
from planner.inputs.checkpoint import INDEX_NAME, Checkpoint, open_checkpoint
from planner.inputs.hardware import dumps_hardware
from planner.inputs.routing import skew, write_profile
from planner.planfile import load_plan
from planner.units import human, ms, plural
from runtime.execute.handle import LoadStats
from runtime.hf import from_pretrained
from runtime.measure.calibrate import calibrate
from runtime.measure.routing import checkpoint_groups, record_routing
from runtime.place.loader import check_holds_weights

from .cli import PROMPT_LEN, RANDOM_PROMPTS, SEED
from .output import emit

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
RANDOM_WEIGHTS_KEY = "offplan_random_weights"


def _check_device(args) -> None:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise OffplanError("--device cuda: no CUDA device here (leave --device out to use the CPU)")


def apply_command(args) -> int:
    _check_device(args)
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
    """`plan calibrate -o PROFILE`: measure this GPU (runtime/calibrate.py), write a hardware profile."""
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


def profile_command(args) -> int:
    """`plan profile SOURCE -o PROFILE`: record which experts the prompts route to; write a routing profile.

    Every input is checked before the model loads: the source, the output, the prompts
    and their tokens; what can fail after that is the model's own business."""
    _check_device(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.prompts and (args.random_prompts or args.prompt_len):
        raise OffplanError("--prompts reads prompts from a file; --random-prompts and --prompt-len make random "
                           "ones: give one or the other")
    out = Path(args.output)
    plan_path, ckpt = _profile_source(Path(args.source))
    inputs = [("the plan", plan_path)] if plan_path else []
    inputs += [("a file of the checkpoint", f) for f in
               [ckpt.root / INDEX_NAME, ckpt.root / "config.json", *sorted(ckpt.root.glob("*.safetensors"))]]
    if args.prompts:
        inputs.append(("the prompts file", Path(args.prompts)))
    _check_output(out, inputs)
    prompts = _tokenized(Path(args.prompts), ckpt.root) if args.prompts else None
    model, handle = _load_for_profile(plan_path, ckpt, device)
    try:
        if prompts is None:
            count, length = args.random_prompts or RANDOM_PROMPTS, args.prompt_len or PROMPT_LEN
            vocab = model.get_input_embeddings().num_embeddings
            ids = torch.randint(0, vocab, (count, length), generator=torch.Generator().manual_seed(SEED))
            prompts, said = list(ids), f"random token ids, {length} each, seed {SEED}"
        else:
            said = Path(args.prompts).name
        profile = record_routing(model, prompts, args.new_tokens, checkpoint_fingerprint=ckpt.fingerprint,
                                 checkpoint_path=relpath(ckpt.root, out.parent), source=said,
                                 keys=checkpoint_groups(model, ckpt))
    finally:
        if handle is not None:
            handle.remove(restore=False)
    write_profile(out, profile)
    sk = skew(profile)
    notes = [] if args.prompts else [
        f"note: the prompts are random token ids (seed {SEED}): routing on random input is not your workload's; "
        "record with --prompts FILE for a real one"]
    emit(args, {"profile": str(out), "layers": len(profile.layers), "prompts": said,
                "sequences": profile.sequences, "new_tokens": profile.new_tokens, "device": device,
                "tokens": {"prefill": profile.prefill_tokens, "decode": profile.decode_tokens},
                "top_k": profile.top_k, "top_experts_share": round(sk.share, 4), "uniform_share": round(sk.uniform, 4)},
         [f"wrote {out}: {plural(len(profile.layers), 'MoE layer')}, {profile.prefill_tokens} prefill and "
          f"{profile.decode_tokens} decode tokens from {plural(profile.sequences, 'prompt')} ({said}) on {device}; "
          f"{sk.text()}", *notes])
    return 0


def _profile_source(source: Path) -> tuple[Path | None, Checkpoint]:
    """(the plan or None, the checkpoint's headers) of `plan profile`'s source: a plan, or a checkpoint."""
    if source.is_file() and source.suffix in (".yaml", ".yml"):
        doc = yamlio.parse(source, yamlio.read(source, PlanFileError, "plan"), PlanFileError)
        kind = yamlio.kind(doc.data)
        if kind == "policy":
            named = doc.data["checkpoint"]
            where = source.parent / named if isinstance(named, str) else "CHECKPOINT"
            raise OffplanError(f"{source}: this is a policy; plan profile takes a checkpoint or a plan: profile its "
                               f"checkpoint: plan profile {where} -o PROFILE")
        if kind != "plan":
            raise OffplanError(f"{source}: not a plan{f' (a {kind})' if kind else ''}; plan profile takes a "
                               "checkpoint directory or a plan")
        return source, open_checkpoint(load_plan(source).checkpoint_dir(source))
    if not source.exists():
        raise OffplanError(f"{source}: no such checkpoint or plan")
    ckpt = open_checkpoint(source)
    check_holds_weights(ckpt)
    if not (ckpt.root / "config.json").is_file():
        raise OffplanError(f"{ckpt.root / 'config.json'}: no config.json beside the checkpoint; transformers "
                           "needs it to build the model")
    return None, ckpt


def _check_output(out: Path, inputs: list[tuple[str, Path]]) -> None:
    """The profile goes to a file in an existing directory that is none of the inputs."""
    if out.is_dir():
        raise OffplanError(f"{out}: is a directory; -o names the profile file to write (nothing was written)")
    if not out.parent.is_dir():
        raise OffplanError(f"{out}: no such directory {out.parent} (nothing was written)")
    for what, path in inputs:
        if out.exists() and path.exists() and os.path.samefile(out, path):
            raise OffplanError(f"{out}: this is {what}, an input of the profile: writing the profile there would "
                               "destroy it. Nothing was written; choose another -o")


def _load_for_profile(plan_path: Path | None, ckpt: Checkpoint, device: str):
    """(model, handle or None): per the plan, or whole on `device` with transformers' from_pretrained
    (its progress bar on a terminal only, as `plan apply` shows its own)."""
    if plan_path is not None:
        return from_pretrained(plan_path, device=device, progress=None if sys.stderr.isatty() else False)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    bar = hf_logging.is_progress_bar_enabled()
    if not sys.stderr.isatty():
        hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(ckpt.root, dtype="auto")
    except (OSError, ValueError, KeyError) as e:
        raise OffplanError(f"{ckpt.root}: transformers cannot load it: {e}") from None
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    return model.to(device).eval(), None


def _tokenized(path: Path, root: Path) -> list[torch.Tensor]:
    """The prompts of `path`, one a line (blank lines skipped), as token ids of the checkpoint's tokenizer."""
    lines = [(i + 1, line.strip()) for i, line in enumerate(_read_text(path).splitlines()) if line.strip()]
    if not lines:
        raise OffplanError(f"{path}: no prompts in it (one prompt per line)")
    if not has_tokenizer(root):
        raise OffplanError(f"{path}: the checkpoint {root} has no tokenizer ({', '.join(TOKENIZER_FILES)} are "
                           "missing) to tokenize the prompts with; use --random-prompts N instead")
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(root)
    ids = [(n, tokenizer(line, return_tensors="pt").input_ids[0]) for n, line in lines]
    short = [n for n, t in ids if t.numel() < 2]
    if short:
        raise OffplanError(f"{path}:{short[0]}: the prompt is a single token; a prompt needs two or more, or its "
                           "prefill cannot be told from a decode step")
    return [t for _, t in ids]


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise OffplanError(f"{path}: no such prompts file") from None
    except UnicodeDecodeError:
        raise OffplanError(f"{path}: not a UTF-8 text file; the prompts file holds one prompt per line") from None
    except OSError as e:
        raise OffplanError(f"{path}: cannot read the prompts: {e.strerror}") from None
