"""The `plan` command. `main(argv)` returns the exit code; tests call it directly.

Exit codes: 0 success; 1 bad input (one message, no traceback, nothing
written); 2 "differs" for `diff --detailed-exitcode` and "stale" for `check`;
141 (128 + SIGPIPE, like any tool killed by it) when the reader of stdout went
away (`plan show PLAN | head`), with nothing said.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from importlib import metadata
from pathlib import Path

from . import report, yamlio
from .build import build, default_output
from .checkpoint import INDEX_NAME, open_checkpoint, resolve
from .diff import diff_data, diff_text
from .errors import InconsistentPlanError, OffplanError, PolicyError
from .hardware import load_hardware
from .notes import is_warning
from .files import write_atomic
from .planfile import dumps, load_plan, read_plan
from .policy import Policy, load_policy
from .staleness import stale_reasons
from .units import human, ms, plural

EXAMPLES = """examples:
  plan build plans/examples/tiny-moe.policy.yaml        # writes tiny-moe.plan.yaml beside it
  plan show plans/examples/tiny-moe.plan.yaml
  plan apply plans/examples/tiny-moe.plan.yaml
  plan diff old.plan.yaml new.plan.yaml --detailed-exitcode
  plan check plans/examples/tiny-moe.plan.yaml          # exit 2 if the plan is stale
"""


class _UsageError(Exception):
    """A bad command line: exit 1 like any bad input (argparse's own 2 means "differs" here)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise _UsageError(f"{message} (see `{self.prog} --help`)")


class _Version(argparse.Action):
    """`plan --version`: looked up only when asked (reading distribution metadata takes ~20 ms)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help="print offplan's version and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog} (offplan) {version()}")
        parser.exit()


def version() -> str:
    """The installed distribution's version; a source tree that pip never installed has none."""
    try:
        return metadata.version("offplan")
    except metadata.PackageNotFoundError:
        return f"unknown (not installed: running from {Path(__file__).resolve().parent.parent})"


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(
        prog="plan", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES,
        description="Plan, review and apply the offloading of LLM weights to pinned host memory.")
    ap.add_argument("--version", action=_Version)
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    def cmd(name, help):
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument("--json", action="store_true", help="print machine-readable JSON")
        return p

    p = cmd("build", "read a policy and the checkpoint's headers; write the plan")
    p.add_argument("policy", metavar="POLICY", help="policy YAML (see schemas/policy.schema.json)")
    p.add_argument("-o", "--output", metavar="PLAN",
                   help="where to write the plan (default: NAME.plan.yaml beside NAME.policy.yaml; - for stdout)")
    p = cmd("show", "per-layer table, totals, and the footprint against the budget")
    p.add_argument("plan", metavar="PLAN")
    p.add_argument("--tensors", action="store_true",
                   help="list every tensor (a fused expert group as one unit) with its placement, and its "
                        "bytes when the checkpoint's headers are at hand")
    p = cmd("diff", "what moved where between two plans: by layer and fused unit, with the change in "
                    "predicted step time, GPU footprint, backend, policy and prefetch schedule")
    p.add_argument("old", metavar="OLD")
    p.add_argument("new", metavar="NEW")
    p.add_argument("--detailed-exitcode", action="store_true",
                   help="exit 0 if the plans are the same, 2 if they differ, 1 on error")
    p = cmd("validate", "check a policy (schema, patterns against the checkpoint), a plan or a hardware profile")
    p.add_argument("file", metavar="FILE")
    p = cmd("check", "is the plan stale? exit 0 if current, 2 if its checkpoint or policy changed")
    p.add_argument("plan", metavar="PLAN")
    p = cmd("calibrate", "measure this GPU's copy, UVA and HBM bandwidths and per-layer overhead")
    p.add_argument("-o", "--output", metavar="PROFILE", default="hardware.yaml",
                   help="where to write the hardware profile (default: hardware.yaml); name it in a "
                        "policy as `hardware: PROFILE`")
    p = cmd("apply", "load the plan's checkpoint with transformers, per the plan, and generate")
    p.add_argument("plan", metavar="PLAN")
    p.add_argument("--prompt", default="The capital of France is", help="prompt for a greedy generation")
    p.add_argument("--max-new-tokens", type=_positive, default=16, metavar="N")
    p.add_argument("--device", default=None, choices=["cuda", "cpu"], help="default: cuda if available")
    return ap


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            args = _parser().parse_args(argv)
            code = _COMMANDS[args.command](args)
        except SystemExit as e:  # --help, --version
            code = e.code if isinstance(e.code, int) else 0
        sys.stdout.flush()  # a closed pipe shows here, inside the try, not at interpreter exit
        return code
    except (OffplanError, _UsageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        _drop_stdout()
        return 141
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _drop_stdout() -> None:
    """The reader of stdout is gone: send what is still buffered to /dev/null, so that
    Python's flush at exit does not raise again (the recipe in Python's `signal` docs)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout is not a file (captured in tests)
        pass


def _emit(args, data, text) -> None:
    """`--json`: the data; else the text (a string, or lines and rich tables: see report.print_to)."""
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        report.print_to(sys.stdout, [text] if isinstance(text, str) else text)


def _build(args) -> int:
    policy = load_policy(args.policy)
    for w in policy.warnings:
        print(f"warning: {w}", file=sys.stderr)
    to_stdout = args.output == "-"
    out = Path(args.output) if args.output and not to_stdout else default_output(Path(args.policy))
    plan = build(policy, Path.cwd() if to_stdout else out.parent)
    text = dumps(plan)
    warnings = [n for n in plan.notes if is_warning(n)]
    for w in warnings:
        print(w, file=sys.stderr)
    if to_stdout:
        sys.stdout.write(text)
        return 0
    _refuse_to_overwrite_an_input(out, policy)
    write_atomic(out, text)
    data = {"plan": str(out), **report.show_data(plan)}
    s = plan.summary
    buffers = f" ({human(s.prefetch_buffer_bytes)} of it prefetch buffers)" if s.prefetch_buffer_bytes else ""
    host = human(s.uva_bytes + s.prefetch_bytes) if s.uva_bytes + s.prefetch_bytes else "nothing offloaded"
    _emit(args, data, [f"wrote {out}: {plural(plan.tensors, 'tensor')}, backend {plan.backend.value}; GPU "
                       f"{human(s.gpu_footprint_bytes)}{buffers}, host {host}; predicted step "
                       f"{ms(s.predicted_step_us)}", *(f"note: {n}" for n in plan.notes if n not in warnings)])
    return 0


def _refuse_to_overwrite_an_input(out: Path, policy: Policy) -> None:
    """Writing the plan over the policy, the hardware profile or a checkpoint file would destroy it.

    The same file is found whatever the spelling (`./p.yaml`, a symlink, a hard link):
    `os.path.samefile` compares device and inode. The checkpoint's files are its
    index, config.json and every .safetensors file beside them.
    """
    if out.is_dir():
        raise OffplanError(f"{out}: is a directory; -o names the plan file to write (nothing was written)")
    if not out.exists():
        return
    root = resolve(policy.checkpoint)[0]
    inputs = [("the policy", policy.path)]
    if policy.hardware is not None:
        inputs.append(("the hardware profile", policy.hardware))
    for file in [root / INDEX_NAME, root / "config.json", *sorted(root.glob("*.safetensors"))]:
        inputs.append(("a file of the checkpoint", file))
    for what, path in inputs:
        if path.exists() and os.path.samefile(out, path):
            same = "" if os.path.abspath(out) == os.path.abspath(path) else f" ({path})"
            raise OffplanError(f"{out}: this is {what}{same}, an input of the plan: writing the plan there would "
                               f"destroy it. Nothing was written; choose another -o (default: "
                               f"{default_output(policy.path)})")


def _show(args) -> int:
    loaded = read_plan(args.plan)
    plan = loaded.plan
    if args.tensors:
        sizes = loaded.checkpoint.tensors if loaded.checkpoint else None
        _emit(args, report.tensors_data(plan, sizes), report.show_tensors(plan, sizes, loaded.unchecked))
        return 0
    _emit(args, report.show_data(plan), report.show(plan, loaded.unchecked))
    return 0


def _diff(args) -> int:
    old, new = read_plan(args.old), read_plan(args.new)
    sizes = None  # bytes per moved tensor need the checkpoints' headers; counts do without
    if old.checkpoint or new.checkpoint:
        sizes = {n: t.nbytes for c in (old.checkpoint, new.checkpoint) if c for n, t in c.tensors.items()}
    d = diff_data(old.plan, new.plan, sizes, (Path(args.old), Path(args.new)))
    _emit(args, d, diff_text(d))
    return 2 if args.detailed_exitcode and not d["same"] else 0


def _validate(args) -> int:
    path = Path(args.file)
    doc = yamlio.parse(path, yamlio.read(path, PolicyError, "policy or plan"), PolicyError)
    kind = yamlio.kind(doc.data)
    if kind == "plan":
        plan = load_plan(path)
        _emit(args, {"file": str(path), "kind": "plan", "valid": True, "tensors": plan.tensors},
              f"{path}: valid plan ({plan.tensors} tensors, backend {plan.backend.value})")
        return 0
    if kind == "hardware profile":
        hw = load_hardware(path)
        _emit(args, {"file": str(path), "kind": "hardware profile", "valid": True, "name": hw.name},
              f"{path}: valid hardware profile ({hw.name})")
        return 0
    policy = load_policy(path)
    for w in policy.warnings:
        print(f"warning: {w}", file=sys.stderr)
    plan = build(policy, path.parent)
    _emit(args, {"file": str(path), "kind": "policy", "valid": True, "backend": plan.backend.value},
          f"{path}: valid policy (checkpoint {plan.checkpoint_path}, {plan.tensors} tensors; "
          f"it plans backend {plan.backend.value})")
    return 0


def _check(args) -> int:
    plan_path = Path(args.plan)
    try:
        plan = read_plan(plan_path).plan
    except InconsistentPlanError as e:  # a hand edit: stale like any plan that is not what build makes
        return _stale(args, plan_path, [e.headline, *e.problems], None)
    ckpt_dir = plan.checkpoint_dir(plan_path)
    policy_path = plan_path.parent / plan.policy_path
    problems = stale_reasons(plan, plan_path, open_checkpoint(ckpt_dir))
    if problems:
        return _stale(args, plan_path, problems, policy_path)
    _emit(args, {"plan": str(plan_path), "stale": False, "problems": []},
          f"{plan_path}: up to date with {ckpt_dir} and {policy_path}")
    return 0


def _stale(args, plan_path: Path, problems: list[str], policy_path: Path | None) -> int:
    """Exit 2: the report on stdout with --json, else on stderr."""
    if args.json:
        print(json.dumps({"plan": str(plan_path), "stale": True, "problems": problems}, indent=2))
        return 2
    lines = [f"{plan_path}: STALE", *(f"  - {p}" for p in problems)]
    if policy_path is not None:
        lines.append(f"  rebuild it: plan build {policy_path} -o {plan_path}")
    print("\n".join(lines), file=sys.stderr)
    return 2


def _apply(args) -> int:
    try:
        from runtime.cli import apply_command
    except ImportError as e:
        raise OffplanError(f"plan apply needs the runtime's dependencies ({e.name}); "
                           "install them: pip install 'offplan[runtime]'") from None
    return apply_command(args)


def _calibrate(args) -> int:
    try:
        from runtime.calibrate import calibrate
    except ImportError as e:
        raise OffplanError(f"plan calibrate needs the runtime's dependencies ({e.name}); "
                           "install them: pip install 'offplan[runtime]'") from None
    from .hardware import dumps_hardware
    cal = calibrate()
    hw = cal.hardware
    write_atomic(Path(args.output), dumps_hardware(hw), "hardware profile")
    steps = ", ".join(f"{n}: {us:.0f}" for n, us in cal.step_us_by_layers.items())
    _emit(args, {"profile": args.output, **hw.__dict__, "step_us_by_layers": cal.step_us_by_layers, "r2": cal.r2},
          f"wrote {args.output}: {hw.name}: H2D copy {hw.h2d_copy_gbps} GB/s, UVA read {hw.uva_read_gbps} GB/s, "
          f"HBM read {hw.hbm_read_gbps} GB/s; CPU {hw.layer_overhead_us} us per layer + {hw.step_overhead_us} us "
          f"per step (eager decode step by layer count, us: {steps}; R^2 {cal.r2:.4f})")
    return 0


_COMMANDS = {"build": _build, "show": _show, "diff": _diff, "validate": _validate,
             "check": _check, "calibrate": _calibrate, "apply": _apply}


