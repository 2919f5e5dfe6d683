"""native.cpp, the host's kernel for gated experts, against the eager loop's arithmetic (kernel.py `gated_eager`),
on every instruction set this CPU has: only the pairs whose expert is on cpu are written, each within a unit or so
of the loop's (the sums run in another order), and a pair routed to no expert is an error. FP8 experts give the
bf16 kernel's outputs on the same experts dequantized (dequant.py), bitwise."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from runtime.execute.host import kernel, native  # noqa: E402
from runtime.place.dequant import dequant_fp8  # noqa: E402


@pytest.fixture(scope="module")
def lib():
    lib = native.library()
    assert lib is not None, native.why_not  # `pip install -e .` builds it
    return lib


def isas(lib) -> list[int]:
    pool = native.Pool(lib, 1)
    try:
        return list(range(native.ISAS.index(pool.isa()) + 1))
    finally:
        pool.close()


def experts(count: int, inter: int, hidden: int, seed: int = 0):
    torch.manual_seed(seed)
    gate_up = (torch.randn(count, 2 * inter, hidden) * 0.1).to(torch.bfloat16)
    down = (torch.randn(count, hidden, inter) * 0.1).to(torch.bfloat16)
    return gate_up, down


# (experts, intermediate, hidden, tokens, top_k): sizes off the vector widths, and 6 tokens of one expert
# (more than the 4 a row is dotted with at once)
SHAPES = [(4, 48, 80, 3, 2), (8, 40, 70, 5, 3), (6, 96, 128, 6, 6), (16, 128, 256, 8, 4)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("threads", [1, 3])
def test_the_pairs_on_cpu_are_the_eager_loops_and_no_other_is_written(lib, shape, threads):
    count, inter, hidden, tokens, k = shape
    gate_up, down = experts(count, inter, hidden)
    x = torch.randn(tokens, hidden).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(count)[:k] for _ in range(tokens)]).flatten()
    on_cpu = torch.zeros(count, dtype=torch.uint8)
    on_cpu[::2] = 1
    mine = on_cpu.bool()[ids]
    pairs = mine.nonzero().squeeze(1)
    want = kernel.gated_eager(x, pairs // k, gate_up, down, ids[pairs])
    for isa in isas(lib):
        pool = native.Pool(lib, threads)
        try:
            assert pool.isa(isa) == native.ISAS[isa]
            y = torch.full((tokens * k, hidden), 7.0, dtype=torch.bfloat16)
            job = native.job(pool, gate_up, down, on_cpu, x, ids, y, tokens, k)
            native.run(lib, job)
            native.run(lib, job)  # the pool's threads take the next job
        finally:
            pool.close()
        assert job.error == 0 and job.calls == 2 and job.nanos > 0
        assert torch.equal(y[~mine], torch.full_like(y[~mine], 7.0))
        got = y[pairs].float()
        assert (got - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max(), native.ISAS[isa]


def fp8_experts(count: int, inter: int, hidden: int, block: tuple[int, int], seed: int = 0):
    """(data, scales) of gate_up and down: every E4M3 code but NaN (subnormals too), scales of 2^-8 to 2^-4."""
    torch.manual_seed(seed)
    out = []
    for rows, cols in ((2 * inter, hidden), (hidden, inter)):
        codes = torch.randint(0, 256, (count, rows, cols), dtype=torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x42  # no NaN
        scale = torch.exp2(-4 - 4 * torch.rand(count, -(-rows // block[0]), -(-cols // block[1])))
        out.append((codes.view(torch.float8_e4m3fn), scale))
    return out


def run_job(lib, isa: int, threads: int, gate_up, down, on_cpu, x, ids, k: int, **fp8) -> torch.Tensor:
    pool = native.Pool(lib, threads)
    try:
        assert pool.isa(isa) == native.ISAS[isa]
        y = torch.full((ids.numel(), x.shape[1]), 7.0, dtype=torch.bfloat16)
        job = native.job(pool, gate_up, down, on_cpu, x, ids, y, x.shape[0], k, **fp8)
        native.run(lib, job)
    finally:
        pool.close()
    assert job.error == 0 and job.calls == 1
    return y


# (experts, intermediate, hidden, tokens, top_k, block): DeepSeek's 128 x 128 blocks with partial ones (hidden
# 192), blocks of 32 columns, and blocks that 32 does not divide (the scratch row's path on AVX512-BF16)
FP8_SHAPES = [(4, 128, 192, 3, 2, (128, 128)), (6, 64, 96, 6, 6, (32, 32)), (4, 40, 70, 3, 2, (24, 40))]


@pytest.mark.parametrize("shape", FP8_SHAPES)
@pytest.mark.parametrize("threads", [1, 3])
def test_fp8_experts_are_the_bf16_kernels_on_them_dequantized_bitwise(lib, shape, threads):
    count, inter, hidden, tokens, k, block = shape
    (gate_up, gate_up_scale), (down, down_scale) = fp8_experts(count, inter, hidden, block)
    x = torch.randn(tokens, hidden).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(count)[:k] for _ in range(tokens)]).flatten()
    on_cpu = torch.zeros(count, dtype=torch.uint8)
    on_cpu[1::2] = 1
    mine = on_cpu.bool()[ids]
    plain = [dequant_fp8(w, s, *block, torch.bfloat16) for w, s in ((gate_up, gate_up_scale), (down, down_scale))]
    for isa in isas(lib):
        want = run_job(lib, isa, threads, *plain, on_cpu, x, ids, k)
        got = run_job(lib, isa, threads, gate_up, down, on_cpu, x, ids, k, scales=(gate_up_scale, down_scale),
                      block=block)
        assert torch.equal(got[~mine], torch.full_like(got[~mine], 7.0))
        assert not got[mine].isnan().any() and got[mine].abs().max() > 0
        assert torch.equal(got, want), native.ISAS[isa]


def test_a_job_native_cpp_would_misread_is_refused(lib):
    (gate_up, gate_up_scale), (down, down_scale) = fp8_experts(4, 128, 192, (128, 128))
    x, ids, y = torch.zeros(1, 192, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.long), torch.zeros(2, 192)
    pool = native.Pool(lib, 1)
    try:
        with pytest.raises(ValueError, match="are not their .64, 64. block scales"):
            native.job(pool, gate_up, down, torch.ones(4, dtype=torch.uint8), x, ids, y, 1, 2,
                       scales=(gate_up_scale, down_scale), block=(64, 64))
        with pytest.raises(ValueError, match="or FP8 E4M3 ones with their scales: got torch.float8_e4m3fn"):
            native.job(pool, gate_up, down, torch.ones(4, dtype=torch.uint8), x, ids, y, 1, 2)
    finally:
        pool.close()


def test_a_pair_routed_to_no_expert_is_an_error_and_nan(lib):
    gate_up, down = experts(4, 48, 80)
    x = torch.randn(1, 80).to(torch.bfloat16)
    ids = torch.tensor([1, 9])
    y = torch.zeros(2, 80, dtype=torch.bfloat16)
    on_cpu = torch.ones(4, dtype=torch.uint8)  # alive for the job's life (native.job): it reads the mask
    pool = native.Pool(lib, 2)
    try:
        job = native.job(pool, gate_up, down, on_cpu, x, ids, y, 1, 2)
        native.run(lib, job)
    finally:
        pool.close()
    assert (job.error, job.bad, job.calls) == (1, 9, 0) and bool(y.isnan().all())


def test_an_instruction_set_the_cpu_lacks_is_refused(lib):
    pool = native.Pool(lib, 1)
    try:
        best = native.ISAS.index(pool.isa())
        if best == len(native.ISAS) - 1:
            pytest.skip("this CPU has every instruction set the kernel uses")
        with pytest.raises(ValueError, match=f"cannot run the host kernel's {native.ISAS[best + 1]} path"):
            pool.isa(best + 1)
    finally:
        pool.close()
