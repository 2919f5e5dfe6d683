"""Where pinned host memory starts, and how fast the GPU reads it in place: UVA GEMV and H2D copy GB/s.

    python docs/uva-align/uva_align.py --out benchmarks/results     # on the GPU machine

Kept as it ran: it decided where the runtime's arena starts (runtime/place/arena.py), and its record stays in
benchmarks/results/uva-align.jsonl and RESULTS.md.

The same bytes (eight bf16 [14336, 4096] weights, 0.94 GB: an LLM's MLP shape)
in host memory allocated several ways, read by bf16 GEMVs through a zero-copy
CUDA view at batch 1, 8 and 64, and copied to the GPU in one piece:

- `torch.empty` + `cudaHostRegister`: the arena before this measurement (the
  allocator gives a 64-byte-aligned base);
- the runtime's arena (`runtime.place.arena.PinnedArena`, an anonymous mmap) with its
  base 64, 256 and 2048 bytes past a page boundary (a tensor at a 256-byte
  offset inside a page-aligned arena reads like a base at +256), on a page
  boundary, and on a 2 MiB boundary with transparent huge pages requested;
- `pin_memory()` (`cudaHostAlloc`), the reference for pinned memory.

Every variant is measured in each of `--rounds` rounds, in turn, and the median
over rounds is reported, so that drift over the run (clocks, other tenants)
spreads over all of them. Each figure within a round is itself the median of 20
timed repeats (runtime.measure.calibrate). Records go to OUT/uva-align.jsonl; the table
is printed last.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from runtime.measure.bandwidth import gemv_gbps, mlp_weights, random_bytes, warm_up
from runtime.place.arena import HUGE_PAGE, PAGE, PinnedArena, _CudaArrayInterface

NBYTES = 8 * 14336 * 4096 * 2
BATCHES = (1, 8, 64)


class _Registered:
    """`torch.empty` + `cudaHostRegister`: how the arena allocated before."""

    def __init__(self, nbytes: int):
        self.host = torch.empty(nbytes, dtype=torch.uint8)
        assert int(torch.cuda.cudart().cudaHostRegister(self.host.data_ptr(), nbytes, 0)) == 0
        self.view = torch.as_tensor(_CudaArrayInterface(self.host.data_ptr(), nbytes, self), device="cuda")

    def release(self):
        self.view = None
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaHostUnregister(self.host.data_ptr())


class _Arena:
    def __init__(self, nbytes: int, **options):
        self.arena = PinnedArena(nbytes, cuda=True, **options)
        self.host, self.view = self.arena.host_view(0, nbytes), self.arena.device_view(0, nbytes)

    def release(self):
        self.view = None
        self.arena.release()


class _HostAlloc:
    def __init__(self, nbytes: int):
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.view = torch.as_tensor(_CudaArrayInterface(self.host.data_ptr(), nbytes, self), device="cuda")

    def release(self):
        self.view = None


VARIANTS = {
    "torch.empty + cudaHostRegister (the arena before)": lambda n: _Registered(n),
    "arena, base 64 B past a page": lambda n: _Arena(n, base_align=PAGE, base_offset=64),
    "arena, base 256 B past a page": lambda n: _Arena(n, base_align=PAGE, base_offset=256),
    "arena, base 2048 B past a page": lambda n: _Arena(n, base_align=PAGE, base_offset=2048),
    "arena, page-aligned base": lambda n: _Arena(n, base_align=PAGE),
    "arena, 2 MiB-aligned base + huge pages": lambda n: _Arena(n, base_align=HUGE_PAGE),
    "pin_memory() (cudaHostAlloc)": lambda n: _HostAlloc(n),
}


def measure(make) -> dict:
    mem = make(NBYTES)
    try:
        mem.host.copy_(random_bytes(NBYTES))
        out = {"base_mod_4096": mem.host.data_ptr() % 4096}
        weights = mlp_weights(mem.view)
        for b in BATCHES:
            out[f"gemv_b{b}"] = gemv_gbps(weights, b)
        del weights
        dst = torch.empty(NBYTES, dtype=torch.uint8, device="cuda")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for i in range(22):
            start.record()
            dst.copy_(mem.host, non_blocking=True)
            end.record()
            end.synchronize()
            if i >= 2:
                times.append(start.elapsed_time(end))
        out["h2d"] = NBYTES / statistics.median(times) / 1e6
        return out
    finally:
        mem.release()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "uva-align.jsonl"
    warm_up()
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    with log.open("w") as f:
        f.write(json.dumps({"kind": "device", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                            "bytes": NBYTES}) + "\n")
        for round_ in range(args.rounds):
            for name, make in VARIANTS.items():
                r = {"kind": "measure", "variant": name, "round": round_, **measure(make)}
                runs[name].append(r)
                f.write(json.dumps(r) + "\n")
                print(json.dumps(r), flush=True)
    keys = [f"gemv_b{b}" for b in BATCHES] + ["h2d"]
    print(f"\n{torch.cuda.get_device_name()}, {NBYTES / 1e9:.2f} GB, median of {args.rounds} rounds (GB/s)\n")
    print("| host memory behind the view | base mod 4096 | " + " | ".join(
        [f"UVA GEMV b={b}" for b in BATCHES] + ["H2D copy"]) + " |")
    print("|---|---|" + "---|" * len(keys))
    for name, rs in runs.items():
        bases = sorted({r["base_mod_4096"] for r in rs})
        print(f"| {name} | {', '.join(map(str, bases))} | " +
              " | ".join(f"{statistics.median(r[k] for r in rs):.1f}" for k in keys) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
