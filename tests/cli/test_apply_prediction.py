"""`plan apply`'s prediction line (offplan/running.py `report`): the plan's decode step for the mode that ran, a
plan predicting replayed and eager steps alike (cost.eager_cpu_us), at another batch its policy's plan for it, and
saying when they do not compare. The report
is called with a CUDA load's stats, so every branch runs here, without a GPU."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

pytest.importorskip("torch")

from offplan.running import report  # noqa: E402
from planner.decide.build import build  # noqa: E402
from planner.inputs.policy import load_policy  # noqa: E402
from planner.planfile import load_plan  # noqa: E402
from planner.units import ms  # noqa: E402
from runtime.execute.handle import LoadStats  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "plans" / "examples" / "tiny-moe.plan.yaml"
HW = "on NVIDIA H100 80GB HBM3 (PCIe Gen5 host link)"


def prediction(plan, mode: str, device: str = "cuda:0", batch: int = 1, path: Path = EXAMPLE) -> str:
    stats = LoadStats(device, 1, 1, 1, 3, 0, 0, 0, 0, 0.1, 0, True)
    gen = {"mode": mode, "max_new_tokens": 4, "ttft_s": 0.01, "prompt_tokens": 3, "decode_steps": 3,
           "decode_tokens_per_s": 100.0, "step_us": 10_000,
           "sequences": [{"text": None, "token_ids": [1, 2, 3, 4]}] * batch}
    lines = report(path, stats, {"random_weights": False, "tokenizer": True}, gen, plan, EXAMPLE.parent)
    return next(line for line in lines if line.startswith("  predicted "))


def test_each_mode_is_set_against_its_own_prediction():
    plan = load_plan(EXAMPLE)  # a graph plan: step 0.772 ms replayed, its launches 11.40 ms were the steps eager
    assert (plan.cost.cuda_graphs, plan.cost.eager_cpu_us, plan.summary.predicted_step_us) == (True, 11400, 772)
    said = f"  predicted 0.772 ms per decode step by the plan, for batch 1, CUDA graph replay, {HW}"
    assert prediction(plan, "graph") == said
    assert prediction(plan, "eager") == f"  predicted 11.40 ms per decode step by the plan, for batch 1, eager, {HW}"
    compiled = "; this run is compiled (the plan predicts uncompiled kernels): they do not compare"
    assert prediction(plan, "compiled-graph") == said + compiled
    assert prediction(plan, "compiled") == (f"  predicted 11.40 ms per decode step by the plan, for batch 1, eager, "
                                            f"{HW}{compiled}")
    assert prediction(plan, "eager", device="cpu") == said + "; this run is on the CPU: they do not compare"


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_at_another_batch_the_policy_is_built_again_for_it(tmp_path, mode):
    """The example's policy places alike at any batch (backend prefetch): its plan for batch 2 and the mode that
    ran predicts the run; where the policy is gone, the run does not compare."""
    plan = load_plan(EXAMPLE)
    policy = load_policy(EXAMPLE.with_name("tiny-moe.policy.yaml"))
    work = dataclasses.replace(policy.workload, batch_size=2, cuda_graphs=mode == "graph")
    again = build(dataclasses.replace(policy, workload=work), EXAMPLE.parent)
    assert again.params == plan.params
    how = "CUDA graph replay" if mode == "graph" else "eager"
    assert prediction(plan, mode, batch=2) == (f"  predicted {ms(again.summary.predicted_step_us)} per decode step by "
                                               f"the plan (its policy built for batch 2), for batch 2, {how}, {HW}")
    gone = tmp_path / EXAMPLE.name  # no policy beside it
    assert prediction(plan, mode, batch=2, path=gone) == (
        f"  predicted 0.772 ms per decode step by the plan, for batch 1, CUDA graph replay, {HW}; this run is at "
        "batch 2: they do not compare")


def test_a_graph_plan_written_before_eager_predictions_says_an_eager_run_does_not_compare():
    plan = load_plan(EXAMPLE)
    old = dataclasses.replace(plan, cost=dataclasses.replace(plan.cost, eager_cpu_us=None))
    said = f"  predicted 0.772 ms per decode step by the plan, for batch 1, CUDA graph replay, {HW}"
    assert prediction(old, "eager") == said + ("; this run is eager (the plan was written before eager predictions): "
                                               "they do not compare")
    assert prediction(old, "compiled") == said + ("; this run is compiled (the plan predicts uncompiled kernels): "
                                                  "they do not compare")
