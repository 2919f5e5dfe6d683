"""The planning commands of `plan`: build, show, diff, validate, check. Pure Python, like the planner."""
from __future__ import annotations

import difflib
import json
import os
import sys
from functools import lru_cache
from pathlib import Path

from planner.decide.build import build, default_output
from planner.decide.notes import WARNING, is_warning, unlocated
from planner.errors import InconsistentPlanError, OffplanError, PolicyError
from planner.files import missing_folder, refuse_to_replace, write_atomic, written_as
from planner.inputs import yamlio
from planner.inputs.checkpoint import INDEX_NAME, open_checkpoint, resolve
from planner.inputs.hardware import load_hardware
from planner.inputs.policy import Policy, load_policy
from planner.inputs.routing import load_profile, skew
from planner.inputs.schema import schema
from planner.planfile import dumps, read_plan
from planner.planfile.diff import diff_data, diff_text
from planner.planfile.show import show, show_data, show_tensors, tensors_data
from planner.planfile.staleness import checkpoint_of, stale_reasons, up_to_date
from planner.units import human, ms, plural

from .output import emit


def build_command(args) -> int:
    policy = load_policy(args.policy)
    for w in policy.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if args.output == "":
        raise OffplanError("-o: an empty path; name the plan file to write, or leave -o out for "
                           f"{default_output(policy.path)}")
    to_stdout = args.output == "-"
    out = Path(args.output) if args.output and not to_stdout else default_output(Path(args.policy))
    if not to_stdout:  # before planning: nothing to plan for that cannot be written
        if (fix := missing_folder(out, "plan")) is not None:
            raise OffplanError(f"{out}: cannot write the plan: {fix}")
        _refuse_to_overwrite_an_input(out, policy)
        refuse_to_replace(out, "plan", (f"choose another -o (default: {default_output(policy.path)})"
                                                if args.output else "write the plan elsewhere with -o PATH")
                          + ", or remove that file first")
    plan = build(policy, Path.cwd() if to_stdout else out.parent)
    text = dumps(plan)
    warnings = _warn(policy, plan)
    if to_stdout:
        sys.stdout.write(text)
        return 0
    write_atomic(out, text)
    data = {"plan": str(out), **show_data(plan)}
    s = plan.summary
    pools = [(human(b), what) for b, what in ((s.prefetch_buffer_bytes, "prefetch buffers"),
                                              (s.stage_buffer_bytes, "prefill staging buffers"),
                                              (s.working_peak_bytes, "experts' working memory")) if b]
    buffers = (" (" + ", ".join(f"{b} of it {what}" if i == 0 else f"{b} {what}" for i, (b, what) in enumerate(pools))
               + ")" if pools else "")
    off = s.uva_bytes + s.prefetch_bytes + s.cpu_bytes
    host = human(off) + (f" ({human(s.cpu_bytes)} of it on cpu)" if s.cpu_bytes else "") if off else "nothing offloaded"
    c = plan.cost
    prefill = f", prefill of {c.prompt_tokens} tokens {ms(c.prefill_us)}" if c and c.prompt_tokens else ""
    emit(args, data, [f"wrote {out}: {plural(plan.tensors, 'tensor')}, backend {plan.backend.value}; GPU "
                       f"{human(s.gpu_footprint_bytes)}{buffers}, host {host}; predicted step "
                       f"{ms(s.predicted_step_us)}{prefill}", *(f"note: {n}" for n in plan.notes if n not in warnings)])
    return 0


def _warn(policy: Policy, plan) -> list[str]:
    """Print the plan's warnings on stderr but those of the policy, printed already with their file:line:column;
    returns them all."""
    warnings = [n for n in plan.notes if is_warning(n)]
    said = {WARNING + unlocated(w) for w in policy.warnings}
    for w in warnings:
        if w not in said:
            print(w, file=sys.stderr)
    return warnings


def _refuse_to_overwrite_an_input(out: Path, policy: Policy) -> None:
    """Writing the plan over the policy, the hardware or routing profile or a checkpoint file would destroy it.

    The same file is found whatever the spelling (`./p.yaml`, a symlink, a hard link):
    `os.path.samefile` compares device and inode. The checkpoint's files are its
    index, config.json and every .safetensors file beside them.
    """
    if out.is_dir():
        raise OffplanError(f"{out}: is a directory; -o names the plan file to write (nothing was written)")
    if not out.exists():
        return
    root = resolve(policy.checkpoint)[0] if policy.checkpoint.exists() else None  # else build says it is missing
    inputs = [("the policy", policy.path)]
    if policy.hardware is not None:
        inputs.append(("the hardware profile", policy.hardware))
    if policy.workload.routing is not None:
        inputs.append(("the routing profile", policy.workload.routing))
    for file in [root / INDEX_NAME, root / "config.json", *sorted(root.glob("*.safetensors"))] if root else []:
        inputs.append(("a file of the checkpoint", file))
    for what, path in inputs:
        if path.exists() and os.path.samefile(out, path):
            same = "" if os.path.abspath(out) == os.path.abspath(path) else f" ({path})"
            raise OffplanError(f"{out}: this is {what}{same}, an input of the plan: writing the plan there would "
                               f"destroy it. Nothing was written; choose another -o (default: "
                               f"{default_output(policy.path)})")


def show_command(args) -> int:
    loaded = read_plan(args.plan)
    plan = loaded.plan
    if args.tensors:
        sizes = loaded.checkpoint.tensors if loaded.checkpoint else None
        emit(args, tensors_data(plan, sizes), show_tensors(plan, sizes, loaded.unchecked))
        return 0
    emit(args, show_data(plan), show(plan, loaded.unchecked))
    return 0


def diff_command(args) -> int:
    old = read_plan(args.old)
    new = read_plan(args.new, beside=old)  # their checkpoint read once where it is the same
    sizes = None  # bytes per moved tensor need the checkpoints' headers; counts do without
    if old.checkpoint or new.checkpoint:
        sizes = {n: t.nbytes for c in (old.checkpoint, new.checkpoint) if c for n, t in c.tensors.items()}
    d = diff_data(old.plan, new.plan, sizes, (Path(args.old), Path(args.new)))
    emit(args, d, diff_text(d))
    return 2 if args.detailed_exitcode and not d["same"] else 0


def validate_command(args) -> int:
    path = Path(args.file)
    text = yamlio.read(path, PolicyError, "policy or plan")
    doc = yamlio.parse(path, text, PolicyError)
    kind = yamlio.kind(doc.data)
    if kind in (None, "policy"):  # a file cut short: its first line, offplan's own, still says what it is
        kind = written_as(text) or kind
    if kind is None and isinstance(doc.data, dict) and not any(map(_offplans, doc.data)):
        raise PolicyError(f"{path}: not a policy, plan, hardware or routing profile (none of its keys is one of "
                          "theirs, or close to one): `plan validate` checks offplan's files")
    if kind == "plan":
        loaded = read_plan(path)
        plan, unchecked = loaded.plan, loaded.unchecked
        emit(args, {"file": str(path), "kind": "plan", "valid": True, "tensors": plan.tensors, "exact": not unchecked},
              f"{path}: valid plan ({plan.tensors} tensors, backend {plan.backend.value})"
              + (f"; its parts agree, but not checked against tensor sizes: {unchecked}" if unchecked else ""))
        return 0
    if kind == "hardware profile":
        hw = load_hardware(path)
        emit(args, {"file": str(path), "kind": "hardware profile", "valid": True, "name": hw.name},
              f"{path}: valid hardware profile ({hw.name})")
        return 0
    if kind == "routing profile":
        profile = load_profile(path)
        emit(args, {"file": str(path), "kind": "routing profile", "valid": True, "layers": len(profile.layers)},
             f"{path}: valid routing profile ({plural(len(profile.layers), 'MoE layer')}, "
             f"{plural(profile.decode_tokens, 'decode token')}; {skew(profile).text()})")
        return 0
    policy = load_policy(path)
    for w in policy.warnings:
        print(f"warning: {w}", file=sys.stderr)
    plan = build(policy, path.parent)
    _warn(policy, plan)
    emit(args, {"file": str(path), "kind": "policy", "valid": True, "backend": plan.backend.value},
          f"{path}: valid policy (checkpoint {plan.checkpoint_path}, {plan.tensors} tensors; "
          f"it plans backend {plan.backend.value})")
    return 0


def _offplans(key) -> bool:
    """Whether a top-level key is, or nearly is (a misspelling: `chekpoint`), one of a policy's or a profile's."""
    return bool(difflib.get_close_matches(str(key), _known_keys(), n=1, cutoff=0.85))


@lru_cache(maxsize=None)
def _known_keys() -> tuple[str, ...]:
    """The top-level keys of a policy, a hardware profile and a routing profile, as their schemas name them."""
    return tuple(k for name in ("policy", "hardware", "routing") for k in schema(f"{name}.schema.json")["properties"])


def check_command(args) -> int:
    plan_path = Path(args.plan)
    # the common answer, from the plan's stamp or one build; any other: the full checks say why
    current = up_to_date(plan_path, rebuild=args.rebuild)
    if current is not None:
        return _current(args, plan_path, current.checkpoint, current.policy, current.routing)
    try:
        plan = read_plan(plan_path).plan
    except InconsistentPlanError as e:  # a hand edit: stale like any plan that is not what build makes
        return _stale(args, plan_path, [e.headline, *e.problems], None)
    ckpt_dir = plan.checkpoint_dir(plan_path)
    policy_path = plan_path.parent / plan.policy_path
    problems = stale_reasons(plan, plan_path, open_checkpoint(checkpoint_of(plan, plan_path)))
    if problems:
        return _stale(args, plan_path, problems, policy_path)
    return _current(args, plan_path, ckpt_dir, policy_path,
                    None if plan.routing is None else plan_path.parent / plan.routing.path)


def _current(args, plan_path: Path, checkpoint: Path, policy: Path, routing: Path | None) -> int:
    inputs = [str(checkpoint), str(policy), *([str(routing)] if routing is not None else [])]
    emit(args, {"plan": str(plan_path), "stale": False, "problems": []},
          f"{plan_path}: up to date with {', '.join(inputs[:-1])} and {inputs[-1]}")
    return 0


def _stale(args, plan_path: Path, problems: list[str], policy_path: Path | None) -> int:
    """Exit 2: the report on stdout with --json, else on stderr."""
    if args.json:
        print(json.dumps({"plan": str(plan_path), "stale": True, "problems": problems}, indent=2))
        return 2
    lines = [f"{plan_path}: STALE", *(f"  - {p}" for p in problems)]
    if policy_path is not None and policy_path.is_file():
        lines.append(f"  rebuild it: plan build {policy_path} -o {plan_path}")
    elif policy_path is not None:  # nothing to rebuild from where the plan says
        lines.append(f"  rebuild it from its policy: put {policy_path} back, or `plan build` another policy "
                     f"with -o {plan_path}")
    print("\n".join(lines), file=sys.stderr)
    return 2
