"""A plan file's YAML, read fast where it is as `plan build` wrote it (file.py `dumps`).

A plan's last section, `params:`, holds a line per checkpoint tensor: DeepSeek-V3's 92k lines took PyYAML 1.2 s
to construct (its parser is libyaml's, its constructors Python's), 60% of a `plan show` and of every load.
Where the section is what `dumps` writes, only `  NAME: PLACEMENT` lines to the end of the file with names that
YAML reads back as themselves (yamlio.py `all_plain`, which `dumps` asks too) and no name twice, two scans in C
read it, and PyYAML reads the rest of the file. Anything else there (a quoted name, a comment, a duplicate, a
section after it) goes to PyYAML whole, which reads the same data, or says what is wrong with `file:line:column`.
"""
from __future__ import annotations

import re
from pathlib import Path

from ..errors import PlanFileError
from ..files import written_as
from ..inputs import yamlio
from ..plan import Placement

_START = "\nparams:\n"
_PLACES = "|".join(p.value for p in Placement)
_LINES = re.compile(rf"(?:  [^\n:]+: (?:{_PLACES})\n)*")
_LINE = re.compile(rf"  ([^\n:]+): ({_PLACES})\n")


def parse_plan(path: Path, text: str) -> yamlio.Located:
    """yamlio.parse of a plan's text (errors as PlanFileError), its `params:` block read as the module doc says.
    YAML that does not parse in a file that starts as a plan was cut short or edited: the error says to rebuild."""
    try:
        return _parse_plan(path, text)
    except PlanFileError as e:
        if written_as(text[:64]) != "plan":  # every error here is the YAML's (syntax, tabs, characters, keys twice)
            raise
        raise PlanFileError(f"{e.headline} (it starts as a plan: cut short, or edited?); rebuild it with "
                            "`plan build POLICY`", e.problems) from None


def _parse_plan(path: Path, text: str) -> yamlio.Located:
    cut = text.find(_START)
    block = text[cut + len(_START):] if cut > 0 else ""
    pairs = _LINE.findall(block) if block and _LINES.fullmatch(block) else []
    params = dict(pairs)
    if pairs and len(params) == len(pairs) and yamlio.all_plain("\n".join(params)):
        head = yamlio.parse(path, text[:cut + 1], PlanFileError)
        if isinstance(head.data, dict) and "params" not in head.data:
            head.data["params"] = params
            return yamlio.Located(path, head.data, text)  # positions (`where`) from the whole text
    return yamlio.parse(path, text, PlanFileError)
