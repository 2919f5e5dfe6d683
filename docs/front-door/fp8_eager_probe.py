"""Kept as it ran, its import path moved with it (`cd benchmarks; OUT=... python ../docs/front-door/fp8_eager_probe.py PLAN BATCH`, after
`front_door_probe.py setup`): an eager decode loop step by step, the CPU time to launch each step against its GPU
time between events, the token fed back or held, with and without the garbage collector; then profiles."""
import gc, json, os, sys, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
import front_door_probe as fdp

OUT = Path(os.environ.get("OUT", "/tmp/out"))


def loop(gen, st, x, new, feed, sync_each):
    """Per step: CPU time to launch (perf_counter around the step's calls), and GPU time by events."""
    batch = x.shape[0]
    logits = gen._prefill(st, gen._shape(x, new, 0)[0])
    token = logits[:, -1].argmax(-1)
    torch.cuda.synchronize()
    cpu, evs = [], []
    t_all = time.perf_counter()
    for i in range(1, new):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        e0.record()
        st.ids.copy_(token.view(batch, 1))
        st.pos.fill_(x.shape[1] + i - 1)
        logits = gen._run(st)
        nt = logits[:, -1].argmax(-1)
        if feed:
            token = nt
        e1.record()
        cpu.append(1e3 * (time.perf_counter() - t))
        evs.append((e0, e1))
        if sync_each:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    wall = 1e3 * (time.perf_counter() - t_all) / (new - 1)
    gpu = [a.elapsed_time(b) for a, b in evs]
    med = lambda v: sorted(v)[len(v) // 2]
    return {"wall_ms_per_step": round(wall, 2), "cpu_med": round(med(cpu), 2), "cpu_first16": [round(c, 1) for c in cpu[:16]],
            "cpu_last16": [round(c, 1) for c in cpu[-16:]], "gpu_med": round(med(gpu), 2),
            "gpu_last16": [round(g, 1) for g in gpu[-16:]]}


def main(plan, batch, new=65):
    from runtime.hf import from_pretrained
    model, handle = from_pretrained(plan, device="cuda", progress=False)
    gen = handle.generator(eager=True)
    x = fdp.ids(batch)
    gen.prepare(x, new)
    res = {"plan": Path(plan).stem, "batch": batch, "rates": [round(gen(x, new).decode_tokens_per_s, 1) for _ in range(3)]}
    _, _, st = gen._shape(x, new, 0)
    with torch.no_grad():
        for name, feed, sync_each, nogc in (("feed", True, False, False), ("fixed", False, False, False),
                                            ("feed-nogc", True, False, True), ("feed-sync", True, True, False),
                                            ("feed2", True, False, False)):
            if nogc:
                gc.collect(); gc.disable()
            res[name] = loop(gen, st, x, new, feed, sync_each)
            if nogc:
                gc.enable()
        res["rates_after"] = [round(gen(x, new).decode_tokens_per_s, 1) for _ in range(2)]
        from torch.profiler import profile, ProfilerActivity
        for name, feed in (("feed", True), ("fixed", False)):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                loop(gen, st, x, 17, feed, False)
            ka = p.key_averages()
            (OUT / f"prof-{res['plan']}-b{batch}-{name}.txt").write_text(
                ka.table(sort_by="self_cpu_time_total", row_limit=35) + "\n\n" + ka.table(sort_by="self_cuda_time_total", row_limit=25))
    print(json.dumps({"probe": "fp8_eager", **res}), flush=True)
    handle.remove(restore=False)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
