"""MXFP4 experts at one token on the GPU: dequantized then multiplied (dequant.py's tiled kernel into gpt-oss's
transposed layout, then the bmm experts.py runs) against gemv.py's fused kernel, which reads the stored bytes once,
at gpt-oss-120b's shape (4 touched experts of gate_up_proj [2880 x 2 rows, 90 groups of 32] and down_proj [2880, 90
groups]), the experts gathered in HBM as a decode step stages them. Per call: time (CUDA events around 20 calls,
median of 15), the stored bytes read per second, and the largest error against float64 in units of bf16's last
place; the fused kernel under several tiles (rows BN, bytes a step BB, warps).

    python3 docs/memory-peak/mxfp4_gemv_probe.py OUT_DIR    # on a GPU machine; writes OUT_DIR/mxfp4-gemv-probe.json
"""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from runtime.place import dequant, gemv  # noqa: E402

TILES = [(8, 128, 4), (16, 128, 4), (16, 256, 4), (16, 256, 8), (32, 128, 4), (32, 256, 8), (8, 512, 4),
         (16, 512, 8), (64, 128, 8)]


def timed(run) -> float:
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(15):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / 20)
    return sorted(times)[len(times) // 2]


def ulps(got: torch.Tensor, exact: torch.Tensor) -> float:
    unit = torch.finfo(torch.bfloat16).eps * exact.abs().clamp(min=exact.abs().max() * 2**-12)
    return float(((got.double() - exact).abs() / unit).max())


def fused(x, blocks, scales, bn, bb, warps):
    n, g = blocks.shape[1:3]
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    grid = (gemv.triton.cdiv(n, bn), x.shape[0])

    def run():
        gemv._mxfp4_kernel[grid](x, blocks, scales, x, out, n, 16 * g, blocks.stride(0), scales.stride(0), BN=bn,
                                 BB=bb, IDS=False, num_warps=warps)
        return out
    return run


def main():
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/out")
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    rows = []
    for name, n in (("gate_up_proj", 5760), ("down_proj", 2880)):
        blocks = torch.randint(0, 256, (4, n, 90, 16), dtype=torch.uint8, device="cuda")
        scales = torch.randint(119, 122, (4, n, 90), dtype=torch.uint8, device="cuda")
        x = torch.randn(4, 2880, dtype=torch.bfloat16, device="cuda")
        stored = blocks.numel() + scales.numel()
        w = dequant._dequant_mxfp4(blocks, scales, torch.bfloat16, True)  # [4, 2880 in, n out], as gpt-oss holds
        exact = torch.bmm(x.double().unsqueeze(1), w.double()).squeeze(1)

        def two_steps():
            return torch.bmm(x.unsqueeze(1), dequant._dequant_mxfp4(blocks, scales, torch.bfloat16, True)).squeeze(1)
        us = timed(two_steps)
        rows.append({"param": name, "path": "dequantize, bmm", "us": us, "stored_gbps": stored / us / 1e3,
                     "max_ulps": ulps(two_steps(), exact)})
        print(json.dumps(rows[-1]), flush=True)
        for bn, bb, warps in TILES:
            run = fused(x, blocks, scales, bn, bb, warps)
            us = timed(run)
            rows.append({"param": name, "path": "fused", "bn": bn, "bb": bb, "warps": warps, "us": us,
                         "stored_gbps": stored / us / 1e3, "max_ulps": ulps(run(), exact)})
            print(json.dumps(rows[-1]), flush=True)
        got = gemv.mxfp4_pairs(x, blocks, scales, None)
        rows.append({"param": name, "path": "mxfp4_pairs (the tree's tile)", "us": timed(
            lambda: gemv.mxfp4_pairs(x, blocks, scales, None)), "max_ulps": ulps(got, exact)})
        print(json.dumps(rows[-1]), flush=True)
    (out_dir / "mxfp4-gemv-probe.json").write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                               "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
