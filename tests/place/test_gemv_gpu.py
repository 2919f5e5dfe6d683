"""The fused FP8 and MXFP4 GEMVs (runtime/place/gemv.py) on CUDA (marked `gpu`): the products of the dequantized
weight, summed in f32 in another order, rounded once, and read in place from pinned memory as from HBM.

Tolerance: the reference is the same dequantized weight (dequant.py's rounding) times the same activations,
summed in float64. The kernel sums in f32 and rounds once to bf16, so each output is within one bf16 unit in the
last place of the reference (half a unit from the rounding, and f32 sums of a few thousand products are far
tighter than the other half); nearly all outputs are the reference's bf16 rounding exactly.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from quantized_models import fp8_quantize  # noqa: E402
from runtime.place import gemv  # noqa: E402
from runtime.place.arena import PinnedArena, typed  # noqa: E402
from runtime.place.dequant import dequant_fp8, dequant_mxfp4  # noqa: E402

pytestmark = pytest.mark.gpu


def _close(got: torch.Tensor, exact: torch.Tensor) -> None:
    """Within one bf16 unit in the last place of the float64 reference, and mostly equal to its rounding."""
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs().clamp(min=exact.abs().max() * 2**-12)
    assert ((got.double() - exact).abs() <= ulp).all()
    assert (got == exact.to(torch.bfloat16)).double().mean() > 0.98


@pytest.mark.parametrize("rows,n,k", [(1, 4096, 2048), (5, 300, 200), (16, 512, 384), (3, 1536, 2048)])
def test_fp8_linear_equals_the_dequantized_product(rows, n, k):
    torch.manual_seed(rows)
    q, scale = fp8_quantize(torch.randn(n, k, device="cuda") * 0.05)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    assert gemv.applies(x, q, (128, 128), rows)
    w = dequant_fp8(q, scale, 128, 128, torch.bfloat16)  # dequant.py's rounding, bitwise
    _close(gemv.fp8_linear(x, q, scale, (128, 128)), x.double() @ w.double().T)


def test_fp8_pairs_reads_each_pairs_expert_in_place_from_pinned_memory():
    """Eight pairs, each times its own expert, read through the zero-copy view of pinned memory; and the same
    over rows gathered in pair order (ids None)."""
    torch.manual_seed(0)
    experts, n, k = 16, 256, 384
    qs = [fp8_quantize(torch.randn(n, k, device="cuda") * 0.05) for _ in range(experts)]
    q, scale = torch.stack([a for a, _ in qs]), torch.stack([b for _, b in qs])
    arena = PinnedArena(q.numel(), cuda=True)
    typed(arena.host_view(0, arena.nbytes), q.dtype, q.shape).copy_(q.cpu())
    pinned = typed(arena.device_view(0, arena.nbytes), q.dtype, q.shape)
    try:
        ids = torch.tensor([3, 0, 15, 7, 7, 9, 1, 12], device="cuda")
        x = torch.randn(8, k, device="cuda", dtype=torch.bfloat16)
        w = dequant_fp8(q, scale, 128, 128, torch.bfloat16).index_select(0, ids)  # [8, n, k]
        exact = torch.bmm(w.double(), x.double().unsqueeze(-1)).squeeze(-1)
        _close(gemv.fp8_pairs(x, pinned, scale, ids, (128, 128)), exact)
        _close(gemv.fp8_pairs(x, q.index_select(0, ids), scale.index_select(0, ids), None, (128, 128)), exact)
    finally:
        del pinned
        arena.release()


def test_applies_only_where_the_kernel_fits():
    x = torch.randn(1, 256, device="cuda", dtype=torch.bfloat16)
    q = torch.zeros(64, 256, device="cuda", dtype=torch.float8_e4m3fn)
    assert gemv.applies(x, q, (128, 128), 16)
    assert not gemv.applies(x, q, (128, 128), 17)  # more rows: dequantize and the model's GEMM
    assert not gemv.applies(x, q, (128, 64), 1)  # blocks narrower than a step
    assert not gemv.applies(x, q, (96, 128), 1)  # not a power of two
    assert not gemv.applies(x.float(), q, (128, 128), 1)
    assert not gemv.applies(x.cpu(), q.cpu(), (128, 128), 1)


@pytest.mark.parametrize("n,groups", [(300, 5), (576, 90)])  # a ragged tail of rows and bytes; gpt-oss's 2880 wide
def test_mxfp4_pairs_equal_the_dequantized_product_in_place_and_gathered(n, groups):
    """Eight pairs of one token's kind (an expert twice), each times its own MXFP4 expert, read through the
    zero-copy view of pinned memory and from rows gathered in pair order, against dequant.py's values (bitwise
    the torch arithmetic's) times x in float64; a one-hot x reads single weights back exactly, subnormal ones
    (E8M0 scales 0 and 2) and large ones (250) too."""
    torch.manual_seed(n)
    experts = 12
    blocks = torch.randint(0, 256, (experts, n, groups, 16), dtype=torch.uint8, device="cuda")
    scales = torch.randint(118, 131, (experts, n, groups), dtype=torch.uint8, device="cuda")
    arena = PinnedArena(blocks.numel(), cuda=True)
    typed(arena.host_view(0, arena.nbytes), blocks.dtype, blocks.shape).copy_(blocks.cpu())
    pinned = typed(arena.device_view(0, arena.nbytes), blocks.dtype, blocks.shape)
    try:
        ids = torch.tensor([3, 0, 11, 7, 7, 9, 1, 5], device="cuda")
        x = torch.randn(8, 32 * groups, device="cuda", dtype=torch.bfloat16)
        assert gemv.mxfp4_applies(x, pinned, torch.bfloat16)
        w = dequant_mxfp4(blocks, scales, torch.bfloat16, False).index_select(0, ids)  # [8, n, 32 groups]
        exact = torch.bmm(w.double(), x.double().unsqueeze(-1)).squeeze(-1)
        _close(gemv.mxfp4_pairs(x, pinned, scales, ids), exact)
        _close(gemv.mxfp4_pairs(x, blocks.index_select(0, ids), scales.index_select(0, ids), None), exact)
        edge = scales.clone()
        edge[:, :3] = torch.tensor([0, 2, 250], dtype=torch.uint8, device="cuda")[:, None]  # subnormal, and large
        w = dequant_mxfp4(blocks, edge, torch.bfloat16, False).index_select(0, ids)
        one = torch.zeros(4, 32 * groups, device="cuda", dtype=torch.bfloat16)
        cols = torch.tensor([0, 1, 33, 32 * groups - 1], device="cuda")
        one[torch.arange(4), cols] = 1
        got = gemv.mxfp4_pairs(one, blocks, edge, ids[:4])
        assert torch.equal(got, w[torch.arange(4), :, cols])  # each value exact (-0 reads back as +0: equal)
    finally:
        del pinned
        arena.release()


def test_mxfp4_applies_only_to_bf16_on_cuda_as_stored():
    x = torch.randn(1, 64, device="cuda", dtype=torch.bfloat16)
    blocks = torch.zeros(4, 8, 2, 16, dtype=torch.uint8, device="cuda")
    assert gemv.mxfp4_applies(x, blocks, torch.bfloat16)
    assert not gemv.mxfp4_applies(x.half(), blocks, torch.float16)  # E2M1 x 2^s is exact in bf16 only
    assert not gemv.mxfp4_applies(x, blocks.transpose(1, 2), torch.bfloat16)
    assert not gemv.mxfp4_applies(x.cpu(), blocks.cpu(), torch.bfloat16)
