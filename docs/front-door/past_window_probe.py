"""gpt-oss decoding past its sliding window (128) through the front door, replayed and eager, in one process.

    python3 docs/front-door/past_window_probe.py OUT_DIR [LAYERS]   # on a GPU; OUT_DIR/past-window.jsonl

Until branch sliding-replay, a replayed cache longer than a window was refused, so `plan apply` of gpt-oss
generated at most 128 tokens of prompt and output from a CUDA graph and ran longer calls eagerly. This probe times
what a user calls: `handle.generate(prompt, NEW)` with a prompt of 16 tokens, graph (the default) and `eager=True`,
for NEW = 100 (a cache of 128: within the window) and 300 (a cache of 384: 187 of the 299 decode steps past it),
on gpt-oss-120b's shapes with LAYERS decoder layers (4 unless given; the checkpoint is gpt_oss_decode.py's: MXFP4
experts as gpt-oss ships them, random values). Two plans: every routed expert on uva, and all on the GPU. Each row
is the median of three calls after one that captures (or warms up) the step, with whether its tokens equal the
eager ones; `cache` in a row is the prompt and new tokens (the runtime's cache rounds it up to a multiple of 128).
"""
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from harness.plans import make_plan  # noqa: E402

OUT = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/out")
LAYERS = int(sys.argv[2]) if len(sys.argv) > 2 else 4
PROMPT, CALLS = 16, 3
WORK = Path("/tmp/offplan-bench/gpt-oss")


def emit(**row):
    print(json.dumps(row), flush=True)
    with open(OUT / "past-window.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def checkpoint_writer():
    """gpt_oss_decode.py's `write_checkpoint`, its LAYERS set from this probe's arguments (it reads sys.argv)."""
    sys.argv = [sys.argv[0], str(OUT), str(LAYERS)]
    spec = importlib.util.spec_from_file_location("gpt_oss_decode", ROOT / "docs/memory-peak/gpt_oss_decode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.write_checkpoint


def timed(handle, ids, new, eager):
    handle.generate(ids, new, eager=eager)  # the capture, or a warm-up
    runs = [handle.generate(ids, new, eager=eager) for _ in range(CALLS)]
    return statistics.median(r.decode_tokens_per_s for r in runs), runs[0]


def main():
    from runtime.hf import from_pretrained
    OUT.mkdir(parents=True, exist_ok=True)
    ckpt = WORK / f"ckpt-{LAYERS}"
    t = time.perf_counter()
    if not checkpoint_writer()(ckpt):
        raise SystemExit(f"{ckpt} holds another depth: remove it")
    emit(kind="checkpoint", layers=LAYERS, seconds=round(time.perf_counter() - t, 1),
         device=torch.cuda.get_device_name(), torch=torch.__version__)
    ids = [list(torch.randint(0, 201088, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist())]
    for plan_name, body in (("experts-uva", "rules:\n  - match: [experts]\n    place: uva\n"), ("gpu", "")):
        plan = make_plan(WORK, f"{plan_name}-{LAYERS}", f"format_version: 1\ncheckpoint: {ckpt.name}\n{body}")
        model, handle = from_pretrained(plan, device="cuda", progress=False)
        for new in (100, 300):
            eager_rate, eager = timed(handle, ids, new, True)
            graph_rate, graph = timed(handle, ids, new, False)
            emit(kind="decode", plan=plan_name, prompt=PROMPT, new_tokens=new, cache=PROMPT + new,
                 window=model.config.sliding_window, graph_mode=graph.mode, graph_steps_per_s=graph_rate,
                 eager_steps_per_s=eager_rate, graph_x_eager=graph_rate / eager_rate,
                 same_tokens=graph.tokens == eager.tokens)
        handle.remove(restore=False)
        del model, handle
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
