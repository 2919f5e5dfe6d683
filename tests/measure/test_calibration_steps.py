"""How `plan calibrate` reduces its eager rounds (runtime/measure/steps.py): plain numbers, no GPU."""
from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from runtime.measure.steps import fastest, fit_line  # noqa: E402


def test_each_count_takes_its_fastest_round_and_the_slowdown_is_the_worst_median_over_it():
    """A slow phase only adds time: a count's figure is its fastest round, and the ratio of its median round to
    that says how slow the phases were (the larger over the counts)."""
    rounds = {2: [3000.0, 4500.0, 3100.0], 4: [4400.0, 6800.0, 6600.0], 8: [7000.0, 7100.0, 7050.0]}
    best, slowdown = fastest(rounds)
    assert best == {2: 3000.0, 4: 4400.0, 8: 7000.0}
    assert slowdown == pytest.approx(6600.0 / 4400.0)  # count 4: its median round in the slow phase


def test_a_slow_phase_over_some_rounds_leaves_the_line_through_the_fastest_ones_as_it_was():
    """Rounds 2 and 3 of every count 1.5x slower (as the H100 machine's phases are, docs/calibration/): the line
    through the fastest rounds is the quiet machine's, where the medians' would be 1.5x it."""
    quiet = {n: 1600.0 + 650.0 * n for n in (2, 4, 8, 16, 32)}
    rounds = {n: [t, 1.5 * t, 1.5 * t, t * 1.01] for n, t in quiet.items()}
    best, slowdown = fastest(rounds)
    per_step, per_layer, r2 = fit_line(list(best), list(best.values()))
    assert (per_step, per_layer, r2) == (pytest.approx(1600.0), pytest.approx(650.0), pytest.approx(1.0))
    assert slowdown == pytest.approx(1.255, abs=1e-3)  # the median of [1, 1.01, 1.5, 1.5] x
