"""Install and packaging: a built wheel in a fresh venv plans the bundled example; the README's
commands install one tested stack, and `.ci/run` runs the README's test command."""
from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from offplan import cli
from planner.decide.build import build
from planner.inputs.policy import load_policy
from planner.planfile import dumps

ROOT = Path(__file__).resolve().parent.parent
VERSION = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
INSTALL = 'python3 -m pip install "torch==2.13.0" -e ".[runtime,test]"'


def clean_env() -> dict[str, str]:
    """This environment without what would put the source tree on the path of a child."""
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV")}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel `pip wheel` builds from a copy of the source (no build/ or egg-info left in the tree)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("planner", "runtime", "offplan", "schemas"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(dist), str(src)], check=True, env=clean_env(), cwd=dist)
    return next(dist.glob("offplan-*.whl"))


def test_the_wheel_ships_the_repository_schemas(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        for schema in sorted((ROOT / "schemas").glob("*.json")):
            assert z.read(f"planner/schemas/{schema.name}") == schema.read_bytes()
    assert [n for n in names if n.endswith(".json")] == [
        "planner/schemas/hardware.schema.json", "planner/schemas/plan.schema.json",
        "planner/schemas/policy.schema.json", "planner/schemas/routing.schema.json"]
    assert not [n for n in names if n.startswith(("schemas/", "tests/", "plans/"))]


def test_a_fresh_venv_installs_the_wheel_and_plans_the_example(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, env=clean_env())
    py, plan = venv / "bin" / "python", venv / "bin" / "plan"
    # This pip installs into the venv (`--python`); the dependencies come from the package index.
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", str(wheel)],
                   check=True, env=clean_env())
    example = tmp_path / "example"
    example.mkdir()
    shutil.copy(ROOT / "plans/examples/tiny-moe.policy.yaml", example)
    shutil.copytree(ROOT / "plans/examples/tiny-moe", example / "tiny-moe")
    elsewhere = tmp_path / "elsewhere"  # a cwd that holds no source tree
    elsewhere.mkdir()

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(argv, capture_output=True, text=True, env=clean_env(), cwd=elsewhere)

    where = run(str(py), "-c", "import importlib.util as u, planner; "
                               "print(planner.__file__); print(u.find_spec('torch'))")
    assert where.stdout.startswith(str(venv / "lib")) and where.stdout.endswith("\nNone\n")  # the planner: no torch
    policy, out = example / "tiny-moe.policy.yaml", example / "tiny-moe.plan.yaml"
    built = run(str(plan), "build", str(policy), "-o", str(out))
    assert (built.returncode, built.stderr) == (0, "")
    assert built.stdout.startswith(f"wrote {out}: 201 tensors, backend prefetch")
    assert out.read_text() == dumps(build(load_policy(policy), example))  # what the source tree plans
    checked = run(str(plan), "validate", str(out))
    assert (checked.returncode, checked.stdout, checked.stderr) == (
        0, f"{out}: valid plan (201 tensors, backend prefetch)\n", "")
    checked = run(str(plan), "validate", str(policy))
    assert (checked.returncode, checked.stdout, checked.stderr) == (
        0, f"{policy}: valid policy (checkpoint tiny-moe, 201 tensors; it plans backend prefetch)\n", "")
    version = run(str(plan), "--version")
    assert (version.returncode, version.stdout) == (0, f"plan (offplan) {VERSION}\n")


def readme_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Two commands"):text.index("\n## ", text.index("## Two commands") + 1)]
    return re.findall(r"^```sh\n(.*?)^```$", section, re.M | re.S)


def test_the_two_readme_commands_start_with_one_install_line():
    run_example, run_tests = readme_blocks()[:2]
    assert run_example.startswith(INSTALL + " && plan build plans/examples/tiny-moe.policy.yaml && ")
    assert run_tests == INSTALL + " && python3 -m pytest -q tests\n"


def test_ci_runs_the_readme_test_command():
    printed = subprocess.run(["bash", str(ROOT / ".ci/run"), "--print"], capture_output=True, text=True, check=True)
    assert printed.stdout == readme_blocks()[1]


def test_the_tested_stack_lies_within_the_dependency_ranges():
    """This machine's versions (the CPU CI stack) satisfy every range pyproject.toml gives, and so do
    the GPU machine's torch and transformers."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    specs = [Requirement(r) for r in project["dependencies"] + extras["runtime"] + extras["test"]]
    assert sorted(s.name for s in specs) == [
        "gguf", "jsonschema", "networkx", "orjson", "pytest", "pyyaml", "rich", "safetensors", "torch", "transformers"]
    for spec in specs:
        assert spec.specifier.contains(metadata.version(spec.name)), (spec, metadata.version(spec.name))
    assert SpecifierSet(project["requires-python"]).contains(platform.python_version())
    by_name = {s.name: s.specifier for s in specs}
    assert by_name["torch"].contains("2.11.0") and by_name["transformers"].contains("5.17.0")
    assert not any(s.name == "torch" for s in map(Requirement, project["dependencies"]))  # planner: no torch


def test_version(capsys, monkeypatch):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"plan (offplan) {metadata.version('offplan')}\n"

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)
    monkeypatch.setattr(metadata, "version", not_installed)
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"plan (offplan) unknown (not installed: running from {ROOT})\n"


def test_every_package_of_the_source_is_in_the_wheel_list():
    """pyproject's explicit package list names every folder with an __init__.py (a new one left out installs
    nowhere: a wheel without runtime.distributed fails at `plan apply` of a tensor-parallel plan)."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for top in ("planner", "runtime", "offplan")
             for p in (ROOT / top).rglob("__init__.py")}
    assert found - listed == set()
