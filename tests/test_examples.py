"""The committed example plans are exactly what `plan build` produces today.

Each `plans/examples/*.policy.yaml` has its `.plan.yaml` committed beside it.
The header-only checkpoints they name (and the config.json beside them: what a
tensor-parallel plan needs) are git-ignored and regenerated here
when missing or outdated (`make_checkpoints.py` keeps a stamp, so this is a
no-op after the first run). A drift means the planner, `tests/synthetic.py` or
a policy changed without the plan being rebuilt.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from offplan.cli import main
from planner.decide.build import build
from planner.inputs.policy import load_policy
from planner.planfile import dumps, read_plan

EXAMPLES = Path(__file__).resolve().parent.parent / "plans" / "examples"
POLICIES = sorted(EXAMPLES.glob("*.policy.yaml"))


def _refresh(policy: Path) -> str:
    rel = policy.relative_to(EXAMPLES.parent.parent).as_posix()
    return f"python plans/examples/make_checkpoints.py && plan build {rel}"


@pytest.fixture(scope="module", autouse=True)
def checkpoints():
    spec = importlib.util.spec_from_file_location("make_checkpoints", EXAMPLES / "make_checkpoints.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.make_all()


def test_there_are_examples():
    names = {p.name for p in POLICIES}
    assert {"qwen3-30b-a3b.policy.yaml", "llama-3.1-8b.policy.yaml", "qwen3-30b-a3b-2gpu.policy.yaml"} <= names


def test_the_two_gpu_example_offloads_each_gpus_share_of_the_experts():
    """Tensor parallel over 2 GPUs: the plan is one GPU's share, within each GPU's budget, and what it offloads
    are experts only (uva.params), read over each GPU's own link."""
    plan = read_plan(EXAMPLES / "qwen3-30b-a3b-2gpu.plan.yaml").plan  # checked against the checkpoint's headers
    assert (plan.parallel.gpus, plan.parallel.gather, plan.cost.cuda_graphs) == (2, ("lm_head",), True)
    assert plan.summary.gpu_footprint_bytes <= plan.budget_bytes == 16 * 2**30
    shares = sum(l.gpu + l.uva + l.prefetch for l in plan.layers)
    assert plan.total_bytes // 2 < shares < plan.total_bytes // 2 + 2**30  # half of all, the embedding whole
    offloaded = [n for n, p in plan.params.items() if p.value != "gpu"]
    assert offloaded and all(".mlp.experts." in n for n in offloaded)


@pytest.mark.parametrize("policy_path", POLICIES, ids=lambda p: p.name)
def test_committed_plan_is_current(policy_path: Path):
    plan_path = policy_path.with_name(policy_path.name.replace(".policy.yaml", ".plan.yaml"))
    assert plan_path.is_file(), f"{plan_path.name} is not committed; build it: {_refresh(policy_path)}"
    got = dumps(build(load_policy(policy_path), plan_path.parent))
    want = plan_path.read_text()
    same = got == want  # compared outside the assert: pytest would diff a megabyte of YAML
    if not same:
        at = next((i for i, (a, b) in enumerate(zip(got.splitlines(), want.splitlines())) if a != b),
                  min(len(got.splitlines()), len(want.splitlines())))
        line_got = got.splitlines()[at] if at < len(got.splitlines()) else "<end of file>"
        line_want = want.splitlines()[at] if at < len(want.splitlines()) else "<end of file>"
        pytest.fail(f"{plan_path.name} drifted from what `plan build` produces (first difference at "
                    f"line {at + 1}: committed {line_want!r}, built {line_got!r}).\n"
                    f"Review the change, then refresh it: {_refresh(policy_path)}", pytrace=False)


@pytest.mark.parametrize("policy_path", POLICIES, ids=lambda p: p.name)
def test_plan_check_passes(policy_path: Path, capsys):
    plan_path = policy_path.with_name(policy_path.name.replace(".policy.yaml", ".plan.yaml"))
    code = main(["check", str(plan_path)])
    out, err = capsys.readouterr()
    assert code == 0, f"plan check {plan_path.name} exited {code}:\n{out}{err}\nrefresh: {_refresh(policy_path)}"
    assert "up to date" in out
