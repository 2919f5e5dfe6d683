"""FP8 experts gathered and dequantized in one launch (runtime/place/fp8_gather.py) against the launches before it,
in one process, interleaved (`cd benchmarks; OUT=... python ../docs/front-door/fp8_gather_probe.py [PLAN ...]`, after
`front_door_probe.py setup`; PLAN: experts-uva-fp8, the default, or gpu-fp8, every weight FP8 in HBM, where the
experts were gathered by `index_select` of every slot, padding included): decode steps/s of `handle.generate`'s
loop, replayed and eager, at batch 4 and 8 (at batch 1 the FP8 products read the experts in place: neither path
runs), the median of three calls each, and whether the two paths give the same tokens."""
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402

import front_door_probe as fdp  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp/out"))
NEW = 65  # the prefill's token and 64 decode steps, as front_door.py times them


def main(name: str) -> None:
    from front_door import policy
    from harness.plans import make_plan
    from planner.inputs.checkpoint import open_checkpoint
    from runtime.execute import experts
    from runtime.execute.generation import Generator
    from runtime.hf import from_pretrained
    plan = make_plan(fdp.WORK, name, policy(name, 8, open_checkpoint(fdp.WORK / "ckpt").total_bytes))
    model, handle = from_pretrained(str(plan), device="cuda", progress=False)
    one_launch = experts._one_launch
    tokens = {}
    with (OUT / f"fp8-gather-probe-{name}.jsonl").open("w") as log:
        for rnd in range(2):
            for fused in (True, False) if rnd == 0 else (False, True):
                experts._one_launch = one_launch if fused else (lambda module, q: None)
                for batch in (8, 4):
                    for eager in (False, True):
                        gen = Generator(model, handle, eager=eager)
                        x = fdp.ids(batch)
                        gen.prepare(x, NEW)
                        calls = [gen(x, NEW) for _ in range(3)]
                        gen.release()
                        tokens.setdefault((batch, eager), {})[fused] = calls[0].tokens
                        row = {"plan": name, "round": rnd, "one_launch": fused, "batch": batch, "mode": "eager" if eager else "graph",
                               "steps_per_s": statistics.median(c.decode_tokens_per_s for c in calls),
                               "calls": [round(c.decode_tokens_per_s, 2) for c in calls]}
                        log.write(json.dumps(row) + "\n")
                        print(json.dumps(row), flush=True)
        experts._one_launch = one_launch
        for (batch, eager), by in tokens.items():
            row = {"plan": name, "same_tokens": by[True] == by[False], "batch": batch, "mode": "eager" if eager else "graph"}
            log.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    handle.remove(restore=False)
    torch.cuda.synchronize()


if __name__ == "__main__":
    for name in sys.argv[1:] or ["experts-uva-fp8"]:
        main(name)
