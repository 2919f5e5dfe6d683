"""How `plan` commands print: JSON with `--json`, else text and rich tables (planner.planfile.show.print_to)."""
from __future__ import annotations

import json
import sys

from planner.planfile.show import print_to


def emit(args, data, text) -> None:
    """`--json`: the data; else the text (a string, or lines and rich tables)."""
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print_to(sys.stdout, [text] if isinstance(text, str) else text)
