"""MXFP4 dequantization on the GPU: the torch arithmetic (`dequant._mxfp4`, what CUDA ran before
`offplan::dequant_mxfp4`) against the kernel, on a decode step's staged experts at gpt-oss-120b's shape (4 touched
experts of gate_up_proj [2880 x 2, 90 groups of 32] and down_proj [2880, 90 groups]), transposed as transformers holds
gpt-oss's experts: peak GPU memory above the inputs (torch.cuda.max_memory_allocated) per stored byte, and time per
call (CUDA events, median of 50), the kernel's output bytes per second, and whether the outputs are bitwise equal;
both as transformers holds gpt-oss's experts (transposed) and as stored.

    python3 docs/memory-peak/mxfp4_probe.py OUT_DIR    # on a GPU machine; writes OUT_DIR/mxfp4-probe.json
"""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from runtime.place import dequant  # noqa: E402


def torch_path(transposed):
    def run(blocks, scales):
        out = dequant._mxfp4(blocks, scales, torch.bfloat16)
        return out.transpose(-2, -1).contiguous() if transposed else out
    return run


def kernel_path(transposed):
    return lambda blocks, scales: dequant._dequant_mxfp4(blocks, scales, torch.bfloat16, transposed)


def measure(run, blocks, scales):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = run(blocks, scales)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    times = []
    for _ in range(50):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run(blocks, scales)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return out, {"peak_bytes": peak, "peak_per_stored_byte": peak / blocks.numel(),
                 "output_per_stored_byte": out.nbytes / blocks.numel(), "us": sorted(times)[25]}


def main():
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/out")
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    rows = {}
    for name, shape in (("gate_up_proj", (4, 5760, 90, 16)), ("down_proj", (4, 2880, 90, 16))):
        blocks = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda")
        scales = torch.randint(118, 128, shape[:-1], dtype=torch.uint8, device="cuda")
        for transposed in (True, False):
            want, slow = measure(torch_path(transposed), blocks, scales)
            got, fast = measure(kernel_path(transposed), blocks, scales)
            key = name if transposed else f"{name} (not transposed)"
            rows[key] = {"stored_bytes": blocks.numel(), "torch": slow, "kernel": fast,
                         "written_gbps": got.nbytes / fast["us"] / 1e3,
                         "bitwise": torch.equal(got.view(torch.int16), want.view(torch.int16))}
            print(key, json.dumps(rows[key]), flush=True)
    (out_dir / "mxfp4-probe.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), **rows}, indent=1))


if __name__ == "__main__":
    main()
