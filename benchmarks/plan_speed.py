"""How fast and how lean is planning a DeepSeek-V3-sized checkpoint?

    python benchmarks/plan_speed.py                      # temp checkpoint, 7 repetitions
    python benchmarks/plan_speed.py --dir /tmp/dsv3 -n 9 # keep (and reuse) the checkpoint
    python benchmarks/plan_speed.py --profile            # plus a cProfile of one planning run

The targets (issue 2, "Performance"): planning takes under 2x the time the
`safetensors` library needs to open every shard and list its keys and shapes,
and peak memory stays under 500 MB.

What is measured, on a header-only checkpoint from `tests/synthetic.py`: `deepseek_v3()`
(91,991 tensors in 163 shards of about 4.2 GB, data regions are sparse holes):

- baseline: read `model.safetensors.index.json` with `json`, then for every shard
  `safe_open(path, "numpy")`, `f.keys()` and `f.get_slice(k).get_shape()` for each
  key. This is the least any tool needs to know the checkpoint's inventory.
- plan: offplan end to end, in-process: `load_policy` (YAML + JSON Schema),
  `open_checkpoint` (index + every header, validated and fingerprinted),
  `build` (layer graph, placement, prefetch schedule), `dumps`, `write_atomic`.
  The policy is a realistic prefetch one: group 4 / 2 in group / step 2 over
  `params: [experts]`, with a rule pinning embed_tokens and lm_head to the GPU.

The two are interleaved, alternating which goes first, after one warm-up run of
each (so both read headers from the page cache); the medians are compared.

Memory: `tracemalloc` peak of one in-process planning run (Python allocations
only), and the peak RSS (VmHWM; ru_maxrss off Linux) of a fresh subprocess
that imports offplan and plans once
(everything: the interpreter, imported modules, C allocations), next to that of
a subprocess that only imports offplan (the floor planning adds to).
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

SHARD_BYTES = 4_230_000_000  # gives DeepSeek-V3's 163 shards (4.22e9 would give 164)
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
TARGET_RATIO = 2.0
TARGET_MB = 500


def make_checkpoint(root: Path) -> Path:
    """Write (or reuse) the header-only checkpoint and the policy under `root`; return the policy."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the test fixtures
    import synthetic

    ckpt = root / "checkpoint"
    if not (ckpt / "model.safetensors.index.json").is_file():
        t = time.perf_counter()
        synthetic.write_header_only(ckpt, synthetic.deepseek_v3(), shard_bytes=SHARD_BYTES)
        print(f"wrote {ckpt} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    policy = root / "bench.policy.yaml"
    policy.write_text(POLICY)
    return policy


def baseline(ckpt: Path) -> int:
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


def plan(policy_path: Path) -> int:
    """offplan end to end, as `plan build` runs it; returns the tensor count."""
    from planner.decide.build import build, default_output
    from planner.inputs.checkpoint import open_checkpoint
    from planner.files import write_atomic
    from planner.planfile import dumps
    from planner.inputs.policy import load_policy

    policy = load_policy(policy_path)
    ckpt = open_checkpoint(policy.checkpoint)
    out = default_output(policy_path)
    p = build(policy, out.parent, ckpt)
    write_atomic(out, dumps(p))
    return p.tensors


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


def _child(mode: str, policy: Path) -> tuple[float, float]:
    """(peak RSS in MB, seconds) of a fresh interpreter that imports offplan and, for 'plan', plans once."""
    out = subprocess.run([sys.executable, __file__, "--child", mode, str(policy)],
                         check=True, capture_output=True, text=True).stdout.split()
    return float(out[0]), float(out[1])


def _child_main(mode: str, policy: str) -> int:
    import planner.decide.build, planner.inputs.checkpoint, planner.inputs.policy, planner.plan  # noqa: F401, E401
    t = time.perf_counter()
    if mode == "plan":
        plan(Path(policy))
    print(_peak_rss_mb(), time.perf_counter() - t)
    return 0


def run(root: Path, repeat: int, profile: bool) -> int:
    policy = make_checkpoint(root)
    ckpt = root / "checkpoint"
    n_shards = len(list(ckpt.glob("*.safetensors")))
    n_base, n_plan = baseline(ckpt), plan(policy)  # warm-up: page cache, imports, schema cache
    assert n_base == n_plan, (n_base, n_plan)
    print(f"checkpoint: {n_plan} tensors in {n_shards} shards (header-only), {repeat} repetitions\n")

    times = {"baseline": [], "plan": []}
    for r in range(repeat):
        order = (("baseline", baseline, ckpt), ("plan", plan, policy))
        for name, fn, arg in order if r % 2 == 0 else order[::-1]:
            times[name].append(_timed(fn, arg))
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["plan"] / med["baseline"]

    tracemalloc.start()
    plan(policy)
    traced_peak = tracemalloc.get_traced_memory()[1] / 1e6
    tracemalloc.stop()
    rss_floor, _ = _child("import", policy)
    rss_plan, cold_s = _child("plan", policy)

    print(f"{'':<34}{'median':>9}{'min':>9}{'max':>9}")
    labels = {"baseline": "baseline (safetensors safe_open)", "plan": "offplan plan (end to end)"}
    for k, v in times.items():
        print(f"{labels[k]:<34}{med[k]:>8.3f}s{min(v):>8.3f}s{max(v):>8.3f}s")
    ok = "OK" if ratio < TARGET_RATIO else "OVER TARGET"
    print(f"\nratio plan / baseline: {ratio:.2f}x  (target < {TARGET_RATIO}x: {ok})")
    ok = "OK" if rss_plan < TARGET_MB else "OVER TARGET"
    print(f"peak memory of planning: peak RSS {rss_plan:.0f} MB in a fresh process "
          f"(target < {TARGET_MB} MB: {ok}; {rss_floor:.0f} MB after imports alone); "
          f"tracemalloc peak {traced_peak:.0f} MB")
    print(f"cold planning in that fresh process (imports excluded): {cold_s:.3f}s")

    if profile:
        print("\ncProfile of one planning run (sorted by cumulative time, then by own time):")
        prof = cProfile.Profile()
        prof.enable()
        plan(policy)
        prof.disable()
        stats = pstats.Stats(prof, stream=sys.stdout).strip_dirs()
        stats.sort_stats("cumulative").print_stats(30)
        stats.sort_stats("tottime").print_stats(20)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, help="where to write (or find) the checkpoint; default: a temp dir")
    ap.add_argument("-n", "--repeat", type=int, default=7, help="timed repetitions of each (default 7)")
    ap.add_argument("--profile", action="store_true", help="print a cProfile summary of one planning run")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "POLICY"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return _child_main(*args.child)
    if args.dir:
        args.dir.mkdir(parents=True, exist_ok=True)
        return run(args.dir, args.repeat, args.profile)
    with tempfile.TemporaryDirectory(prefix="offplan-bench-") as d:
        return run(Path(d), args.repeat, args.profile)


if __name__ == "__main__":
    sys.exit(main())
