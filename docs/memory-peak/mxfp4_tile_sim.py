"""The tiled MXFP4 kernel's index arithmetic (runtime/place/dequant.py `_mxfp4_kernel`, `_e2m1_bits`) simulated in torch
on the CPU, tile by tile, against the torch arithmetic (`dequant._mxfp4`), both layouts and partial tiles:
`python docs/memory-peak/mxfp4_tile_sim.py` prints ok. A check of the arithmetic only: not of Triton or a GPU."""
import sys; from pathlib import Path; sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch
from runtime.place import dequant

def bits(code, s):  # _e2m1_bits in torch int32
    e, m = (code >> 1) & 3, code & 1
    frac = torch.where(e == 0, 0, m)
    biased = s + torch.where(e == 0, -1, e - 1)
    normal = (biased << 7) | (frac << 6)
    subnormal = (2 + frac) << torch.clamp(biased + 5, min=0)
    b = torch.where(biased >= 255, 0x7F80, torch.where(biased <= 0, subnormal, normal))
    b = torch.where((e == 0) & (m == 0), 0, b) | ((code & 8) << 12)
    return torch.where(s == 255, 0x7FC0, b)

def kernel_sim(blocks, scales, transposed, BR=64, BB=64):
    *lead, rows, groups, _ = blocks.shape
    cols, per_row = 32 * groups, 16 * groups
    M = blocks.numel() // (rows * per_row)
    out = torch.full((M * rows * cols,), 12345, dtype=torch.int64)
    sm, (sr, sc) = rows * cols, ((1, rows) if transposed else (cols, 1))
    fb, fs = blocks.reshape(-1).to(torch.int64), scales.reshape(-1).to(torch.int64)
    for m in range(M):
        for pr in range(-(-rows // BR)):
            for pb in range(-(-per_row // BB)):
                r = pr * BR + torch.arange(BR); j = pb * BB + torch.arange(BB)
                mask = (r[:, None] < rows) & (j[None, :] < per_row)
                byte = (m * rows + r[:, None]) * per_row + j[None, :]
                b = torch.where(mask, fb[byte.clamp(max=fb.numel() - 1)], 0)
                s = torch.where(mask, fs[(byte // 16).clamp(max=fs.numel() - 1)], 127)
                at = m * sm + r[:, None] * sr + (2 * j[None, :]) * sc
                out[at[mask]] = bits(b & 15, s)[mask]
                out[(at + sc)[mask]] = bits(b >> 4, s)[mask]
    assert not (out == 12345).any()
    out = (out & 0xFFFF)
    out = torch.where(out >= 32768, out - 65536, out).to(torch.int16)
    return out.view(*lead, *((cols, rows) if transposed else (rows, cols)))

torch.manual_seed(0)
for shape in ((2, 70, 3, 16), (1, 130, 5, 16), (3, 64, 4, 16)):
    blocks = torch.randint(0, 256, shape, dtype=torch.uint8)
    scales = torch.randint(0, 255, shape[:-1], dtype=torch.uint8)
    for tr in (False, True):
        want = dequant._mxfp4(blocks, scales, torch.bfloat16)
        want = want.transpose(-2, -1).contiguous() if tr else want
        got = kernel_sim(blocks, scales, tr)
        assert torch.equal(got, want.view(torch.int16)), (shape, tr)
print("ok")
