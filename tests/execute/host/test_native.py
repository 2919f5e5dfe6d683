"""native.cpp, the host's kernel for gated bf16 experts, against the eager loop's arithmetic (kernel.py
`gated_eager`), on every instruction set this CPU has: only the pairs whose expert is on cpu are written, each
within a unit or so of the loop's (the sums run in another order), and a pair routed to no expert is an error."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from runtime.execute.host import kernel, native  # noqa: E402


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


def test_a_pair_routed_to_no_expert_is_an_error_and_nan(lib):
    gate_up, down = experts(4, 48, 80)
    x = torch.randn(1, 80).to(torch.bfloat16)
    ids = torch.tensor([1, 9])
    y = torch.zeros(2, 80, dtype=torch.bfloat16)
    pool = native.Pool(lib, 2)
    try:
        job = native.job(pool, gate_up, down, torch.ones(4, dtype=torch.uint8), x, ids, y, 1, 2)
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
