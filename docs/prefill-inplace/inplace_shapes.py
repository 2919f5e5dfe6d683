"""How many times does a GEMM reading a weight in place over UVA read it, by prompt length and weight shape?

The cost model prices an in-place read at prefill as ceil(T / stage_above_tokens) passes over the weight
(planner/decide/cost.py), 1 up to the threshold. Llama-3.1-8B's uva plan at 128 tokens (below the threshold of 192)
measured 1.22x its prediction on an H100 and 1.25x on an H200 (benchmarks/results/prefill-llama-8b*.jsonl), and the
threshold is calibrated on one shape only (runtime/measure/bandwidth.py `stage_crossover`: [14336, 4096]). This
probe times each of Llama-3.1-8B's weight shapes, for T tokens, read in place (`F.linear` over the pinned arena's
zero-copy view) against copied first and then multiplied, as stage_crossover does; passes = the in-place time over
one GEMV's (T = 1) time, which reads each byte once.

    PYTHONPATH=.:$PYTHONPATH python docs/prefill-inplace/inplace_shapes.py OUT.json   # on a GPU machine
"""
from __future__ import annotations

import json
import sys

import torch

from runtime.measure.bandwidth import median_ms, random_bytes, warm_up
from runtime.place.arena import PinnedArena, typed

SHAPES = {"gate_up [14336, 4096]": (14336, 4096), "down [4096, 14336]": (4096, 14336),
          "q_o [4096, 4096]": (4096, 4096), "k_v [1024, 4096]": (1024, 4096)}
NBYTES = 2 ** 29  # of each shape's weights: about 0.5 GB, a layer's worth and more
TOKENS = (1, 32, 64, 96, 128, 160, 192, 256, 512)


def probe(rows: int, cols: int) -> dict:
    one = rows * cols * 2
    count = NBYTES // one
    arena = PinnedArena(count * one, cuda=True)
    arena.host_view(0, count * one).copy_(random_bytes(count * one))
    try:
        flat_d, flat_h = arena.device_view(0, count * one), arena.host_view(0, count * one)
        pinned = [typed(flat_d[i * one:(i + 1) * one], torch.bfloat16, (rows, cols)) for i in range(count)]
        hosts = [typed(flat_h[i * one:(i + 1) * one], torch.bfloat16, (rows, cols)) for i in range(count)]
        buffer = torch.empty(rows, cols, dtype=torch.bfloat16, device="cuda")
        out = {}
        for t in TOKENS:
            x = torch.randn(t, cols, dtype=torch.bfloat16, device="cuda")

            def copied():
                for w in hosts:
                    buffer.copy_(w, non_blocking=True)
                    torch.nn.functional.linear(x, buffer)
            in_place = median_ms(lambda: [torch.nn.functional.linear(x, w) for w in pinned], repeat=7)
            out[t] = dict(in_place_ms=in_place, copied_ms=median_ms(copied, repeat=7))
        once = out[1]["in_place_ms"]
        for t, r in out.items():
            r["passes"] = r["in_place_ms"] / once
            r["in_place_over_copied"] = r["in_place_ms"] / r["copied_ms"]
        return dict(rows=rows, cols=cols, count=count, gemv_gbps=count * one / once / 1e6, tokens=out)
    finally:
        arena.release()


def main(argv: list[str]) -> int:
    warm_up()
    got = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "shapes": {name: probe(*shape) for name, shape in SHAPES.items()}}
    for name, r in got["shapes"].items():
        print(name, f"GEMV {r['gemv_gbps']:.1f} GB/s;", "  ".join(
            f"T={t}: {v['passes']:.2f} passes, {v['in_place_over_copied']:.2f}x copied"
            for t, v in r["tokens"].items()), flush=True)
    with open(argv[0], "w") as f:
        json.dump(got, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
