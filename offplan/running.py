"""`plan apply` and `plan calibrate`, two of the commands that need torch (the third, `plan profile`, is profiling.py).

`plan apply PLAN`: load the plan's checkpoint with transformers per the plan, report, and generate through
the runtime's generation (runtime/execute/generation.py: on a GPU each decode step replayed from a CUDA graph,
unless --eager; with --compile, the step compiled by torch.compile first), for one sequence per prompt or `--batch`
of them. Before the steps run, step_checks.py refuses what they could not run right, each naming the way out.

What the report says about the checkpoint, and how it knows:
- no tokenizer: none of the files transformers reads one from (`TOKENIZER_FILES`)
  sits beside the weights; the prompt's UTF-8 bytes are then the input ids and
  the output is token ids;
- random weights: nothing in a checkpoint tells trained weights from random
  ones, so only a declaration counts: `"offplan_random_weights": true` in its
  config.json, which `plans/examples/make_tiny.py` writes for the bundled
  example. Without it the report says nothing either way.
The predicted decode step comes from the plan (its cost model and hardware
profile, at its workload's batch size, for the mode that ran: a plan predicts
replayed and eager steps), or at another batch from its policy built again for
that batch, where that places every tensor as the plan does; the measured one
from this run's decode steps, the time to first token apart; the report says
when the two do not compare.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import warnings
from pathlib import Path

import torch

from planner.decide.build import step_at
from planner.errors import OffplanError
from planner.files import refuse_to_replace, write_atomic
from planner.inputs.hardware import dumps_hardware
from planner.planfile import load_plan
from planner.planfile.staleness import checkpoint_of, stale_but_loadable
from planner.units import human, ms, plural
from runtime.execute.handle import LoadStats
from runtime.execute.host import native
from runtime.execute.host.pace import HostSlowerWarning
from runtime.hf import from_pretrained
from runtime.measure.calibrate import calibrate

from .output import emit
from .parallel_apply import apply_parallel
from .step_checks import capture_refused, check_compiles, check_replays

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
DEFAULT_PROMPT = "The capital of France is"
RANDOM_WEIGHTS_KEY = "offplan_random_weights"


def check_device(args) -> None:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise OffplanError("--device cuda: no CUDA device here (leave --device out to use the CPU)")


@dataclasses.dataclass(frozen=True)
class Request:
    """What `plan apply` was asked to do, as every process of a tensor-parallel run needs it (picklable)."""

    plan: str
    texts: tuple[str, ...]
    batch: int
    max_new_tokens: int
    eager: bool
    device: str | None
    json: bool
    progress: bool | None
    compile: bool = False


def apply_command(args) -> int:
    check_device(args)
    texts = args.prompt or [DEFAULT_PROMPT]
    if "" in texts:
        raise OffplanError("--prompt: an empty prompt; give each prompt one or more characters")
    if args.batch is not None and args.batch < len(texts):
        raise OffplanError(f"--batch {args.batch}: fewer sequences than the {len(texts)} prompts given; give "
                           f"--batch {len(texts)} or more, or fewer prompts")
    # The bar on a terminal; elsewhere nothing from the loader, since the report below says it all.
    req = Request(args.plan, tuple(texts), args.batch or len(texts), args.max_new_tokens, args.eager, args.device,
                  args.json, None if sys.stderr.isatty() else False, args.compile)
    plan = load_plan(args.plan)
    where = checkpoint_of(plan, Path(args.plan))  # missing: said here, naming the plan's key, before anything loads
    if not args.eager and args.device != "cpu" and torch.cuda.is_available():  # the decode steps will be replayed
        from transformers import AutoConfig
        config = AutoConfig.from_pretrained(where)  # before minutes of loading: a sliding layer no replay could
        # step (a padded batch past a window needs the prompts' lengths: checked before the prefill)
        name = (getattr(config, "architectures", None) or [config.model_type])[0]
        check_replays(config, 1 + args.max_new_tokens, name)
    stale = stale_but_loadable(plan, Path(args.plan))
    if stale:
        print(f"warning: {args.plan} is stale ({'; '.join(stale)}); applied as it is: rebuild it for what its "
              "inputs now ask (`plan check` says how)", file=sys.stderr)
    gpus = plan.parallel
    if args.compile and gpus is not None:
        raise OffplanError(f"--compile: not with a tensor-parallel plan ({args.plan} runs on {gpus.gpus} GPUs); "
                           "leave --compile out")
    if args.compile and args.gpus is not None:
        raise OffplanError(f"--compile: not with --gpus {args.gpus} (one process per GPU); leave one of them out")
    if gpus is not None or args.gpus is not None:
        out = apply_parallel(req, gpus.gpus if gpus else 1, args.gpus, apply_one)
    else:
        out = apply_one(req)
    print(out)
    return 0


def apply_one(req: Request, rank: int | None = None) -> str:
    """Load the plan (this process's share of it, under tensor parallelism), generate, and say what happened:
    the report's lines, or its JSON."""
    with warnings.catch_warnings():  # the report says it (`host_warning`), once
        warnings.simplefilter("ignore", HostSlowerWarning)
        model, handle = from_pretrained(req.plan, device=req.device, progress=req.progress if not rank else False)
    try:
        stats = handle.stats()
        root = Path(handle.checkpoint.root)
        facts = {"tokenizer": has_tokenizer(root), "random_weights": declares_random_weights(root)}
        gen = _generate(model, handle, list(req.texts), req.batch, req.max_new_tokens, req.eager,
                        facts["tokenizer"], req.compile, says=not rank)
        plan = handle.plan
        if req.json:
            return json.dumps({"stats": {**dataclasses.asdict(stats), "pinned_ratio": stats.pinned_ratio,
                                         "load_bytes_per_s": stats.load_bytes_per_s},
                               **facts, "predicted_step_us": plan.summary.predicted_step_us if plan.cost else None,
                               "predicted_mode": plan.cost and ("graph" if plan.cost.cuda_graphs else "eager"),
                               "predicted_step_us_as_run": step_at(plan, req.plan, len(gen["sequences"]),
                                                                   "graph" in gen["mode"]), **gen}, indent=2)
        return "\n".join(report(req.plan, stats, facts, gen, plan, root))
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


def report(plan_path, s: LoadStats, facts: dict, gen: dict, plan, root: Path) -> list[str]:
    """The lines `plan apply` prints (bytes in binary units, times in milliseconds)."""
    total = s.gpu_bytes + s.uva_bytes + s.prefetch_bytes
    rate = f", {human(total / s.load_seconds)}/s" if s.load_seconds else ""
    cuda = s.device.startswith("cuda")
    where = "GPU" if cuda else "CPU (no CUDA: uva stays in host memory, prefetch copies synchronously)"
    # every buffer the runtime holds beside the weights: prefetch and staging slots, the experts lookahead (handle.py)
    buffers = f" (+{human(s.gpu_buffer_bytes)} buffers)" if s.gpu_buffer_bytes else ""
    cpu = plan.summary.cpu_bytes  # the load counts experts on cpu with uva's host bytes: the plan's figure beside
    out = [f"loaded {plan_path} on {s.device} in {s.load_seconds:.2f} s ({human(total)}{rate})",
           *([f"  tensor parallel over {plan.parallel.gpus} processes, "
              + ("one per GPU" if cuda else "on the CPU (no CUDA: one per GPU the plan was built for, over gloo)")
              + ": each loaded its share; the figures here are process 0's"] if plan.parallel else []),
           f"  resident {human(s.gpu_bytes)}, "
           + (f"uva and cpu {human(s.uva_bytes)} (the plan puts {human(cpu)} of the checkpoint's on cpu, computed "
              "by the host), " if cpu else f"uva {human(s.uva_bytes)}, ")
           + f"prefetch {human(s.prefetch_bytes)}{buffers}, on the {where}"]
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
    if s.host_warning:
        out.append(f"warning: {s.host_warning}")
    if plan.summary.cpu_bytes and native.library() is None:
        out.append(f"note: the plan computes experts on cpu, but {native.why_not}: the engine's Python worker "
                   "computes them, much slower than the plan predicts")
    sequences = len(gen["sequences"])
    how = {"graph": "each decode step replayed from a CUDA graph", "eager": "each decode step eager",
           "compiled-graph": "each decode step compiled by torch.compile and replayed from a CUDA graph",
           "compiled": "each decode step compiled by torch.compile, without a CUDA graph"}[gen["mode"]]
    out.append(f"generated {plural(sequences, 'sequence')} of up to {gen['max_new_tokens']} tokens, greedily, "
               f"{how} ({s.device})")
    out.append(f"  time to first token {ms(gen['ttft_s'] * 1e6)} (prefill of {gen['prompt_tokens']} prompt tokens)")
    if gen["decode_steps"]:
        out.append(f"  decode {gen['decode_tokens_per_s']:.1f} tokens/s per sequence: {ms(gen['step_us'])} per "
                   f"step over {plural(gen['decode_steps'], 'step')} at batch {sequences}")
    if plan.cost is not None:
        c = plan.cost
        graphs, batch = "graph" in gen["mode"], sequences
        step = step_at(plan, plan_path, batch, graphs) if cuda else None
        if step is None:  # on the CPU, or none for this mode and batch (`step_at`): the plan's own prediction
            step, graphs, batch = plan.summary.predicted_step_us, c.cuda_graphs, c.batch_size
        unlike = ("this run is on the CPU" if not cuda else
                  f"this run is at batch {sequences}" if batch != sequences else
                  "this run is compiled (the plan predicts uncompiled kernels)" if "compiled" in gen["mode"] else
                  "this run is eager (the plan was written before eager predictions)"
                  if graphs and "graph" not in gen["mode"] else "")
        again = f" (its policy built for batch {batch})" if batch != c.batch_size else ""
        out.append(f"  predicted {ms(step)} per decode step by the plan{again}, for batch {batch}, "
                   f"{'CUDA graph replay' if graphs else 'eager'}, on {c.hardware}"
                   + (f"; {unlike}: they do not compare" if unlike else ""))
    for seq in gen["sequences"]:
        out.append(f"  {seq['text']!r}" if seq["text"] is not None else f"  token ids {seq['token_ids']}")
    return out


def _generate(model, handle, texts: list[str], batch: int, max_new_tokens: int, eager: bool,
              tokenizer_files: bool, compile: bool = False, says: bool = True) -> dict:
    """The runtime's generation (runtime/execute/generation.py) of `batch` sequences, the prompts taken in turn;
    the checkpoint's tokenizer when it has one (stopping at its end-of-sequence token), else each prompt's bytes
    as ids. `prepare` captures the decode step and warms up; the generation is timed. `says`: whether this process
    warns (rank 0's, under tensor parallelism)."""
    tokenizer = None
    if tokenizer_files:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(handle.checkpoint.root)
    vocab = model.get_input_embeddings().num_embeddings
    texts = [texts[i % len(texts)] for i in range(batch)]
    if tokenizer is not None:
        prompts = [tokenizer(text).input_ids for text in texts]
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
        stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    else:
        prompts, pad, stop = [[b % vocab for b in text.encode()] for text in texts], 0, []
    if not all(prompts):  # a tokenizer that makes nothing of a prompt
        empty = texts[[bool(p) for p in prompts].index(False)]
        raise OffplanError(f"--prompt: the tokenizer makes no tokens of {empty!r}")
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if says and isinstance(limit, int) and max(map(len, prompts)) + max_new_tokens > limit:  # one process says it
        print(f"warning: {max(map(len, prompts))} prompt tokens and --max-new-tokens {max_new_tokens} run past the "
              f"model's {limit} positions (max_position_embeddings in config.json): what it makes there is "
              "past what it was made for", file=sys.stderr)
    if compile:
        check_compiles(model, handle, batch)
    generator = handle.generator(eager=eager, compile=compile)
    if generator.replay:
        check_replays(model.config, max(map(len, prompts)) + max_new_tokens, type(model).__name__,
                      len(set(map(len, prompts))) > 1)
    with capture_refused():
        generator.prepare(prompts, max_new_tokens, pad_id=pad)  # capture the decode step, warm up the prefill
    got = generator(prompts, max_new_tokens, pad_id=pad, stop=stop)
    return {"mode": got.mode, "max_new_tokens": max_new_tokens, "prompt_tokens": got.prompt_tokens,
            "ttft_s": got.ttft_s, "decode_steps": got.decode_steps, "decode_s": got.decode_s,
            "decode_tokens_per_s": got.decode_tokens_per_s,
            "step_us": got.decode_s / got.decode_steps * 1e6 if got.decode_steps else None,
            "sequences": [{"prompt": text, "token_ids": ids, "text": tokenizer.decode(ids) if tokenizer else None}
                          for text, ids in zip(texts, got.tokens)]}


def calibrate_command(args) -> int:
    """`plan calibrate -o PROFILE [--cpu-threads N]`: measure this GPU (runtime/measure/calibrate.py), write a
    hardware profile."""
    # before minutes of measuring
    refuse_to_replace(Path(args.output), "hardware profile", "choose another -o, or remove that file first")
    cal = calibrate(args.cpu_threads)
    hw = cal.hardware
    write_atomic(Path(args.output), dumps_hardware(hw), "hardware profile")
    steps = ", ".join(f"{n}: {us:.0f}" for n, us in cal.step_us_by_layers.items())
    emit(args, {"profile": args.output, **hw.__dict__, "step_us_by_layers": cal.step_us_by_layers, "r2": cal.r2,
                "stage_ms": {m: list(t) for m, t in cal.stage_ms.items()},
                "replay_us_by_layers": cal.replay_us_by_layers, "moe_step_us_by_layers": cal.moe_step_us_by_layers},
          f"wrote {args.output}: {hw.name}: H2D copy {hw.h2d_copy_gbps} GB/s, UVA read {hw.uva_read_gbps} GB/s, "
          f"HBM read {hw.hbm_read_gbps} GB/s; CPU {hw.layer_overhead_us} us per layer + {hw.step_overhead_us} us "
          f"per step (eager decode step by layer count, us: {steps}; R^2 {cal.r2:.4f}), {hw.moe_layer_overhead_us} us "
          f"per MoE layer (each count's fastest round; the median round {hw.eager_median_ratio:.2f}x slower); GPU "
          f"{hw.layer_gpu_us} us "
          f"per dense layer, {hw.moe_layer_gpu_us} us per MoE layer + {hw.step_gpu_us} us per step beyond "
          f"reading weights (CUDA-graph replays of tiny models); prefill: GEMMs "
          f"{hw.matmul_tflops} TFLOP/s, uva layers staged above {hw.stage_above_tokens} tokens")
    return 0
