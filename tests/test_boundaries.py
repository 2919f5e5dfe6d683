"""The code's boundaries: planner <- plan file <- runtime, and the CLI above both (offplan/cli.py)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def imports(package: str) -> dict[str, set[str]]:
    """Module file -> the top-level names it imports (absolute imports; relative ones stay inside)."""
    out = {}
    for path in sorted((ROOT / package).glob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        out[path.name] = names
    return out


def test_the_planner_imports_neither_torch_nor_the_runtime_nor_the_cli():
    bad = {f: names & {"torch", "runtime", "offplan", "transformers"} for f, names in imports("planner").items()}
    assert not any(bad.values()), bad


def test_the_runtime_never_imports_the_cli():
    bad = {f: names & {"offplan"} for f, names in imports("runtime").items()}
    assert not any(bad.values()), bad


def test_planning_commands_run_without_torch():
    """`plan build` and friends need no torch: import the CLI with torch made unimportable."""
    code = ("import sys; sys.modules['torch'] = None\n"
            "from offplan.cli import main\n"
            "sys.exit(main(['validate', 'plans/examples/tiny-moe.plan.yaml']))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "valid plan" in done.stdout


def test_planner_modules_stay_readable_in_one_sitting():
    """One concept per file, most under ~300 lines (STYLE.md): a planner module past 300 wants splitting."""
    lines = {p.name: len(p.read_text().splitlines()) for p in sorted((ROOT / "planner").glob("*.py"))}
    assert {name: n for name, n in lines.items() if n > 300} == {}
