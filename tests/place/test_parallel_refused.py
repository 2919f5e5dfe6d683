"""A tensor-parallel plan is planned and reviewed, but this runtime applies one GPU's plans only: loading one, or
`plan apply` of one, is refused with one clear error before anything is loaded (planner/planfile/staleness.py)."""
from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from offplan.cli import main  # noqa: E402
from planner.errors import OffplanError  # noqa: E402
from runtime.hf import from_pretrained  # noqa: E402
from tiny_models import make_plan, save_models  # noqa: E402

REFUSED = ("the plan is for 2 GPUs (parallel.gpus: 2): this offplan plans and reviews tensor-parallel plans, but "
           "its runtime applies plans for one GPU only")


def test_a_tensor_parallel_plan_is_refused_at_load_and_apply(tmp_path, capsys):
    ckpt = save_models(tmp_path / "models", "moe")["moe"]
    plan = make_plan(tmp_path, ckpt, "gpus: 2\nrules:\n  - {match: [experts], place: uva}", name="two")
    assert main(["show", str(plan)]) == 0  # planned and reviewed
    capsys.readouterr()
    with pytest.raises(OffplanError, match=r"^" + REFUSED.replace("(", r"\(").replace(")", r"\)")):
        from_pretrained(plan, device="cpu", progress=False)
    assert main(["apply", str(plan), "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {REFUSED}") and "without `gpus:` in its policy" in err and "Traceback" not in err
