"""planfile/reading.py: a plan's `params:` block read without PyYAML where `dumps` wrote it, and the same data as
PyYAML's reading of the whole file in every case, the fast one and each that falls back to it."""
from __future__ import annotations

from pathlib import Path

import pytest

from planner.errors import PlanFileError
from planner.inputs import yamlio
from planner.planfile.reading import parse_plan

EXAMPLES = sorted(Path(__file__).resolve().parents[2].glob("plans/examples/*.plan.yaml"))


def both(text: str, path: Path = Path("p.plan.yaml")):
    return parse_plan(path, text).data, yamlio.parse(path, text, PlanFileError).data


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_a_plan_as_dumps_wrote_it_reads_as_pyyaml_reads_it(example, monkeypatch):
    text = example.read_text()
    calls = []
    real = yamlio.parse
    monkeypatch.setattr(yamlio, "parse", lambda path, t, e: calls.append(len(t)) or real(path, t, e))
    fast = parse_plan(example, text)
    assert calls and max(calls) < text.index("\nparams:\n") + 2  # PyYAML read the head only
    assert fast.data == real(example, text, PlanFileError).data and len(fast.data["params"]) > 100


@pytest.mark.parametrize("edit", [
    lambda t: t + "# reviewed\n",  # a comment after the block
    lambda t: t.replace("  model.norm.weight: ", '  "model.norm.weight": ', 1),  # a quoted name
    lambda t: t.replace("  model.norm.weight: gpu\n", "  model.norm.weight:   gpu\n", 1),  # other spacing
    lambda t: t.replace("\nparams:\n", "\nparams:\n  yes.no: gpu\n", 1),  # a name that is no plain scalar
])
def test_a_block_not_as_dumps_writes_it_is_read_by_pyyaml_whole(edit):
    fast, slow = both(edit(EXAMPLES[0].read_text()))
    assert fast == slow


def test_a_name_twice_is_pyyamls_duplicate_key_error_with_both_lines():
    text = EXAMPLES[0].read_text().replace("  model.norm.weight: gpu\n",
                                           "  model.norm.weight: gpu\n  model.norm.weight: uva\n", 1)
    with pytest.raises(PlanFileError, match="'model.norm.weight' again"):
        parse_plan(Path("p.plan.yaml"), text)
    with pytest.raises(PlanFileError, match="'params' again"):  # a second params: above the block
        parse_plan(Path("p.plan.yaml"), text.replace("\nnotes:\n", "\nparams: {}\nnotes:\n", 1))


def test_diff_reads_a_checkpoint_both_plans_share_once(monkeypatch, capsys):
    import planner.planfile.file as file
    from offplan.cli import main

    opened = []
    real = file.open_checkpoint
    monkeypatch.setattr(file, "open_checkpoint", lambda where: opened.append(where) or real(where))
    tiny = [p for p in EXAMPLES if p.name == "tiny-moe.plan.yaml"]
    assert main(["diff", *map(str, tiny * 2)]) == 0
    assert len(opened) == 1 and "no changes" in capsys.readouterr().out.lower()
