"""What native.cpp reads from host memory: a decode step's calls over experts of Qwen3-30B-A3B's shape, each call
taking experts not read by the calls before it (cold: 128 experts, 1.2 GB, against the host's L3), at a few thread
counts and token counts. Prints and writes JSONL rows: GB/s of expert bytes read, and microseconds per call.

    python docs/host-experts/native_dram.py --out native-dram.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from runtime.execute.host import native  # noqa: E402

E, I, H, K = 128, 768, 2048, 8  # Qwen3-30B-A3B: experts, intermediate, hidden, top-k


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[4, 8, 15])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    lib = native.library()
    assert lib is not None, native.why_not
    gate_up = torch.randn(E, 2 * I, H).to(torch.bfloat16)
    down = torch.randn(E, H, I).to(torch.bfloat16)
    on_cpu = torch.ones(E, dtype=torch.uint8)
    rows = []
    for threads in args.threads:
        pool = native.Pool(lib, threads)
        for tokens in args.tokens:
            x = torch.randn(tokens, H).to(torch.bfloat16)
            y = torch.empty(tokens * K, H, dtype=torch.bfloat16)
            ids = torch.empty(tokens * K, dtype=torch.long)
            job = native.job(pool, gate_up, down, on_cpu, x, ids, y, tokens, K)
            order = torch.randperm(E)
            took, read = 0.0, 0
            for c in range(args.calls):
                for t in range(tokens):  # call c's tokens: experts after the last call's, in a shuffled ring
                    ids[t * K:(t + 1) * K] = order[(torch.arange(K) + (c * tokens + t) * K) % E]
                touched = ids.unique().numel()
                start = time.perf_counter()
                native.run(lib, job)
                took += time.perf_counter() - start
                read += touched * 3 * I * H * 2
            row = dict(threads=threads, tokens=tokens, isa=pool.isa(), us_per_call=1e6 * took / args.calls,
                       gbps=read / took / 1e9, cores=len(os.sched_getaffinity(0)))
            print(json.dumps(row), flush=True)
            rows.append(row)
        pool.close()
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
