"""The code's boundaries: planner <- plan file <- runtime, and the CLI above both (offplan/cli.py); inside the
planner and the runtime, the folders draw the pipeline: each stage imports only the stages before it. Read from
every import statement of every module (lazy ones inside functions too)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["planner", "runtime", "offplan"]  # in order: each may import the ones before it
# Each package's stages in pipeline order; "" is the package's own top-level modules. A module may import its
# own stage and earlier ones. The planner's top (errors, files, plan, units) is the vocabulary every stage
# shares, so it comes first; the runtime's top (load_steps, hf) wires the stages together, so it comes last.
# A package's __init__ re-exports its public names from every stage.
ORDER = {"planner": ["", "inputs", "layers", "decide", "planfile"],
         "runtime": ["distributed", "place", "execute", "measure", ""],
         "offplan": [""]}


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def dotted(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """Every module `path` imports, absolute (`from X import name` counts as X and X.name)."""
    package = dotted(path) if path.name == "__init__.py" else dotted(path).rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return out


def imports(package: str) -> dict[str, set[str]]:
    """Module file (relative to the package) -> the top-level names it imports."""
    return {p.relative_to(ROOT / package).as_posix(): {n.split(".")[0] for n in imported(p)}
            for p in modules(package)}


def stage(module: str) -> tuple[int, int] | None:
    """(package rank, stage rank) of an offplan module; None for anything else."""
    top, _, rest = module.partition(".")
    if top not in ORDER:
        return None
    sub, stages = rest.partition(".")[0], ORDER[top]
    return PACKAGES.index(top), stages.index(sub) if sub in stages else stages.index("")


def test_the_planner_imports_neither_torch_nor_the_runtime_nor_the_cli():
    bad = {f: names & {"torch", "triton", "runtime", "offplan", "transformers"}
           for f, names in imports("planner").items()}
    assert not any(bad.values()), bad


def test_the_runtime_never_imports_the_cli():
    bad = {f: names & {"offplan"} for f, names in imports("runtime").items()}
    assert not any(bad.values()), bad


def test_no_module_imports_a_later_stage():
    late = []
    for package in PACKAGES:
        for path in modules(package):
            here = stage(dotted(path))
            if path.parent == ROOT / package and path.name == "__init__.py":
                here = (here[0], len(ORDER[package]))
            late += [f"{path.relative_to(ROOT)} imports {name}" for name in imported(path)
                     if (there := stage(name)) is not None and there > here]
    assert late == []


def test_no_two_modules_import_each_other():
    names = {dotted(p): p for package in PACKAGES for p in modules(package)}
    circles = sorted(f"{a} <-> {b}" for a, path in names.items() for b in imported(path)
                     if b in names and b != a and a < b and a in imported(names[b]))
    assert circles == []


def test_planning_commands_run_without_torch():
    """`plan build` and friends need no torch: import the CLI with torch made unimportable."""
    code = ("import sys; sys.modules['torch'] = None\n"
            "from offplan.cli import main\n"
            "sys.exit(main(['validate', 'plans/examples/tiny-moe.plan.yaml']))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "valid plan" in done.stdout


@pytest.mark.parametrize("folder", ["planner", "runtime", "offplan", "benchmarks", "tests", "plans/examples"])
def test_folders_stay_small_and_modules_readable_in_one_sitting(folder):
    """One concept per file, each under 300 lines, and no folder of more than 12 modules (STYLE.md): past either,
    a module or a folder wants splitting."""
    folders = [ROOT / folder, *(d for d in (ROOT / folder).rglob("*") if d.is_dir() and "__pycache__" not in d.parts)]
    crowded = {d.relative_to(ROOT).as_posix(): n for d in folders
               if (n := len([p for p in d.glob("*.py") if p.name != "__init__.py"])) > 12}
    long = {p.relative_to(ROOT).as_posix(): n for d in folders for p in d.glob("*.py")
            if (n := len(p.read_text().splitlines())) > 300}
    assert (crowded, long) == ({}, {})
