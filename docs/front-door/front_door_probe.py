"""Kept as it ran (`cd benchmarks; python ../docs/front-door/front_door_probe.py MODE ...`, MODE: setup first, then
inproc, first_call, eager_split, fp8_skip, profile or steps): why `plan apply` on the all-GPU plan was 0.90x the loop;
where the eager FP8 batch-8 step goes."""
import json, os, subprocess, sys, time
from pathlib import Path
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks")); sys.path.insert(0, str(ROOT / "tests"))
import torch

OUT = Path(os.environ.get("OUT", "/tmp/out"))
WORK = Path("/tmp/offplan-bench/front-door-qwen3-30b-a3b")


def setup():
    from harness.checkpoints import make_checkpoint
    from harness.plans import make_plan
    from front_door import policy
    from quantized_models import write_fp8
    from planner.inputs.hardware import H100, dumps_hardware
    from planner.inputs.checkpoint import open_checkpoint
    WORK.mkdir(parents=True, exist_ok=True)
    ckpt = make_checkpoint("qwen3-30b-a3b", 8, WORK / "ckpt", "cuda")
    if not (WORK / "fp8" / "model.safetensors.index.json").is_file():
        write_fp8(ckpt, WORK / "fp8", device="cuda")
    (WORK / "hw.yaml").write_text(dumps_hardware(H100))
    total = open_checkpoint(ckpt).total_bytes
    for s in ("gpu", "experts-uva", "experts-uva-fp8"):
        make_plan(WORK, s, policy(s, 8, total))


def ids(batch):
    from front_door import PROMPTS
    return torch.tensor([[b for b in PROMPTS[0].encode()]] * batch, device="cuda")


def inproc(plan, batch, new, warm_replay):
    from runtime.hf import from_pretrained
    model, handle = from_pretrained(plan, device="cuda", progress=False)
    gen = handle.generator()
    x = ids(batch)
    gen.prepare(x, new)
    if warm_replay:
        for s in gen.steps.values():
            s.graph.replay()
        torch.cuda.synchronize()
    rates = [gen(x, new).decode_tokens_per_s for _ in range(3)]
    print(json.dumps({"probe": "inproc", "plan": plan, "batch": batch, "new": new, "warm_replay": warm_replay,
                      "rates": rates}), flush=True)


def first_call(plan, batch, new, busy):
    """Fresh process: prepare (which now runs a short generation), optionally 200 ms of GPU matmuls, 3 calls."""
    from runtime.hf import from_pretrained
    model, handle = from_pretrained(plan, device="cuda", progress=False)
    gen = handle.generator()
    x = ids(batch)
    gen.prepare(x, new)
    if busy:
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        t = time.perf_counter()
        while time.perf_counter() - t < 0.2:
            a @ a
            torch.cuda.synchronize()
    rates = [gen(x, new).decode_tokens_per_s for _ in range(3)]
    print(json.dumps({"probe": "first_call", "plan": plan, "batch": batch, "new": new, "busy": busy,
                      "rates": rates}), flush=True)


def fp8_skip(plan, batch=8, new=65):
    """Graph decode at batch 8, padding slots dequantized or skipped, interleaved, one load."""
    import runtime.execute.experts as ex
    from runtime.hf import from_pretrained
    model, handle = from_pretrained(plan, device="cuda", progress=False)
    orig = ex.dequantize
    x = ids(batch)
    out = {"skip": [], "all": []}
    for _ in range(2):
        for mode in ("skip", "all"):
            ex.dequantize = orig if mode == "skip" else (lambda q, d, s, v=None: orig(q, d, s))
            for g in handle.generators.values():
                g.release()
            handle.generators.clear()
            gen = handle.generator()
            gen.prepare(x, new)
            got = [gen(x, new) for _ in range(2)]
            out[mode].append(got[-1].decode_tokens_per_s)
            out[mode + "_tokens"] = got[-1].tokens
    same = out.pop("skip_tokens") == out.pop("all_tokens")
    print(json.dumps({"probe": "fp8_skip", "rates": out, "same_tokens": same}), flush=True)


def eager_split(plans, batches=(1, 8), reps=20):
    """Per plan and batch: an eager decode step's CPU time to launch (no sync), and its wall time with a sync,
    and a graph replay's wall time: CPU-bound or GPU-bound."""
    from runtime.hf import from_pretrained
    for plan in plans:
        model, handle = from_pretrained(plan, device="cuda", progress=False)
        for b in batches:
            x = ids(b)
            res = {}
            for eager in (True, False):
                gen = handle.generator(eager=eager)
                gen.prepare(x, 65)
                st = next(iter(gen.steps.values()))
                cpu, wall = [], []
                with torch.no_grad():
                    for _ in range(reps):
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        if eager:
                            gen._run(st)
                        else:
                            st.graph.replay()
                        t1 = time.perf_counter()
                        torch.cuda.synchronize()
                        t2 = time.perf_counter()
                        cpu.append(t1 - t0); wall.append(t2 - t0)
                cpu.sort(); wall.sort()
                res["eager" if eager else "graph"] = {"cpu_ms": 1e3 * cpu[reps // 2], "wall_ms": 1e3 * wall[reps // 2]}
            print(json.dumps({"probe": "eager_split", "plan": Path(plan).stem, "batch": b, **res}), flush=True)
        handle.remove(restore=False)
        del model, handle
        import gc; gc.collect(); torch.cuda.empty_cache()


def annotate():
    """Wrap offplan's experts helpers in record_function, so the profile says where their CPU time goes."""
    import functools
    import runtime.execute.experts as ex
    import runtime.execute.gather as ga
    import runtime.place.dequant as dq
    from torch.profiler import record_function

    def wrap(mod, name):
        f = getattr(mod, name)

        @functools.wraps(f)
        def g(*a, **k):
            with record_function("offplan." + name):
                return f(*a, **k)
        setattr(mod, name, g)
    import runtime.place.gemv as fg
    for mod, name in ((ex, "_stage"), (ex, "_grouped"), (ex, "offplan_experts_forward"), (ex, "dequantize"),
                      (ex, "gather"), (ex, "gather_many"), (ex, "route"), (dq, "_dequant_fp8"), (fg, "_fp8_linear")):
        wrap(mod, name)
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    ALL_EXPERTS_FUNCTIONS.register("offplan", ex.offplan_experts_forward)


def profile(plan, batch, eager, steps=8):
    annotate()
    from runtime.hf import from_pretrained
    from torch.profiler import profile as prof, ProfilerActivity
    model, handle = from_pretrained(plan, device="cuda", progress=False)
    gen = handle.generator(eager=eager)
    x = ids(batch)
    gen.prepare(x, steps + 1)
    r = gen(x, steps + 1).decode_tokens_per_s
    m0 = torch.cuda.memory_stats()
    r2 = gen(x, steps + 1).decode_tokens_per_s
    m1 = torch.cuda.memory_stats()
    mem = {k: m1.get(k, 0) - m0.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free",
                                                   "num_sync_all_streams")}
    print(json.dumps({"probe": "mem", "plan": plan, "batch": batch, "rate2": r2, **mem}), flush=True)
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        gen(x, steps + 1)
    name = f"{Path(plan).stem}-b{batch}-{'eager' if eager else 'graph'}"
    ka = p.key_averages()
    (OUT / f"prof-{name}.txt").write_text(
        f"rate {r}\n" + ka.table(sort_by="cpu_time_total", row_limit=40) + "\n\n"
        + ka.table(sort_by="self_cuda_time_total", row_limit=30))
    print(json.dumps({"probe": "profile", "name": name, "rate": r}), flush=True)


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "setup":
        setup()
    elif what == "inproc":
        inproc(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1")
    elif what == "first_call":
        first_call(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1")
    elif what == "eager_split":
        eager_split(sys.argv[2:])
    elif what == "fp8_skip":
        fp8_skip(sys.argv[2])
    elif what == "profile":
        profile(sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1")


def steps_probe(plan, batch=8, new=65):
    """Eager: three timed calls after prepare, then one manual loop's per-step wall times (synced), tokens fed
    back, and the same with the token held fixed."""
    from runtime.hf import from_pretrained
    model, handle = from_pretrained(plan, device="cuda", progress=False)
    gen = handle.generator(eager=True)
    x = ids(batch)
    gen.prepare(x, new)
    rates = [gen(x, new).decode_tokens_per_s for _ in range(3)]
    _, _, st = gen._shape(x, new, 0)
    out = {"plan": Path(plan).stem, "batch": batch, "rates": rates}
    with torch.no_grad():
        for feed in (True, False):
            logits = gen._prefill(st, gen._shape(x, new, 0)[0])
            token = logits[:, -1].argmax(-1)
            times = []
            for i in range(1, new):
                torch.cuda.synchronize()
                t = time.perf_counter()
                st.ids.copy_(token.view(batch, 1))
                st.pos.fill_(x.shape[1] + i - 1)
                logits = gen._run(st)
                nt = logits[:, -1].argmax(-1)
                if feed:
                    token = nt
                torch.cuda.synchronize()
                times.append(1e3 * (time.perf_counter() - t))
            out["feed" if feed else "fixed"] = [round(v, 2) for v in times]
    print(json.dumps({"probe": "steps", **out}), flush=True)


if __name__ == "__main__" and sys.argv[1] == "steps":
    steps_probe(sys.argv[2], int(sys.argv[3]))
