"""How fast are `plan build` and `plan check` (and a reviewer's `plan show` and `plan diff`) on DeepSeek-V3- and
Kimi-K2-sized checkpoints?

    python benchmarks/plan_speed.py                              # both models, temp checkpoints, 7 repetitions
    python benchmarks/plan_speed.py --dir /tmp/ps -n 9           # keep (and reuse) the checkpoints
    python benchmarks/plan_speed.py --models deepseek-v3 --profile   # plus a cProfile of one build and one check
    python benchmarks/plan_speed.py --label before               # records to results/plan-speed-before.jsonl

Targets (issue 25, "People run `plan build` and `plan check` in CI and pre-commit hooks on every change"):
`plan build` within 2x and `plan check` within 1.5x the time the `safetensors` library needs to list
every shard's keys and shapes; peak memory under 500 MB (issue 2).

What is measured, per model, on a header-only checkpoint from `tests/synthetic.py` (valid headers, data
regions left as sparse holes) with the published config.json facts the planner reads (layers, MTP layers,
experts, experts per token, FP8 block size):
- deepseek-v3: `deepseek_v3()`, 91,990 tensors in 163 shards (686.7 GB);
- kimi-k2: `kimi_k2()`, 139,583 tensors in 61 shards (1029.2 GB).

- header scan: read `model.safetensors.index.json` with `json`, then for every shard
  `safe_open(path, "numpy")`, `f.keys()` and `f.get_slice(k).get_shape()` for each key:
  the least any tool needs to know the checkpoint's inventory;
- plan build: `offplan.cli.main(["build", POLICY])` in this process, as the `plan` command runs it
  (policy, every header, the plan, its file, the summary it prints; stdout and stderr captured);
- plan check: `main(["check", PLAN])` on the plan that build wrote (up to date: exit 0);
- plan show, plan diff (no target; a reviewer's commands, which read whole plans): `show` of a `backend: mixed`
  plan under a GPU budget of half the checkpoint (`MIXED`: no prefetch section), `diff` of the two plans.
The policy is a realistic prefetch one: group 4 / 2 in group / step 2 over `params: [experts]`, with a
rule pinning embed_tokens and lm_head to the GPU. They run interleaved, the order reversed every
other repetition, after one warm-up run of each (headers in the page cache, imports and schemas loaded);
medians are compared.

Memory: the peak RSS (VmHWM; ru_maxrss off Linux) of a fresh interpreter that runs one build or one
check, next to one that only imports offplan's CLI (the floor planning adds to).

Records go to OUT/plan-speed-LABEL.jsonl (default benchmarks/results/, label "current"); with
`--profile`, the top functions of one build and one check by cumulative time too. `benchmarks/report.py`
puts every label's run in RESULTS.md. To measure another planner with this script (a "before"), run it
with PYTHONPATH pointing at that checkout: the script imports whatever `planner` and `offplan` it finds.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import json
import os
import platform
import pstats
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
# name -> (tests/synthetic.py function, shard bytes that give the published shard count, config.json)
MODELS = {
    "deepseek-v3": ("deepseek_v3", 4_230_000_000, {
        "model_type": "deepseek_v3", "num_hidden_layers": 61, "num_nextn_predict_layers": 1,
        "first_k_dense_replace": 3, "n_routed_experts": 256, "num_experts_per_tok": 8, "quantization_config": FP8}),
    "kimi-k2": ("kimi_k2", 17_000_000_000, {
        "model_type": "kimi_k2", "num_hidden_layers": 61, "num_nextn_predict_layers": 0,
        "first_k_dense_replace": 1, "n_routed_experts": 384, "num_experts_per_tok": 8, "quantization_config": FP8}),
}
POLICY = """\
# Benchmark policy: prefetch the routed and shared experts of 2 layers in every 4.
format_version: 1
checkpoint: ./checkpoint
backend: prefetch
prefetch:
  group_size: 4
  num_in_group: 2
  step: 2
  params: [experts]
rules:
  - match: [embed_tokens, lm_head]
    place: gpu
"""
MIXED = """\
# Benchmark policy: the mixed backend under a GPU budget of half the checkpoint (no prefetch: section).
format_version: 1
checkpoint: ./checkpoint
backend: mixed
budget_gib: {gib}
"""
TARGETS = {"build": 2.0, "check": 1.5}  # show and diff (of the two plans) have none: reported beside them
TARGET_MB = 500
PROFILE_ROWS = 15


def make_checkpoint(root: Path, model: str) -> Path:
    """Write (or reuse) the model's header-only checkpoint and the policy under `root`; return the policy."""
    sys.path.insert(0, str(HERE.parent / "tests"))  # the test fixtures
    import synthetic

    factory, shard_bytes, config = MODELS[model]
    ckpt = root / "checkpoint"
    if not (ckpt / "model.safetensors.index.json").is_file():
        t = time.perf_counter()
        synthetic.write_header_only(ckpt, getattr(synthetic, factory)(), shard_bytes=shard_bytes)
        print(f"wrote {ckpt} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    (ckpt / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    policy = root / "bench.policy.yaml"
    policy.write_text(POLICY)
    total = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    (root / "mixed.policy.yaml").write_text(MIXED.format(gib=f"{total / 2 / 2**30:.4g}"))
    return policy


def header_scan(ckpt: Path) -> int:
    """The safetensors library listing every shard's keys and shapes; returns the tensor count."""
    from safetensors import safe_open

    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    count = 0
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(ckpt / shard, "numpy") as f:
            for k in f.keys():
                f.get_slice(k).get_shape()
                count += 1
    return count


def command(argv: list[str]) -> str:
    """`plan ARGV` in this process, as the CLI runs it; returns its stdout. Anything but exit 0 is a failure."""
    from offplan.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    if code != 0:
        raise SystemExit(f"plan {' '.join(argv)} exited {code}:\n{err.getvalue()}")
    return out.getvalue()


def _timed(fn, arg) -> float:
    gc.collect()
    t = time.perf_counter()
    fn(arg)
    return time.perf_counter() - t


def _peak_rss_mb() -> float:
    """This process's peak resident set, in MB.

    Linux: VmHWM from /proc, because `ru_maxrss` survives exec() and so reports
    the benchmark's own peak in a child it spawned. Elsewhere: `ru_maxrss`.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e6
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1e6 if sys.platform == "darwin" else rss * 1024 / 1e6


def _child(mode: str, path: Path) -> float:
    """Peak RSS in MB of a fresh interpreter that imports offplan's CLI and, unless `mode` is "import", runs
    `plan MODE PATH` once."""
    out = subprocess.run([sys.executable, __file__, "--child", mode, str(path)],
                         check=True, capture_output=True, text=True).stdout
    return float(out)


def _child_main(mode: str, path: str) -> int:
    import offplan.cli  # noqa: F401 (the floor: what importing the CLI takes)
    if mode != "import":
        command([mode, path])
    print(_peak_rss_mb())
    return 0


def _profile(name: str, fn, arg) -> list[dict]:
    """cProfile of one run: printed (by cumulative time, then own time) and returned as records."""
    prof = cProfile.Profile()
    prof.enable()
    fn(arg)
    prof.disable()
    print(f"\ncProfile of one `plan {name}` (cumulative time, then own time):")
    stats = pstats.Stats(prof, stream=sys.stdout).strip_dirs()
    stats.sort_stats("cumulative").print_stats(25)
    stats.sort_stats("tottime").print_stats(15)
    total = sum(tt for _, _, tt, _, _ in stats.stats.values())
    out = []
    for order, column in (("cumulative", 3), ("own", 2)):
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][column])[:PROFILE_ROWS]
        out += [{"kind": "profile", "command": name, "order": order, "total_s": round(total, 4), "rank": i,
                 "function": f"{Path(file).name}:{line}({func})", "ncalls": nc, "tottime_s": round(tt, 4),
                 "cumtime_s": round(ct, 4)} for i, ((file, line, func), (_, nc, tt, ct, _)) in enumerate(rows)]
    return out


def run_model(root: Path, model: str, repeat: int, profile: bool) -> list[dict]:
    policy = make_checkpoint(root, model)
    ckpt, plan = root / "checkpoint", root / "bench.plan.yaml"
    shards = len(list(ckpt.glob("*.safetensors")))
    mixed = root / "mixed.plan.yaml"
    fns = {"header scan": (header_scan, ckpt), "build": (command, ["build", str(policy)]),
           "check": (command, ["check", str(plan)]), "show": (command, ["show", str(mixed)]),
           "diff": (command, ["diff", str(plan), str(mixed)])}
    tensors = header_scan(ckpt)  # the warm-up: page cache, imports, schemas
    command(["build", str(policy)])
    command(["build", str(root / "mixed.policy.yaml")])
    command(["check", str(plan)])
    print(f"\n{model}: {tensors} tensors in {shards} shards (header-only), {repeat} repetitions")
    times = {k: [] for k in fns}
    for r in range(repeat):
        for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            fn, arg = fns[name]
            times[name].append(_timed(fn, arg))
    med = {k: statistics.median(v) for k, v in times.items()}
    floor = _child("import", plan)
    rss = {k: _child(k, policy if k == "build" else plan) for k in ("build", "check")}
    print(f"{'':<14}{'median':>9}{'min':>9}{'max':>9}{'x scan':>9}{'target':>9}{'peak RSS':>10}")
    for k, v in times.items():
        ratio = med[k] / med["header scan"]
        target = f"<= {TARGETS[k]}x" if k in TARGETS else ""
        mem = f"{rss[k]:.0f} MB" if k in rss else ""
        print(f"{k:<14}{med[k]:>8.3f}s{min(v):>8.3f}s{max(v):>8.3f}s{ratio:>8.2f}x{target:>9}{mem:>10}")
    print(f"(peak RSS of a process that only imports offplan's CLI: {floor:.0f} MB; target < {TARGET_MB} MB)")
    records = [{"kind": "checkpoint", "model": model, "tensors": tensors, "shards": shards,
                "bytes": sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))}]
    records += [{"kind": "timing", "model": model, "what": k, "median_s": round(med[k], 4),
                 "runs_s": [round(t, 4) for t in v], "ratio_to_scan": round(med[k] / med["header scan"], 3),
                 "target": TARGETS.get(k), "peak_rss_mb": round(rss[k]) if k in rss else None}
                for k, v in times.items()]
    records.append({"kind": "memory", "model": model, "import_only_rss_mb": round(floor), "target_mb": TARGET_MB})
    if profile:
        for name in ("build", "check"):
            records += [dict(r, model=model) for r in _profile(name, *fns[name])]
    return records


def _cpu() -> str:
    """The CPU's model name (Linux), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run(root: Path, models: list[str], repeat: int, profile: bool, out: Path, label: str, note: str) -> int:
    import planner

    records = [{"kind": "run", "label": label, "note": note, "python": platform.python_version(),
                "machine": platform.machine(), "cpu": _cpu(), "cpus": os.cpu_count(),
                "planner": str(Path(planner.__file__).parent), "repeat": repeat}]
    for model in models:
        (root / model).mkdir(parents=True, exist_ok=True)
        records += run_model(root / model, model, repeat, profile)
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"plan-speed-{label}.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"\nwrote {log}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, help="where to write (or find) the checkpoints; default: a temp dir")
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("-n", "--repeat", type=int, default=7, help="timed repetitions of each (default 7)")
    ap.add_argument("--profile", action="store_true", help="print and record a cProfile of one build and one check")
    ap.add_argument("--out", type=Path, default=HERE / "results", help="where the JSONL records go")
    ap.add_argument("--label", default="current", help="names the run and its file (e.g. before, after)")
    ap.add_argument("--note", default="", help="what planner ran, for the report (e.g. 'main at 10b3f91')")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return _child_main(*args.child)
    if args.dir:
        return run(args.dir, args.models, args.repeat, args.profile, args.out, args.label, args.note)
    with tempfile.TemporaryDirectory(prefix="offplan-bench-") as d:
        return run(Path(d), args.models, args.repeat, args.profile, args.out, args.label, args.note)


if __name__ == "__main__":
    sys.exit(main())
