"""The policy's GPUs (`gpus:`, `budget_gib:` as a list, `parallel:`): a count or each GPU's budget, typed, and
every way the two keys can disagree, located."""
from __future__ import annotations

import pytest

from headeronly import write_policy
from planner.errors import PolicyError
from planner.inputs.policy import load_policy

GIB = 2**30


@pytest.mark.parametrize("body, gpus, budget, each", [
    ("", 1, None, None),
    ("gpus: 2\nbudget_gib: 16\n", 2, 16, None),  # a number: each GPU's budget
    ("gpus: [20, 24]\n", 2, 20, (20.0, 24.0)),  # each GPU's budget; the plan fits the smallest
    ("gpus: 2\nbudget_gib: [20, 24]\n", 2, 20, (20.0, 24.0)),
    ("budget_gib: [20, 24, 24]\n", 3, 20, (20.0, 24.0, 24.0)),  # the list alone counts the GPUs
    ("gpus: [20, 20]\n", 2, 20, None),  # alike: one budget for each
    ("gpus: 4\nparallel: tensor\n", 4, None, None),
])
def test_gpus_a_count_or_each_gpus_budget(tmp_path, body, gpus, budget, each):
    got = load_policy(write_policy(tmp_path, body))
    assert (got.gpus, got.budget_gib, got.gpu_budgets_gib, got.warnings) == (gpus, budget, each, ())
    assert got.budget_bytes == (None if budget is None else budget * GIB)
    assert got.gpu_budgets_bytes == (None if each is None else tuple(int(b * GIB) for b in each))


@pytest.mark.parametrize("body, problem", [
    ("gpus: [20, 24]\nbudget_gib: [20, 24]\n", "4:1: budget_gib and a list of per-GPU budgets under gpus both set "
     "the budget: give it once (`gpus: 2` with `budget_gib: [20, 24]`, or `gpus: [20, 24]` alone)"),
    ("gpus: [20, 24]\nbudget_gib: 10\n", "4:1: budget_gib and a list of per-GPU budgets under gpus both set the "
     "budget: give it once (`gpus: 2` with `budget_gib: [20, 24]`, or `gpus: [20, 24]` alone)"),
    ("gpus: 3\nbudget_gib: [20, 24]\n", "4:13: budget_gib lists 2 per-GPU budgets but gpus is 3: give one budget per "
     "GPU"),
    ("gpus: 0\n", "3:7: gpus: must be at least 1, not 0"),
    ("gpus: two\n", "3:7: gpus: must be a whole number or a list of numbers, not 'two'"),
    ("gpus: 2.5\n", "3:7: gpus: must be a whole number, not 2.5"),
    ("gpus: []\n", "3:7: gpus: must not be empty"),
    ("gpus: [24, 0]\n", "3:12: gpus[1]: must be more than 0, not 0"),
    ("budget_gib: '12'\n", "3:13: budget_gib: must be a number, not the string '12'; write it without quotes"),
    ("parallel: pipeline\ngpus: 2\n", "3:11: parallel: 'pipeline' is not one of tensor"),
])
def test_gpus_and_budgets_that_disagree_are_one_located_problem(tmp_path, body, problem):
    path = write_policy(tmp_path, body)
    with pytest.raises(PolicyError) as e:
        load_policy(path)
    assert e.value.problems == [f"{path}:{problem}"]


def test_parallel_with_one_gpu_is_ignored_with_a_warning(tmp_path):
    path = write_policy(tmp_path, "parallel: tensor\n")
    got = load_policy(path)
    assert (got.gpus, got.warnings) == (1, (f"{path}:3:1: parallel is set but gpus is 1; it is ignored",))


def test_mixed_takes_its_budget_from_the_gpus_list(tmp_path):
    got = load_policy(write_policy(tmp_path, "backend: mixed\ngpus: [8, 12]\n"))
    assert (got.budget_gib, got.gpus) == (8, 2)
    path = write_policy(tmp_path, "backend: mixed\ngpus: 2\n")
    with pytest.raises(PolicyError) as e:
        load_policy(path)
    assert e.value.problems == [f"{path}:3:1: backend: mixed needs budget_gib: it chooses placements to fit a "
                                "GPU budget"]
