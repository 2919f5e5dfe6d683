"""A plan records the top-k its prediction assumed (`cost.top_k`), so `plan diff` of a policy that changes only
`workload.experts_per_token` says why the prediction moved (a policy review saw only "its content differs")."""
from __future__ import annotations

from offplan.cli import main
from planner.planfile import load_plan
from test_stamp import plan  # noqa: F401 (the fixture: a budget plan over a header-only Qwen3-MoE, top-2)


def test_diff_names_a_change_of_top_k(plan, capsys):  # noqa: F811
    assert load_plan(plan).cost.top_k == 2  # config.json's
    policy = plan.parent / "p.policy.yaml"
    (plan.parent / "k1.policy.yaml").write_text(policy.read_text().replace("workload: {", "workload: {"
                                                                           "experts_per_token: 1, "))
    assert main(["build", str(plan.parent / "k1.policy.yaml")]) == 0
    capsys.readouterr()
    assert main(["diff", str(plan), str(plan.parent / "k1.plan.yaml")]) == 0
    assert "routed experts per token: 2 -> 1\n" in capsys.readouterr().out
