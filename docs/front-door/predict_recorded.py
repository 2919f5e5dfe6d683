"""The plans' predictions beside what the recorded runs measured, from this tree's planner, with no GPU.

    python docs/front-door/predict_recorded.py                        # every front-door, moe-cpu and prefill run
    python docs/front-door/predict_recorded.py RUN.jsonl --check 0.2  # exit 1 if a replayed decode row is off by more

A front-door run (benchmarks/front_door.py) records each plan's decode rate, replayed and eager, at each batch; a
moe.py run with experts on cpu (`moe-cpu-*`, harness/host_rows.py) its replayed rate per share of the experts on cpu
or per batch's own split; a prefill run (benchmarks/prefill.py) each plan's time to first token per prompt length.
Each records the hardware profile it calibrated. Here the planner builds each row's plan again as the benchmark did
(its policy and budgets, and `workload: {batch_size: B, cuda_graphs: ...}` or `{prompt_tokens: T}`), with that run's
profile, over a header-only checkpoint of the run's model and depth (tests/synthetic.py: the benchmark checkpoint's
names, dtypes and shapes, so the same plan; the FP8 rows a block-scaled FP8 copy's headers, as
tests/quantized_models.py `write_fp8` writes it). So a change to the cost model is set against every measurement on
record, on any machine (issue 25: every row within +-20%). It needs torch and transformers, which the benchmarks'
modules import: their policies are taken from them, not written again here.

Compared: decode rows replayed (the loop's rate) and eager (`generate --eager`), per plan and batch, and prefill
rows. Left out, saying why: a plan rebuilt that is not the run's (other bytes on the GPU, uva or prefetch: the
planner has changed its mind since); a batch above 1 with routed experts in host memory, on uva or cpu, or FP8 ones
anywhere (staged dequantized, fp8_gather.py), whose step reads what the batch routes to: the run's sequences route
alike (copies of one prompt before run g; there distinct prompts, but a random model's routers pick mostly the same
experts for any token: 2.2-2.3x the prediction at batch 8) and a step reads little more than one sequence's, where
the plan predicts independent tokens' routing (resident FP8 at batch 8: 1.48x, run f1); and a plan for that workload
that places otherwise than the applied one, at another batch than the applied plan's (at its batch the applied
plan's own prediction of the other mode stands in: a plan predicts replayed and eager steps, Cost.step_us_in; the
benchmark recorded none there before). `--check` judges the front-door runs' replayed decode rows only: an eager
prediction rests on the run's calibrated launch overheads, which vary between calibrations by up to 2x (issue 25's
calibration item), and a long prompt's on one GEMM rate for every shape (docs/front-door/README.md); the moe-cpu
runs' oldest profiles come from calibrations since replaced, and their first two runs from a host kernel since
replaced. The last lines count, per kind of run, the compared rows (eager ones too) within 1 +- 0.2 of the current
prediction (1 +- TOLERANCE with `--check`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "benchmarks"
sys.path[:0] = [str(ROOT), str(HERE), str(ROOT / "tests")]
import synthetic  # noqa: E402  (the header-only checkpoints' writer)
import prefill  # noqa: E402
from front_door import policy  # noqa: E402
from harness.checkpoints import config_for  # noqa: E402
from harness import host_rows  # noqa: E402
from harness.plans import experts_working_bytes, make_plan, offloaded_layers, predicted_us  # noqa: E402
from planner.decide.build import build  # noqa: E402
from planner.inputs.checkpoint import open_checkpoint  # noqa: E402
from planner.inputs.dtypes import nbytes  # noqa: E402
from planner.inputs.hardware import H100, Hardware, dumps_hardware  # noqa: E402
from planner.inputs.policy import load_policy  # noqa: E402
from planner.inputs.quantized import FP8_SCALE  # noqa: E402
from planner.plan import Placement  # noqa: E402
from planner.planfile import load_plan  # noqa: E402

SHAPES = {"qwen3-30b-a3b": synthetic.qwen3_moe, "llama-8b": synthetic.llama}
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def checkpoints(work: Path, model: str, layers: int) -> None:
    """Header-only `ckpt` and `fp8` under `work`, with the benchmark checkpoint's config.json."""
    tensors = SHAPES[model](layers=layers)
    config = config_for(model, layers).to_dict()
    synthetic.write_header_only(work / "ckpt", tensors, 4 * 10**9)
    (work / "ckpt" / "config.json").write_text(json.dumps(config))
    fp8 = []
    for name, dtype, shape in tensors:
        if len(shape) == 2 and name.endswith("_proj.weight"):  # write_fp8's projections
            fp8 += [(name, "F8_E4M3", shape), (name + "_scale_inv", "F32", tuple(-(-d // 128) for d in shape))]
        else:
            fp8.append((name, dtype, shape))
    synthetic.write_header_only(work / "fp8", fp8, 4 * 10**9)
    (work / "fp8" / "config.json").write_text(json.dumps({**config, "quantization_config": FP8}))


def profile(recorded: dict) -> tuple[Hardware, list[str]]:
    """A run's hardware profile, and the fields its record lacks (a calibration older than they are: their defaults
    are used, which the tables say). On the H100 machine those are the built-in profile's (planner/inputs/hardware.py
    H100), which were measured there (a MoE layer's eager CPU time among them), not the dataclass's fallbacks."""
    fields = dataclasses.fields(Hardware)
    recorded = dict(recorded)
    said = re.search(r"fastest round \(the median round ([0-9.]+)x slower\)", recorded.get("measured", ""))
    if "eager_median_ratio" not in recorded and said:  # a fastest-round calibration before the field: its note
        recorded["eager_median_ratio"] = float(said.group(1))
    base = H100 if "H100" in str(recorded.get("name", "")) else None
    hw = Hardware(**{f.name: recorded[f.name] if f.name in recorded else getattr(base, f.name)
                     for f in fields if f.name in recorded or base is not None})
    return hw, [f.name for f in fields if f.name not in recorded and f.name != "measured"]


BYTES = ("gpu_bytes", "uva_bytes", "prefetch_bytes", "cpu_bytes")  # a record's, where it has them


def same_plan(summary, record: dict) -> bool:
    """Whether a plan rebuilt places the bytes the run's did (each byte figure the record holds)."""
    return all(getattr(summary, key) == record[key] for key in BYTES if key in record)


def repredict(records: list[dict], work: Path) -> tuple[list[dict], list[str]]:
    """One row per (plan, batch, mode) of a front-door run's records: measured, recorded and current predictions;
    and the profile fields the run's record lacks."""
    run = records[0]
    if run["kind"] != "run" or run["model"] not in SHAPES:
        return [], []
    hw, lacks = profile(run["hardware"])
    layers = run["layers"]
    checkpoints(work, run["model"], layers)
    (work / "hw.yaml").write_text(dumps_hardware(hw))
    if open_checkpoint(work / "ckpt").total_bytes != run["checkpoint_bytes"]:
        raise SystemExit(f"the header-only {run['model']} of {layers} layers is not the run's checkpoint "
                         f"({run['checkpoint_bytes']} bytes): its record's model or depth is not what it measured")
    head = "format_version: 1\ncheckpoint: ckpt\nhardware: hw.yaml\n"
    budget = run["checkpoint_bytes"] // 2 + experts_working_bytes(work, head)
    split = load_plan(make_plan(work, "experts-uva", policy("experts-uva", layers, budget))).summary.gpu_footprint_bytes
    rows = []
    for r in records[1:]:
        if r["kind"] != "decode" or r["path"] not in ("loop", "generate --eager"):
            continue
        row = {k: r[k] for k in ("strategy", "batch", "mode", "steps_per_s", "predicted_steps_per_s")}
        text = policy(r["strategy"], layers, budget, split)
        a = build(load_policy(write(work / f"{r['strategy']}.policy.yaml", text)), work)
        applied, ran = a.params, same_plan(a.summary, r)
        graph = r["mode"] == "graph"
        workload = f"workload: {{batch_size: {r['batch']}, cuda_graphs: {'true' if graph else 'false'}}}\n"
        d = build(load_policy(write(work / f"{r['strategy']}-b{r['batch']}.policy.yaml", text + workload)), work)
        step = d.summary.predicted_step_us
        if d.params != applied and a.cost.batch_size == r["batch"] and a.cost.step_us_in(graph):
            d, step = a, a.cost.step_us_in(graph)  # the applied plan's own prediction of that mode (it gives both)
        row["now_steps_per_s"] = 1e6 / step
        host = any(".mlp.experts." in n and (p in (Placement.UVA, Placement.CPU) or n.endswith(FP8_SCALE))
                   for n, p in applied.items())  # staged by routing: in host memory, or FP8 (dequantized)
        row["left_out"] = ("not the run's plan" if not ran else "sequences routed alike" if r["batch"] > 1 and host
                           else "places otherwise" if d.params != applied else "")
        rows.append(row)
    return rows, lacks


def repredict_prefill(records: list[dict], work: Path) -> tuple[list[dict], list[str]]:
    """One row per (plan, prompt tokens) of a prefill run's records (benchmarks/prefill.py, half the decoder layers
    offloaded, prefill.py's default: the byte check catches another): measured, recorded and current predictions of
    the time to first token, ms; and the profile fields the run's record lacks."""
    checkpoint = next((r for r in records if r["kind"] == "checkpoint"), None)
    if checkpoint is None or checkpoint["model"] not in SHAPES:
        return [], []
    model, run_hw, layers = checkpoint["model"], next(r for r in records if r["kind"] == "hardware"), depth(checkpoint)
    checkpoints(work, model, layers)
    hw, lacks = profile(run_hw)
    (work / "hw.yaml").write_text(dumps_hardware(hw))
    off = offloaded_layers(layers, 0.5)
    budget = load_plan(make_plan(work, "prefetch", prefill.policy("prefetch", off, 0.5, work / "hw.yaml", None))
                       ).summary.gpu_footprint_bytes / 2**30  # prefill.py's mixed budget
    rows = []
    for r in records:
        if r["kind"] != "prefill":
            continue
        text = prefill.policy(r["strategy"], off, 0.5, work / "hw.yaml", budget)
        a = build(load_policy(write(work / f"{r['strategy']}.policy.yaml", text)), work)
        ran = same_plan(a.summary, r)
        path = write(work / f"{r['strategy']}-{r['tokens']}.policy.yaml",
                     text + f"workload: {{prompt_tokens: {r['tokens']}}}\n")
        d = build(load_policy(path), work)
        rows.append({"strategy": r["strategy"], "tokens": r["tokens"], "ms": r["prefill_ms"],
                     "then_ms": r["predicted_ms"], "now_ms": d.cost.prefill_us / 1e3,
                     "left_out": "not the run's plan" if not ran else
                     "places otherwise" if d.params != a.params else ""})
    return rows, lacks


HOST_FIELDS = ("cpu_expert_gbps", "cpu_expert_alone_gbps", "cpu_expert_sync_us", "cpu_threads", "cpu_rates_threads")


def repredict_host(records: list[dict], work: Path) -> tuple[list[dict], list[str]]:
    """One row per replayed decode row of a moe.py run with experts on cpu (harness/host_rows.py): the first
    `cpu_fraction` of every layer's experts on cpu and the rest on uva, on the row's host threads; or the plan's own
    split (`backend: mixed` with `cpu_experts: true` under the all-uva plan's footprint, per batch). Where the run
    measured the host at the row's threads (a `host-calibration` row, run6 on), the plan is predicted with those
    figures; else with the profile's rates, whatever the row's threads."""
    checkpoint = next((r for r in records if r["kind"] == "checkpoint"), None)
    if checkpoint is None or checkpoint["model"] not in SHAPES:
        return [], []
    layers, model = depth(checkpoint), checkpoint["model"]
    checkpoints(work, model, layers)
    hw, lacks = profile(next(r for r in records if r["kind"] == "hardware"))
    (work / "hw.yaml").write_text(dumps_hardware(hw))
    head, experts = "format_version: 1\ncheckpoint: ckpt\nhardware: hw.yaml\n", config_for(model, layers).num_experts
    budget = load_plan(make_plan(work, "experts-host", head + host_rows.UVA_REST.replace("  -", "rules:\n  -", 1))
                       ).summary.gpu_footprint_bytes / 2**30
    # runs since host_rows.py measured the host at each --cpu-threads: those threads' own figures
    by_threads = {c["cpu_threads"]: dataclasses.replace(hw, **{k: c[k] for k in HOST_FIELDS})
                  for c in records if c["kind"] == "host-calibration"}
    for threads, calibrated in by_threads.items():
        (work / f"hw-t{threads}.yaml").write_text(dumps_hardware(calibrated))
    rows = []
    for r in records:
        if r["kind"] != "decode" or r.get("cpu_fraction") is None or r["mode"] not in ("graph", "compiled-graph"):
            continue
        row = {"name": r["name"], "batch": r["batch"], "mode": r["mode"], "steps_per_s": r["steps_per_s"],
               "then": r["predicted_steps_per_s"], "left_out": ""}
        own = r.get("cpu_threads") in by_threads
        if r.get("split_by_plan"):
            d = build(load_policy(write(work / f"split-{r['batch']}.policy.yaml", (
                head.replace("hw.yaml", f"hw-t{r['cpu_threads']}.yaml") if own else head) + (
                f"backend: mixed\ncpu_experts: true\nbudget_gib: {budget!r}\n"
                f"workload: {{batch_size: {r['batch']}, cuda_graphs: true}}\n"))), work)
            row["now"], row["left_out"] = 1e6 / d.summary.predicted_step_us, "" if same_plan(d.summary, r) else \
                "not the run's plan"
        else:
            threads = by_threads[r["cpu_threads"]] if own else dataclasses.replace(
                hw, cpu_threads=r["cpu_threads"] or hw.cpu_threads)
            count = round(r["cpu_fraction"] * experts)  # a plan file per count: predicted_us caches by path
            plan = make_plan(work, f"cpu-{count}", head + host_rows.cpu_rules(count, experts))
            row["now"] = 1e6 / predicted_us(plan, threads, r["batch"], graphs=True)
        rows.append(row)
    return rows, lacks


def depth(checkpoint: dict) -> int:
    """The layers of the checkpoint record's model that make its bytes."""
    model, total = checkpoint["model"], checkpoint["bytes"]
    found = next((n for n in range(1, 129) if sum(nbytes(d, shape) for _, d, shape in SHAPES[model](layers=n))
                  == total), None)
    if found is None:
        raise SystemExit(f"no depth of {model} has the run's {total} bytes")
    return found


def lacking(fields: list[str]) -> str:
    return f"; its profile lacks {', '.join(fields)}: defaults used" if fields else ""


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def table(title: str, columns: list[str], unit: str, rows: list[tuple[list, float, float | None, float, str]]
          ) -> list[str]:
    """Markdown: per row, its own `columns`, then measured (`unit`) and the predictions then and now, each with
    measured / predicted; `rows`: (its columns' cells, measured, predicted then or None, now, why left out or "")."""
    out = [title, "", "| " + " | ".join(columns) + f" | measured {unit} | predicted then | measured / predicted then | "
           "predicted now | measured / predicted now |", "|---" * (len(columns) + 5) + "|"]
    for own, measured, then, now, left_out in rows:
        if left_out:
            rest = f"- | - | - | left out: {left_out}"
        else:
            rest = (f"{then:.1f} | {measured / then:.2f}" if then else "- | -") + f" | {now:.1f} | {measured / now:.2f}"
        out.append("| " + " | ".join(map(str, own)) + f" | {measured:.1f} | {rest} |")
    return out + [""]


def off(rows: list[dict], tolerance: float) -> list[dict]:
    """The graph rows compared whose measured / predicted-now is outside 1 +- `tolerance`."""
    return [r for r in rows if r["mode"] == "graph" and not r["left_out"]
            and abs(r["steps_per_s"] / r["now_steps_per_s"] - 1) > tolerance]


def tally(within: dict, kind: str, pairs: list[tuple[float, float]], tolerance: float | None) -> None:
    """Add a run's compared rows, (measured, predicted now), to `within[kind]`: [rows within 1 +- tolerance
    (default 0.2) of measured / predicted, rows]. Rates and times alike: the ratio's distance from 1 is the test."""
    got = [abs(measured / now - 1) <= (tolerance or 0.2) for measured, now in pairs]
    within[kind] = [a + b for a, b in zip(within.get(kind, (0, 0)), (sum(got), len(got)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="*", type=Path,
                    help="front-door or prefill records (default: every one in benchmarks/results)")
    ap.add_argument("--check", type=float, metavar="TOLERANCE",
                    help="exit 1 if a compared replayed decode row of a front-door run is outside 1 +- TOLERANCE")
    args = ap.parse_args(argv)
    results = HERE / "results"
    runs = args.runs or [p for kind in ("front-door", "moe-cpu", "prefill")
                         for p in sorted(results.glob(f"{kind}-*.jsonl"))]
    bad, within = [], {}  # within: kind -> [compared rows within the tolerance, compared rows]
    for path in runs:
        records = [json.loads(line) for line in path.read_text().splitlines()]
        kind = "moe-cpu" if path.name.startswith("moe-cpu-") else "prefill" if path.name.startswith("prefill-") \
            else "front-door"
        try:
            with tempfile.TemporaryDirectory() as work:
                rows, lacks = {"moe-cpu": repredict_host, "prefill": repredict_prefill,
                               "front-door": repredict}[kind](records, Path(work))
        except SystemExit as e:
            raise SystemExit(f"{path}: {e}; leave this record out, or measure it again") from None
        if kind == "moe-cpu":
            print("\n".join(table(f"{path.name} (experts on cpu{lacking(lacks)})", ["plan", "batch", "mode"], "steps/s",
                                   [([r["name"], r["batch"], r["mode"]], r["steps_per_s"], r["then"], r["now"],
                                     r["left_out"]) for r in rows])))
            tally(within, kind, [(r["steps_per_s"], r["now"]) for r in rows if not r["left_out"]], args.check)
        elif kind == "prefill":
            print("\n".join(table(f"{path.name} (time to first token{lacking(lacks)})", ["plan", "tokens"], "ms", [
                ([r["strategy"], r["tokens"]], r["ms"], r["then_ms"], r["now_ms"], r["left_out"]) for r in rows])))
            tally(within, kind, [(r["ms"], r["now_ms"]) for r in rows if not r["left_out"]], args.check)
        elif rows:
            run = records[0]
            title = f"{path.name} ({run['device']}, {run['layers']} layers{lacking(lacks)})"
            print("\n".join(table(title, ["plan", "batch", "mode"], "steps/s",
                                   [([r["strategy"], r["batch"], r["mode"]], r["steps_per_s"],
                                     r["predicted_steps_per_s"], r["now_steps_per_s"], r["left_out"])
                                    for r in rows])))
            bad += [f"{path.name}: {r['strategy']} batch {r['batch']}: "
                    f"{r['steps_per_s'] / r['now_steps_per_s']:.2f}" for r in off(rows, args.check or 0)]
            tally(within, kind, [(r["steps_per_s"], r["now_steps_per_s"]) for r in rows if not r["left_out"]],
                  args.check)
    for kind, (good, compared) in within.items():
        print(f"{kind}: {good} of {compared} compared rows within 1 +- {args.check or 0.2} of the current prediction")
    if args.check is not None and bad:
        print(f"outside 1 +- {args.check}: " + "; ".join(bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
