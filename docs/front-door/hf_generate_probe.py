"""Kept as it ran (`python docs/front-door/hf_generate_probe.py`, on a GPU; OUT: where records go): why transformers'
`model.generate` on an offplan-loaded model decodes 5-7x slower than `handle.generate(eager=True)` (front-door
runs: 8.6-16.1 against 70 steps/s, experts on uva, batch 1).

Per plan (all on the GPU; every expert on uva), one load each, steps/s over 64 decode steps after a warm call:
`hf`: model.generate as front_door.py calls it (dynamic cache); `hf_static`: with cache_implementation="static"
and transformers' compilation off; `forward_dynamic`, `forward_static`: the model's forward called in a plain loop
with each cache, no generate (argmax on the GPU, no host read); `eager`: handle.generate(eager=True). Then a
torch.profiler table of 8 steps of model.generate and of the eager handle's, and the count of each CUDA runtime
call (synchronizations, host copies) per step.

`python docs/front-door/hf_generate_probe.py cudnn`: the all-GPU plan only, model.generate's rate over key lengths
it meets for the first time and again, with torch's cuDNN attention on and off (`torch.backends.cuda.
enable_cudnn_sdp`), each on prompts of another length (24, 120, 240 tokens: the key lengths of one never those of
another), and handle.generate(eager=True) beside."""
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]
import torch  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp/out"))
WORK = Path("/tmp/offplan-bench/front-door-qwen3-30b-a3b")
NEW = 64


def setup() -> dict:
    from harness.checkpoints import make_checkpoint
    from harness.plans import make_plan
    from front_door import policy
    from planner.inputs.hardware import H100, dumps_hardware
    from planner.inputs.checkpoint import open_checkpoint
    WORK.mkdir(parents=True, exist_ok=True)
    ckpt = make_checkpoint("qwen3-30b-a3b", 8, WORK / "ckpt", "cuda")
    (WORK / "hw.yaml").write_text(dumps_hardware(H100))
    total = open_checkpoint(ckpt).total_bytes
    return {s: make_plan(WORK, s, policy(s, 8, total)) for s in ("gpu", "experts-uva")}


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def rates(model, handle, ids) -> dict:
    from transformers import DynamicCache, StaticCache

    def hf(n, **kw):
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, **kw)

    def per_step(run_n, **kw):
        run_n(2, **kw)
        return NEW / (timed(lambda: run_n(NEW + 1, **kw)) - timed(lambda: run_n(1, **kw)))

    def forward_loop(n, static):
        cache = StaticCache(config=model.config, max_cache_len=256) if static else DynamicCache(config=model.config)
        with torch.no_grad():
            pos = torch.arange(ids.shape[1], device="cuda")
            tok = model(ids, past_key_values=cache, cache_position=pos).logits[:, -1].argmax(-1, keepdim=True)
            for i in range(n - 1):
                pos = torch.tensor([ids.shape[1] + i], device="cuda")
                tok = model(tok, past_key_values=cache, cache_position=pos).logits[:, -1].argmax(-1, keepdim=True)

    out = {"hf": per_step(hf), "hf_static": per_step(hf, cache_implementation="static", disable_compile=True),
           "forward_dynamic": per_step(lambda n: forward_loop(n, False)),
           "forward_static": per_step(lambda n: forward_loop(n, True))}
    handle.generate(ids, NEW + 1, eager=True)
    out["eager"] = handle.generate(ids, NEW + 1, eager=True).decode_tokens_per_s
    return out


def profiled(name: str, fn) -> dict:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    ka = p.key_averages()
    (OUT / f"hf-probe-{name}.txt").write_text(ka.table(sort_by="cpu_time_total", row_limit=45) + "\n\n"
                                              + ka.table(sort_by="self_cuda_time_total", row_limit=30))
    return {e.key: e.count for e in ka if e.key.startswith(("cuda", "aten::item", "aten::_local_scalar"))}


def cudnn(plans: dict) -> None:
    from front_door import PROMPTS
    from runtime.hf import from_pretrained
    model, handle = from_pretrained(plans["gpu"], device="cuda", progress=False)
    base = list(PROMPTS[0].encode())
    got = {}

    def hf(ids, n):
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    hf(torch.tensor([base * 15], device="cuda"), 2)  # transformers' first call (key lengths 360-361: none below)
    for name, repeat, on in (("fresh_cudnn", 1, True), ("seen_cudnn", 1, True), ("fresh_no_cudnn", 5, False),
                             ("seen_no_cudnn", 5, False), ("fresh_cudnn_again", 10, True)):
        torch.backends.cuda.enable_cudnn_sdp(on)
        ids = torch.tensor([base * repeat], device="cuda")
        got[name] = NEW / (timed(lambda: hf(ids, NEW + 1)) - timed(lambda: hf(ids, 1)))
        got[name + "_tokens"] = ids.shape[1]
    torch.backends.cuda.enable_cudnn_sdp(True)
    ids = torch.tensor([base], device="cuda")
    handle.generate(ids, NEW + 1, eager=True)
    got["eager"] = handle.generate(ids, NEW + 1, eager=True).decode_tokens_per_s
    print(json.dumps(got), flush=True)
    with (OUT / "hf-probe-cudnn.jsonl").open("a") as f:
        f.write(json.dumps({"device": torch.cuda.get_device_name(), **got}) + "\n")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    plans = setup()
    if sys.argv[1:] == ["cudnn"]:
        return cudnn(plans)
    from front_door import PROMPTS
    from runtime.hf import from_pretrained
    ids = torch.tensor([list(PROMPTS[0].encode())], device="cuda")
    for strategy, plan in plans.items():
        model, handle = from_pretrained(plan, device="cuda", progress=False)
        got = {"strategy": strategy, **rates(model, handle, ids)}
        print(json.dumps(got), flush=True)
        with torch.no_grad():
            calls = profiled(f"{strategy}-hf", lambda: model.generate(ids, max_new_tokens=9, min_new_tokens=9,
                                                                    do_sample=False, pad_token_id=0))
        eager = profiled(f"{strategy}-eager", lambda: handle.generate(ids, 9, eager=True))
        print(json.dumps({"strategy": strategy, "calls_hf_9": calls, "calls_eager_9": eager}), flush=True)
        with (OUT / "hf-probe.jsonl").open("a") as f:
            f.write(json.dumps({**got, "calls_hf_9": calls, "calls_eager_9": eager}) + "\n")
        handle.remove()
        del model, handle
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
