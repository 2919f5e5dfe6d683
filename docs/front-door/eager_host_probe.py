"""Where an eager decode step with experts on cpu goes (issue 30: 0.46-0.69x the lower of the all-GPU eager rate
and the floor, where every expert on uva runs at 0.84-0.94x).

    cd benchmarks && python ../docs/front-door/eager_host_probe.py OUT_DIR [ab]

On the 8-layer Qwen3-30B-A3B checkpoint of the benchmarks, batch 1, three plans: all on the GPU, every expert on
uva, and 90 of each layer's 128 experts on cpu (the rest on uva). For each, one eager step repeated: its CPU time
to launch (no sync) and its wall time (synced), medians of 30; and the graph replay's wall time. For the cpu plan
also the host job's mean time per call in each mode (engine `times`), and variants of the host pool (its threads,
its workers' spin between calls, the host's job left out). Then a torch profiler trace of 4 eager steps of the cpu
and the uva plans. One JSON line per measurement on stdout and in OUT_DIR/eager-host-probe.jsonl.

`ab`: one load of the cpu plan, its eager step timed in rounds, each round both ways in turn: the engine called
directly (experts.py outside torch.compile) and through its custom ops (as before); the all-GPU and uva plans'
eager steps before and after. The recorded run (eager-host-probe-h200-ab.jsonl) also timed a build whose eager
jobs' workers slept between calls (a per-job flag in native.cpp, not kept: slower), its `eager_jobs_spin` false.
"""
import gc
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]
from harness.checkpoints import make_checkpoint  # noqa: E402
from harness.host_rows import cpu_rules  # noqa: E402
from harness.plans import make_plan  # noqa: E402
from planner.inputs.hardware import H100, dumps_hardware  # noqa: E402

WORK = Path("/tmp/offplan-bench/eager-host")
OUT = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/out")
HEAD = "format_version: 1\ncheckpoint: ckpt\nhardware: hw.yaml\n"
REPS = 30


def emit(**row):
    print(json.dumps(row), flush=True)
    with open(OUT / "eager-host-probe.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def load(plan, threads=None, spin_us=None, no_job=False):
    import runtime.execute.host.engine as engine
    import runtime.execute.host.native as native
    from runtime.hf import from_pretrained
    init, pool = engine.HostExperts.__init__, native.Pool.__init__
    if threads is not None:
        engine.HostExperts.__init__ = lambda self, d, t, m, compile=True: init(self, d, threads, m, compile)
    if spin_us is not None:
        native.Pool.__init__ = lambda self, lib, t, spin=native.SPIN_US: pool(self, lib, t, spin_us)
    if no_job:  # the host's job never enqueued: the step's launches without it (its outputs stale)
        engine.HostExperts._enqueue = lambda self, index, tokens, capturing: None if not capturing else \
            ENQUEUE(self, index, tokens, capturing)
    try:
        return from_pretrained(plan, device="cuda", progress=False)
    finally:
        engine.HostExperts.__init__, native.Pool.__init__ = init, pool


def times_per_call(host):
    got = host.times() if host is not None else {}
    calls, seconds = got.get(1, (0, 0.0))
    return calls, seconds


def step_times(plan, label, **variant):
    model, handle = load(plan, **variant)
    host = getattr(handle, "host_experts", None)
    x = torch.tensor([list(b"The capital of France is")], device="cuda")
    row = {"plan": label, **variant}
    for eager in (True, False):
        gen = handle.generator(eager=eager)
        gen.prepare(x, 65)
        st = next(iter(gen.steps.values()))
        c0, s0 = times_per_call(host)
        cpu, wall = [], []
        with torch.no_grad():
            for _ in range(REPS):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                gen._run(st) if eager else st.graph.replay()
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                cpu.append(t1 - t0)
                wall.append(time.perf_counter() - t0)
        c1, s1 = times_per_call(host)
        mode = "eager" if eager else "graph"
        row[mode] = {"launch_ms": 1e3 * sorted(cpu)[REPS // 2], "wall_ms": 1e3 * sorted(wall)[REPS // 2],
                     "host_job_us": 1e6 * (s1 - s0) / (c1 - c0) if c1 > c0 else None}
        if eager and label in ("cpu0.7", "experts-uva") and not variant:
            trace(gen, st, label)
    emit(**row)
    import runtime.execute.host.engine as engine
    engine.HostExperts._enqueue = ENQUEUE
    handle.remove(restore=False)
    del model, handle
    gc.collect()
    torch.cuda.empty_cache()


def trace(gen, st, label):
    from torch.profiler import ProfilerActivity, profile
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(4):
            gen._run(st)
        torch.cuda.synchronize()
    p.export_chrome_trace(str(OUT / f"eager-host-trace-{label}.json"))


def main(measure=True):
    global ENQUEUE
    import runtime.execute.host.engine as engine
    ENQUEUE = engine.HostExperts._enqueue
    OUT.mkdir(parents=True, exist_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    make_checkpoint("qwen3-30b-a3b", 8, WORK / "ckpt", "cuda")
    (WORK / "hw.yaml").write_text(dumps_hardware(H100))
    plans = {"gpu": make_plan(WORK, "gpu", HEAD),
             "experts-uva": make_plan(WORK, "experts-uva", HEAD + "rules:\n  - {match: [experts], place: uva}\n"),
             "cpu0.7": make_plan(WORK, "cpu0.7", HEAD + cpu_rules(90, 128))}
    if not measure:
        return
    for label, plan in plans.items():
        step_times(plan, label)
    for variant in ({"spin_us": 0}, {"no_job": True}, {"threads": 12, "spin_us": 0}, {"threads": 4}):
        step_times(plans["cpu0.7"], "cpu0.7", **variant)
    step_times(plans["gpu"], "gpu")  # the baseline again: the host's pace moves within minutes


class _Compiling:
    """experts.py's `torch` as Dynamo would show it (`ops` variant): is_compiling() True, all else torch's."""

    class compiler:
        is_compiling = staticmethod(lambda: True)

    def __getattr__(self, name):
        return getattr(torch, name)


def ab(rounds=3):
    import runtime.execute.experts as ex
    from runtime.hf import from_pretrained
    plans = {name: WORK / f"{name}.plan.yaml" for name in ("gpu", "experts-uva", "cpu0.7")}
    if not all(p.is_file() for p in plans.values()):
        main(measure=False)
    x = torch.tensor([list(b"The capital of France is")], device="cuda")

    def eager_ms(gen, st):
        wall = []
        with torch.no_grad():
            for _ in range(REPS):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                gen._run(st)
                torch.cuda.synchronize()
                wall.append(time.perf_counter() - t0)
        return 1e3 * sorted(wall)[REPS // 2]

    def baselines(when):
        for name in ("gpu", "experts-uva"):
            model, handle = from_pretrained(plans[name], device="cuda", progress=False)
            gen = handle.generator(eager=True)
            gen.prepare(x, 65)
            emit(probe="ab", plan=name, when=when, eager_wall_ms=eager_ms(gen, next(iter(gen.steps.values()))))
            handle.remove(restore=False)
            del model, handle
            gc.collect()
            torch.cuda.empty_cache()

    baselines("before")
    model, handle = from_pretrained(plans["cpu0.7"], device="cuda", progress=False)
    gen = handle.generator(eager=True)
    gen.prepare(x, 65)
    st = next(iter(gen.steps.values()))
    torch_ = ex.torch
    want = gen(x, 33).tokens
    for r in range(rounds):
        for ops in (False, True):
            ex.torch = _Compiling() if ops else torch_
            try:
                ms = eager_ms(gen, st)
                same = gen(x, 33).tokens == want
            finally:
                ex.torch = torch_
            emit(probe="ab", plan="cpu0.7", round=r, through_ops=ops, eager_wall_ms=ms, same_tokens=same)
    graph = handle.generator()
    emit(probe="ab", plan="cpu0.7", graph_steps_per_s=[graph(x, 65).decode_tokens_per_s for _ in range(3)])
    handle.remove(restore=False)
    del model, handle, gen, graph
    gc.collect()
    torch.cuda.empty_cache()
    baselines("after")


if __name__ == "__main__":
    ab() if sys.argv[2:] == ["ab"] else main()
