"""How fast the host reads experts from DRAM, not from its cache: the compiled kernel against plain reads.

    python docs/host-experts/kernel_dram.py [--threads 15] [--out FILE]

Qwen3-30B-A3B's expert shape (H 2048, I 768: 9.4 MB an expert in bf16), 96 experts (0.9 GB), so that each call's
experts are not in the host's cache: each call takes the next ones in turn ("cold"). Rows (GB/s of weights read):
- `sum`: torch's sum over a 2 GB bf16 tensor, the host's plain read rate;
- `kernel P=...`: runtime/execute/host/kernel.py's compiled kernel over P pairs (P/8 tokens, every pair its
  own expert), cold (also on a thread of its own, as the engine's worker), and "warm" (the same 8 experts every
  call: what a loop over one layer's experts measures);
- `bmm 8`: torch.bmm over 8 experts lying side by side (a slice: no copy), cold;
- `linear 8`: torch's F.linear per expert, 8 experts, cold.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
from runtime.execute.host.kernel import Kernel  # noqa: E402

H, I, E = 2048, 768, 96
EXPERT_BYTES = 3 * H * I * 2


def timed(fn, reps: int = 16) -> float:
    ts = []
    for r in range(reps):
        start = time.perf_counter()
        fn(r)
        ts.append(time.perf_counter() - start)
    ts = sorted(ts[3:])
    return ts[len(ts) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=15)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    gu = torch.randn(E, 2 * I, H, dtype=torch.bfloat16)
    dn = torch.randn(E, H, I, dtype=torch.bfloat16)
    x = torch.randn(8, H, dtype=torch.bfloat16)
    big = torch.randn(1 << 30, dtype=torch.bfloat16)
    rows = []

    def row(name, seconds, nbytes):
        rows.append({"row": name, "ms": seconds * 1e3, "gbps": nbytes / seconds / 1e9, "threads": args.threads})
        print(json.dumps(rows[-1]), flush=True)

    with torch.no_grad():
        row("sum 2 GB", timed(lambda r: big.sum(), 6), big.numel() * 2)
        kernel = Kernel(args.threads)
        kernel.start([(gu, dn, 8)])
        kernel.ready()
        assert kernel.compiled, kernel.why_eager
        for pairs in (8, 16, 32, 64):
            tokens = torch.arange(pairs) // 8

            def cold(r, pairs=pairs, tokens=tokens):
                experts = (torch.arange(pairs) + pairs * r) % E  # every pair its own expert, new ones each call
                kernel.gated(x[:max(2, pairs // 8)], tokens, gu, dn, experts)
            row(f"kernel P={pairs} cold", timed(cold), pairs * EXPERT_BYTES)
            if pairs == 8:  # on another thread of ours, as the engine's worker runs it
                took = []
                worker = threading.Thread(target=lambda: (kernel.own(), took.append(timed(cold))))
                worker.start()
                worker.join()
                row("kernel P=8 cold, on a worker thread", took[0], pairs * EXPERT_BYTES)
        warm = torch.arange(8)
        row("kernel P=8 warm", timed(lambda r: kernel.gated(x[:2], torch.zeros(8, dtype=torch.long), gu, dn, warm)),
            8 * EXPERT_BYTES)
        assert kernel.misses == 0, kernel.last_miss

        def bmm(r):
            e = (8 * r) % E
            up = torch.bmm(gu[e:e + 8], x[:1].expand(8, H).unsqueeze(-1))  # [8, 2I, 1]
            gate, u = up.squeeze(-1).chunk(2, dim=-1)
            torch.bmm(dn[e:e + 8], (F.silu(gate) * u).unsqueeze(-1))
        row("bmm 8 cold", timed(bmm), 8 * EXPERT_BYTES)

        def linear(r):
            for j in range(8):
                e = (8 * r + j) % E
                gate, u = F.linear(x[:1], gu[e]).chunk(2, dim=-1)
                F.linear(F.silu(gate) * u, dn[e])
        row("linear 8 cold", timed(linear), 8 * EXPERT_BYTES)
    if args.out:
        with open(args.out, "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
