"""The `plan` command: the one place that sees both the planner and the runtime.

    planner/  (headers + policy -> plan file; pure Python)
        ^
    runtime/  (plan file -> model; torch)
        ^
    offplan/  (this CLI: planning commands from planner; apply, calibrate and profile from runtime)

The planner never imports the runtime; the runtime imports the planner's plan
types and reader; this package imports both, the runtime only when `apply`, `calibrate` or
`profile` runs, so planning needs no torch. `main(argv)` returns the exit
code; tests call it directly.

Exit codes: 0 success; 1 bad input (one message, no traceback, nothing
written); 2 "differs" for `diff --detailed-exitcode` and "stale" for `check`;
141 (128 + SIGPIPE, like any tool killed by it) when the reader of stdout went
away (`plan show PLAN | head`), with nothing said.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from importlib import metadata
from pathlib import Path

from planner.errors import OffplanError

from . import planning
from .defaults import PROMPT_LEN, RANDOM_PROMPTS, SEED

EXAMPLES = """examples:
  plan build plans/examples/tiny-moe.policy.yaml        # writes tiny-moe.plan.yaml beside it
  plan show plans/examples/tiny-moe.plan.yaml
  plan apply plans/examples/tiny-moe.plan.yaml
  plan diff old.plan.yaml new.plan.yaml --detailed-exitcode
  plan check plans/examples/tiny-moe.plan.yaml          # exit 2 if the plan is stale
  plan profile plans/examples/tiny-moe -o tiny-moe.routing.yaml   # then `workload: {routing: ...}`
"""


class _UsageError(Exception):
    """A bad command line: exit 1 like any bad input (argparse's own 2 means "differs" here)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise _UsageError(f"{message} (see `{self.prog} --help`)")

    def parse_args(self, args=None, namespace=None):
        """As argparse's, but arguments left over point at the command's own help, where its options are."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            prog = f"{self.prog} {parsed.command}" if getattr(parsed, "command", None) else self.prog
            raise _UsageError(f"unrecognized arguments: {' '.join(extras)} (see `{prog} --help`)")
        return parsed


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
    ap.add_argument("--json", action="store_true", help="print machine-readable JSON (before or after COMMAND)")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    def cmd(name, help):
        p = sub.add_parser(name, help=help, description=help)
        # SUPPRESS: absent here, the flag keeps what `plan --json COMMAND` gave it
        p.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print machine-readable JSON")
        return p

    p = cmd("build", "read a policy and the checkpoint's headers; write the plan")
    p.add_argument("policy", metavar="POLICY", help="policy YAML (see schemas/policy.schema.json)")
    p.add_argument("-o", "--output", metavar="PLAN",
                   help="where to write the plan (default: NAME.plan.yaml beside NAME.policy.yaml; - for stdout, "
                        "its paths relative to the working directory)")
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
    p = cmd("validate", "check a policy (schema, patterns against the checkpoint), a plan, a hardware profile or "
                        "a routing profile")
    p.add_argument("file", metavar="FILE")
    p = cmd("check", "is the plan stale? exit 0 if current, 2 if an input changed (checkpoint, config.json, policy, "
                     "hardware or routing profile) or the plan is not what `plan build` makes of them")
    p.add_argument("plan", metavar="PLAN")
    p.add_argument("--rebuild", action="store_true",
                   help="build the plan again and compare bytes, even where its `built:` stamp says it is current "
                        "(the stamp trusts the offplan version: a changed planner of the same version needs this)")
    p = cmd("calibrate", "measure this GPU's copy, UVA and HBM bandwidths, per-layer CPU and GPU time, and the host's "
                         "figures for experts on cpu")
    p.add_argument("-o", "--output", metavar="PROFILE", default="hardware.yaml",
                   help="where to write the hardware profile (default: hardware.yaml); name it in a "
                        "policy as `hardware: PROFILE`")
    p.add_argument("--cpu-threads", type=_positive, metavar="N",
                   help="measure the host's figures for experts on cpu with N threads of the host kernel, the "
                        "threads plans built with the profile then run (default: the cores this process may run "
                        "on, less one for the thread that launches the GPU's work); calibrate at the threads the "
                        "model will have where other work shares the host")
    p = cmd("apply", "load the plan's checkpoint with transformers, per the plan, and generate")
    p.add_argument("plan", metavar="PLAN")
    p.add_argument("--prompt", action="append", metavar="TEXT",
                   help="a prompt, quoted where it has spaces; repeat --prompt for a batch of them (default: 'The "
                        "capital of France is')")
    p.add_argument("--batch", type=_positive, metavar="B",
                   help="generate for B sequences, the prompts taken in turn (default: one per prompt)")
    p.add_argument("--max-new-tokens", type=_positive, default=16, metavar="N",
                   help="tokens to generate per sequence (default: 16)")
    p.add_argument("--eager", action="store_true",
                   help="run each decode step eagerly (default on a GPU: capture one step in a CUDA graph and "
                        "replay it)")
    p.add_argument("--compile", action="store_true",
                   help="run the decode step under torch.compile (Inductor fuses its small kernels), replayed from "
                        "a CUDA graph unless --eager; compiling costs tens of seconds once per process. Not with a "
                        "tensor-parallel plan")
    p.add_argument("--device", default=None, choices=["cuda", "cpu"], help="default: cuda if available")
    p.add_argument("--gpus", type=_positive, metavar="N",
                   help="the GPUs a tensor-parallel plan runs on, one process each (default and only value: the "
                        "plan's parallel.gpus; with --device cpu, processes on the CPU)")
    p = cmd("profile", "run prompts through the model and record which experts each MoE layer routes them to, "
                       "decode and prefill apart; write a routing profile for a policy's workload.routing")
    p.add_argument("source", metavar="CHECKPOINT_OR_PLAN",
                   help="a checkpoint directory (loaded whole on one device) or a plan (loaded per the plan)")
    p.add_argument("-o", "--output", metavar="PROFILE", required=True,
                   help="where to write the routing profile; name it in a policy as `workload: {routing: PROFILE}`")
    p.add_argument("--prompts", metavar="FILE",
                   help="one prompt per line, tokenized with the checkpoint's tokenizer (default: random token ids)")
    p.add_argument("--random-prompts", type=_positive, metavar="N",
                   help=f"N prompts of random token ids, seed {SEED} (default without --prompts: {RANDOM_PROMPTS})")
    p.add_argument("--prompt-len", type=_at_least_2, metavar="L",
                   help=f"tokens per random prompt (default: {PROMPT_LEN})")
    p.add_argument("--new-tokens", type=_at_least_2, default=32, metavar="M",
                   help="tokens generated greedily per prompt: 1 from the prefill, M-1 decode steps (default: 32)")
    p.add_argument("--device", default=None, choices=["cuda", "cpu"], help="default: cuda if available")
    return ap


def _at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, not {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, not {value}")
        return value
    return parse


_positive = _at_least(1)
_at_least_2 = _at_least(2)  # a prompt of one token is not told from a decode step; M-1 decode steps


def main(argv: list[str] | None = None) -> int:
    as_json = "--json" in (sys.argv[1:] if argv is None else argv)  # until the arguments parse
    try:
        try:
            args = _parser().parse_args(argv)
            as_json = args.json
            code = _COMMANDS[args.command](args)
        except SystemExit as e:  # --help, --version
            code = e.code if isinstance(e.code, int) else 0
        sys.stdout.flush()  # a closed pipe shows here, inside the try, not at interpreter exit
        return code
    except (OffplanError, _UsageError) as e:
        return _fail(e, as_json)
    except BrokenPipeError:
        _drop_stdout()
        return 141
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except OSError as e:  # a path the system refuses where no command looked for it: a name too long, a loop
        if e.filename is None:
            raise  # not about a file the user named: a bug
        return _fail(OffplanError(f"{e.filename}: {e.strerror}: check the path"), as_json)


def _fail(e: Exception, as_json: bool) -> int:
    """The one red line of a user's problem (and, with --json, the same for a program reading stdout)."""
    print(f"error: {e}", file=sys.stderr)
    if as_json:
        problems = getattr(e, "problems", [])
        print(json.dumps({"error": getattr(e, "headline", str(e)) if problems else str(e), "problems": problems},
                         indent=2))
    return 1


def _drop_stdout() -> None:
    """The reader of stdout is gone: send what is still buffered to /dev/null, so that
    Python's flush at exit does not raise again (the recipe in Python's `signal` docs)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout is not a file (captured in tests)
        pass


def _needs_runtime(module: str, name: str):
    """A command of offplan/running.py or profiling.py, imported when it runs: planning needs no torch."""
    def command(args) -> int:
        try:
            commands = importlib.import_module(f"{__package__}.{module}")
        except ImportError as e:
            raise OffplanError(f"plan {args.command} needs the runtime's dependencies ({e.name}); "
                               "install them: pip install 'offplan[runtime]'") from None
        return getattr(commands, name)(args)
    return command


_COMMANDS = {"build": planning.build_command, "show": planning.show_command, "diff": planning.diff_command,
             "validate": planning.validate_command, "check": planning.check_command,
             "apply": _needs_runtime("running", "apply_command"),
             "calibrate": _needs_runtime("running", "calibrate_command"),
             "profile": _needs_runtime("profiling", "profile_command")}


if __name__ == "__main__":  # `python -m offplan.cli` (as torchrun's `-m` runs it): what `plan` and `-m offplan` run
    sys.exit(main())
