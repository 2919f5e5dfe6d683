"""How `plan calibrate` reduces the host kernel's rounds (runtime/measure/host.py `fastest_rounds`), and the
threads it measures with (`check_threads`): plain numbers, no GPU."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("torch")

from planner.errors import OffplanError  # noqa: E402
from runtime.measure.host import POINTS, check_threads, fastest_rounds, threads_here  # noqa: E402

EXPERT = 9437184  # bytes of one expert of Qwen3-30B-A3B's shape, bf16


def calls(fixed_us: float, gbps: float) -> list[float]:
    """Each point's call time (us) on a quiet host: `fixed_us` + the touched experts' bytes at `gbps`."""
    return [fixed_us + on * EXPERT / gbps / 1e3 for _, on in POINTS]


def test_a_slow_phase_over_some_rounds_leaves_the_figures_of_the_quiet_ones():
    """Two of five rounds 1.6x slower at every point (a slow phase, docs/calibration/), and a third slow at
    its large points only: the rates, the fixed cost and the hand-over are the quiet host's, and the slowdown says
    how slow the median round of 8 experts ran."""
    quiet, alone = calls(20.0, 75.0), calls(20.0, 95.0)
    half = [q * (1.6 if i >= 4 else 1.0) for i, q in enumerate(quiet)]  # the phase began inside the round
    beside = [quiet, [1.6 * q for q in quiet], half, [1.6 * q for q in quiet], quiet]
    lone = [alone, [1.6 * a for a in alone], alone, [1.6 * a for a in alone], alone]
    got = fastest_rounds(15, "AVX512-BF16", [on * EXPERT for _, on in POINTS], beside, lone,
                         [33.0, 61.0, 35.0, 58.0, 34.0], [20.0, 31.0, 20.5, 33.0, 21.0])
    assert (got.gbps, got.alone_gbps, got.fixed_us) == (pytest.approx(75.0), pytest.approx(95.0), pytest.approx(20.0))
    assert got.handover_us == 33.0 and got.r2 == pytest.approx(1.0) and got.rounds == 5
    assert got.slowdown == pytest.approx(1.0)  # 8 experts: three quiet rounds of five, the median quiet
    assert got.profile_fields() == dict(cpu_expert_gbps=75.0, cpu_expert_alone_gbps=95.0, cpu_expert_sync_us=53.0,
                                        cpu_threads=15, cpu_rates_threads=15)
    three_slow = fastest_rounds(15, "AVX512-BF16", [on * EXPERT for _, on in POINTS], [beside[1]] * 3 + [quiet],
                                lone[:4], [40.0], [20.0])
    assert three_slow.gbps == pytest.approx(75.0) and three_slow.slowdown == pytest.approx(1.6)


def test_a_median_round_would_have_taken_the_slow_phase():
    """What the rounds are for: a single round, or the median of rounds, falls in a phase that the fastest does
    not (the rate 1.6x low)."""
    quiet = calls(20.0, 75.0)
    slow = [1.6 * q for q in quiet]
    one = fastest_rounds(15, "AVX512-BF16", [on * EXPERT for _, on in POINTS], [slow], [slow], [60.0], [20.0])
    assert one.gbps == pytest.approx(75.0 / 1.6, rel=0.05)
    spread = fastest_rounds(15, "AVX512-BF16", [on * EXPERT for _, on in POINTS], [slow, slow, quiet], [slow, quiet],
                            [60.0, 34.0], [32.0, 20.0])
    assert spread.gbps == pytest.approx(75.0) and spread.slowdown == pytest.approx(1.6)


def test_the_threads_default_to_the_cores_less_one_and_more_than_the_cores_are_refused():
    cores = len(os.sched_getaffinity(0))
    assert check_threads(None) == threads_here() == max(1, cores - 1)
    assert check_threads(1) == 1 and check_threads(cores) == cores  # all of them, if asked
    for bad in (0, cores + 1):
        with pytest.raises(OffplanError, match=f"--cpu-threads {bad}: this process may run on {cores} cores"):
            check_threads(bad)


def test_the_fixed_cost_is_timed_not_fitted():
    """The fixed cost is the fastest round's call of a tiny expert, taken off every point before the rate's line
    through the origin: with calls of exactly 20 us + bytes at 75 GB/s, the rate comes out 75 and the fixed
    cost 20 whatever the slower rounds did; a fixed cost mistimed 10 us high moves the rate under 2%."""
    quiet = calls(20.0, 75.0)
    nbytes = [on * EXPERT for _, on in POINTS]
    got = fastest_rounds(15, "AVX512-BF16", nbytes, [quiet], [quiet], [30.0], [27.0, 20.0, 24.0])
    assert (got.fixed_us, got.gbps, got.r2) == (20.0, pytest.approx(75.0), pytest.approx(1.0))
    off = fastest_rounds(15, "AVX512-BF16", nbytes, [quiet], [quiet], [30.0], [30.0])
    assert off.gbps == pytest.approx(75.0, rel=0.02) and off.fixed_us == 30.0


def test_a_tiny_experts_call_wakes_the_pool_and_costs_microseconds():
    """`_fixed_call` on this machine's kernel (no GPU): a median of calls that wake every worker, from a few
    microseconds to a few milliseconds on a loaded 2-core VM, never nothing."""
    from runtime.execute.host import native
    from runtime.measure.host import _fixed_call
    lib = native.library()
    if lib is None:
        pytest.skip(native.why_not)
    pool = native.Pool(lib, 2)
    try:
        assert 0 < _fixed_call(lib, pool, repeat=50) < 5000
    finally:
        pool.close()
