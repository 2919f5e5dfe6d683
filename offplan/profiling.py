"""`plan profile CHECKPOINT_OR_PLAN -o PROFILE`: record a routing profile (runtime/measure/routing.py).

The model runs all on one device, or loaded per a plan. The prompts: a text
file, one per line, tokenized with the checkpoint's tokenizer (`--prompts`; a
checkpoint without one cannot tokenize them), else random token ids from a
fixed seed (`--random-prompts`, the default), which the output and the profile
say: routing on random input is not a workload's.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from planner.errors import OffplanError, PlanFileError
from planner.files import refuse_to_replace, relpath
from planner.inputs import yamlio
from planner.inputs.checkpoint import INDEX_NAME, Checkpoint, open_checkpoint
from planner.inputs.routing import skew, write_profile
from planner.planfile import load_plan
from planner.planfile.staleness import checkpoint_of
from planner.units import plural
from runtime.hf import from_pretrained
from runtime.measure.routing import checkpoint_groups, record_routing
from runtime.place.loader import check_holds_weights

from .defaults import PROMPT_LEN, RANDOM_PROMPTS, SEED
from .output import emit
from .running import TOKENIZER_FILES, check_device, has_tokenizer


def profile_command(args) -> int:
    """`plan profile SOURCE -o PROFILE`: record which experts the prompts route to; write a routing profile.

    Every input is checked before the model loads: the source, the output, the prompts
    and their tokens; what can fail after that is the model's own business."""
    check_device(args)
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
        return source, open_checkpoint(checkpoint_of(load_plan(source), source))
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
    refuse_to_replace(out, "routing profile", "choose another -o, or remove that file first")


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
