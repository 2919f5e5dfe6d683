"""How the host's memory bandwidth is shared between the GPU's reads over UVA and the host kernel's (native.cpp).

A split layer (experts on cpu beside experts on uva) reads host memory from both sides at once. The cost model takes
the host kernel's rate beside UVA reads from `plan calibrate` (cpu_expert_gbps), but the UVA rate beside the cores
from a constant ratio (hardware.py: uva_read_gbps x 47.0/50.3, the H100 machine's sum loop at 67 GB/s beside it).
This probe measures both sides together, for each host thread count:

- UVA alone: a replayed graph of GEMVs over 0.9 GiB of pinned memory (as calibrate's `_uva_reads`), its bytes over
  its time, for `SECONDS`;
- the host alone: native.cpp's calls of one token with all 8 of its experts on cpu, each call's 8 experts the next
  in a shuffled ring of 128 (cold, as runtime/measure/host.py's points), on a loop thread, bytes over time;
- both at once: the loop thread computing while this thread replays the GEMVs; each side's rate, and their sum.

    PYTHONPATH=.:$PYTHONPATH python docs/host-experts/share_probe.py OUT.json [THREADS...]   # on a GPU machine
"""
from __future__ import annotations

import json
import sys
import threading
import time

import torch

from runtime.execute.host import native
from runtime.measure.bandwidth import mlp_weights, random_bytes, warm_up
from runtime.measure.host import EXPERTS, HIDDEN, INTER, TOP_K
from runtime.place.arena import PinnedArena

SECONDS = 2.0


class HostLoop:
    """While open, a thread calls native.cpp over `threads` threads, one token of 8 cold experts a call."""

    def __init__(self, lib, threads: int):
        self.lib, self.pool = lib, native.Pool(lib, threads)
        self.gate_up = torch.full((EXPERTS, 2 * INTER, HIDDEN), 0.01, dtype=torch.bfloat16)
        self.down = torch.full((EXPERTS, HIDDEN, INTER), 0.01, dtype=torch.bfloat16)
        self.expert = self.gate_up[0].nbytes + self.down[0].nbytes
        self.on_cpu = torch.ones(EXPERTS, dtype=torch.uint8)
        self.x = torch.full((1, HIDDEN), 0.5, dtype=torch.bfloat16)
        self.y = torch.empty((TOP_K, HIDDEN), dtype=torch.bfloat16)
        self.ids = torch.empty(TOP_K, dtype=torch.long)
        self.order = torch.randperm(EXPERTS, generator=torch.Generator().manual_seed(0))
        self.job = native.job(self.pool, self.gate_up, self.down, self.on_cpu, self.x, self.ids, self.y, 1, TOP_K)

    def __enter__(self):
        self.stop, self.calls = threading.Event(), 0
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()
        time.sleep(0.05)
        self.start = time.perf_counter()
        self.calls0 = self.calls
        return self

    def _loop(self):
        while not self.stop.is_set():
            first = self.calls * TOP_K
            self.ids.copy_(self.order[(torch.arange(TOP_K) + first) % EXPERTS])
            native.run(self.lib, self.job)  # ctypes releases the GIL
            self.calls += 1

    def gbps(self) -> float:
        return (self.calls - self.calls0) * TOP_K * self.expert / (time.perf_counter() - self.start) / 1e9

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    def close(self):
        self.pool.close()


class UvaReads:
    """A captured graph of GEMVs over 0.9 GiB of pinned memory (calibrate's `_uva_reads`), replayed for a time."""

    def __init__(self):
        self.nbytes = 8 * 14336 * 4096 * 2
        self.arena = PinnedArena(self.nbytes, cuda=True)
        self.arena.host_view(0, self.nbytes).copy_(random_bytes(self.nbytes))
        weights = mlp_weights(self.arena.device_view(0, self.nbytes))
        v = torch.randn(1, weights[0].shape[1], dtype=torch.bfloat16, device="cuda")
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for w in weights:
                torch.nn.functional.linear(v, w)
        stream.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=stream):
            for w in weights:
                torch.nn.functional.linear(v, w)

    def gbps(self, seconds: float = SECONDS) -> float:
        done, replays = torch.cuda.Event(), 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            self.graph.replay()
            done.record()
            done.synchronize()
            replays += 1
        return replays * self.nbytes / (time.perf_counter() - start) / 1e9


def main(argv: list[str]) -> int:
    lib = native.library()
    if lib is None or not torch.cuda.is_available():
        raise SystemExit(f"share_probe.py needs CUDA and the host kernel ({native.why_not})")
    warm_up()
    uva = UvaReads()
    got = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "uva_alone_gbps": uva.gbps(),
           "threads": {}}
    for threads in [int(a) for a in argv[1:]] or [4, 8, 12, 15]:
        host = HostLoop(lib, threads)
        try:
            with host:
                time.sleep(SECONDS)
                alone = host.gbps()
            with host:
                beside = uva.gbps()
                cpu = host.gbps()
        finally:
            host.close()
        got["threads"][threads] = r = dict(cpu_alone_gbps=alone, cpu_beside_gbps=cpu, uva_beside_gbps=beside,
                                           sum_gbps=cpu + beside)
        print(threads, " ".join(f"{k} {v:.1f}" for k, v in r.items()), flush=True)
    got["uva_alone_after_gbps"] = uva.gbps()
    print(f"uva alone {got['uva_alone_gbps']:.1f} GB/s, after {got['uva_alone_after_gbps']:.1f}")
    with open(argv[0], "w") as f:
        json.dump(got, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
