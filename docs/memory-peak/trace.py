"""Where does offplan's prefill peak go beyond the plan's footprint? One GPU, plans without the expert ring."""
import json, os, sys, gc
from collections import Counter
from pathlib import Path
sys.path.insert(0, "benchmarks")
import torch
from harness.checkpoints import config_for, make_checkpoint
from harness.plans import make_plan
from planner.planfile import load_plan

OUT = Path(os.environ.get("OUT", "/tmp/memory-peak")); OUT.mkdir(parents=True, exist_ok=True)
work = Path("/tmp/offplan-bench/diag"); work.mkdir(parents=True, exist_ok=True)
layers, T = 8, 8192
config = config_for("qwen3-30b-a3b", layers)
ckpt = make_checkpoint("qwen3-30b-a3b", layers, work / "ckpt", "cuda")
ids = torch.randint(3, config.vocab_size, (1, T), generator=torch.Generator().manual_seed(0)).cuda()
wl = f"workload: {{prompt_tokens: {T}}}\n"
head = "format_version: 1\ncheckpoint: ckpt\n"
plans = {"gpu": head + wl,
         "experts-uva-noring": head + "uva: {stage_experts: false}\nrules:\n  - {match: [experts], place: uva}\n" + wl,
         "uva-noring": head + "uva: {stage_experts: false}\nrules:\n  - match: ['re:^model\\.layers\\.(1|3|5|7)\\.']\n    place: uva\n" + wl,
         "experts-split-noring": head + "uva: {stage_experts: false}\nrules:\n  - match: ['re:\\.mlp\\.experts\\.(" + "|".join(map(str, range(64))) + ")\\.']\n    place: uva\n" + wl}

def frames_key(frames):
    keep = [f for f in frames if ("/runtime/" in f["filename"] or "transformers/" in f["filename"] or "/benchmarks/" in f["filename"])]
    return " < ".join(f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}" for f in keep[:4]) or "?"

def traced(plan):
    from runtime.hf import from_pretrained
    gc.collect(); torch.cuda.empty_cache(); torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model, handle = from_pretrained(plan, device="cuda", progress=False)
    torch.cuda.synchronize()
    loaded = torch.cuda.memory_allocated() - base
    torch.cuda.memory._record_memory_history(max_entries=400000)
    start = torch.cuda.memory_allocated()
    handle.generate(ids, 3)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak = torch.cuda.max_memory_allocated() - base
    live, cur, best, best_live = {}, 0, 0, {}
    for e in snap["device_traces"][torch.cuda.current_device()]:
        if e["action"] == "alloc":
            live[e["addr"]] = e; cur += e["size"]
            if cur > best:
                best, best_live = cur, dict(live)
        elif e["action"] == "free_completed" and e["addr"] in live:
            cur -= live.pop(e["addr"])["size"]
    groups = Counter()
    for e in best_live.values():
        groups[frames_key(e["frames"])] += e["size"]
    handle.remove(restore=False); del model, handle; gc.collect(); torch.cuda.empty_cache()
    return dict(peak=peak, loaded=loaded, above_loaded_at_peak=best, groups=groups.most_common(25))

res = {}
share = None
for name, text in plans.items():
    plan = make_plan(work, name, text)
    s = load_plan(plan).summary
    r = traced(plan)
    r.update(footprint=s.gpu_footprint_bytes, gpu_bytes=s.gpu_bytes, wp=s.working_prefill_bytes,
             wd=s.working_decode_bytes, wb=s.working_buffer_bytes, stage=s.stage_buffer_bytes)
    if name == "gpu":
        share = r["peak"] - s.gpu_footprint_bytes
    r["own"] = r["peak"] - share
    r["ratio"] = r["own"] / s.gpu_footprint_bytes
    res[name] = r
    print(name, json.dumps({k: v for k, v in r.items() if k != "groups"}), flush=True)
    for g, b in r["groups"][:15]:
        print(f"   {b/1e6:9.1f} MB  {g}")
(OUT / "diag.json").write_text(json.dumps(res, indent=1))
