"""The folders draw the pipeline: each stage imports only the stages before it, read from every import
statement (lazy ones inside functions too) of every module."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Each package's stages in pipeline order; "" is the package's own top-level modules. A module may import its
# own stage and earlier ones. The planner's top (errors, files, plan, units) is the vocabulary every stage
# shares, so it comes first; the runtime's top (load_steps, hf) wires the stages together, so it comes last.
ORDER = {"planner": ["", "inputs", "layers", "decide", "planfile"],
         "runtime": ["place", "execute", "measure", ""],
         "offplan": [""]}
PACKAGES = ["planner", "runtime", "offplan"]  # also in order: each may import the ones before it


def modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def dotted(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """Every module `path` imports, absolute (a `from X import name` counts as X and X.name)."""
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


def stage(module: str) -> tuple[int, int] | None:
    """(package rank, stage rank) of an offplan module; None for anything else."""
    top, _, rest = module.partition(".")
    if top not in ORDER:
        return None
    sub, stages = rest.partition(".")[0], ORDER[top]
    return PACKAGES.index(top), stages.index(sub) if sub in stages else stages.index("")


def test_no_module_imports_a_later_stage():
    late = []
    for path in modules():
        here = stage(dotted(path))
        if path.parent.parent == ROOT and path.name == "__init__.py":  # a package's public names, from all stages
            here = (here[0], len(ORDER[path.parent.name]))
        for name in imported(path):
            there = stage(name)
            if there is not None and there > here:
                late.append(f"{path.relative_to(ROOT)} imports {name}")
    assert late == []


@pytest.mark.parametrize("package", ["planner"])
def test_the_planner_never_imports_torch_or_what_is_above_it(package):
    found = [f"{p.relative_to(ROOT)}: {n}" for p in (ROOT / package).rglob("*.py") for n in imported(p)
             if n.split(".")[0] in ("torch", "transformers", "triton", "runtime", "offplan")]
    assert found == []


def test_no_import_circle_between_modules_of_the_command_line():
    cycles = []
    for path in (ROOT / "offplan").glob("*.py"):
        for name in imported(path):
            other = ROOT / Path(*name.split(".")).with_suffix(".py")
            if other.is_file() and other != path and dotted(path) in imported(other):
                cycles.append(f"{dotted(path)} <-> {name}")
    assert cycles == []


def test_folders_stay_small_and_modules_short():
    """No folder of the project holds more than 12 modules directly, and no module is over 300 lines."""
    folders = [ROOT / f for f in ("planner", "runtime", "offplan", "benchmarks", "tests", "plans/examples")]
    folders += [d for f in folders for d in f.rglob("*") if d.is_dir() and "__pycache__" not in d.parts]
    crowded = {d.relative_to(ROOT).as_posix(): n for d in folders
               if (n := len([p for p in d.glob("*.py") if p.name != "__init__.py"])) > 12}
    long = {p.relative_to(ROOT).as_posix(): n for d in folders for p in d.glob("*.py")
            if (n := len(p.read_text().splitlines())) > 300}
    assert (crowded, long) == ({}, {})
