"""The GPU-run record and CI's guard (.ci/gpu_record.py), on the real repository and on scratch git repositories."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if shutil.which("git") is None or not (ROOT / ".git").exists():
    pytest.skip("needs git and a git checkout", allow_module_level=True)

_spec = importlib.util.spec_from_file_location("gpu_record", ROOT / ".ci" / "gpu_record.py")
gpu_record = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_record)


def git(root: Path, *args: str, env: dict | None = None) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}).stdout.strip()


def ids_by_git(root: Path, tmp_path: Path) -> dict[str, str]:
    """What git itself stores for the GPU paths as they are on disk (a scratch index, HEAD untouched)."""
    env = {"GIT_INDEX_FILE": str(tmp_path / "scratch-index")}
    git(root, "read-tree", "--empty", env=env)
    paths = gpu_record.gpu_paths(root)
    git(root, "add", "--", *paths, env=env)
    out = {}
    for rel in paths:
        if (root / rel).is_dir():
            out[rel] = git(root, "write-tree", f"--prefix={rel}/", env=env)
        else:
            out[rel] = git(root, "hash-object", "--", rel)
    return out


def scratch_repo(tmp_path: Path) -> Path:
    """A repository with GPU paths whose names exercise git's tree order, modes and ignore rules."""
    root = tmp_path / "repo"
    for rel, text in {"runtime/a.py": "a", "runtime/a-b.py": "ab", "runtime/a/inner.py": "inner",
                      "runtime/a.b/x.py": "x", "runtime/z.py": "z", "benchmarks/harness/loops.py": "loops",
                      "benchmarks/decode.py": "decode", "benchmarks/front_door.py": "front door",
                      "benchmarks/moe.py": "moe", "benchmarks/moe_kernels.py": "kernels",
                      "benchmarks/parallel.py": "parallel", "benchmarks/prefill.py": "prefill",
                      "benchmarks/quantized.py": "quantized", "benchmarks/memory.py": "memory",
                      "benchmarks/peers.py": "peers",
                      "benchmarks/peers/build.sh": "build", "tests/parallel_ranks.py": "ranks",
                      "tests/quantized_models.py": "writer",
                      "tests/test_x_gpu.py": "gpu test", "tests/a/b/test_y_gpu.py": "deeper gpu test",
                      "tests/test_cpu.py": "cpu test", "tests/a/test_cpu.py": "deeper cpu test",
                      ".gitignore": "__pycache__/\n*.egg-info/\n/.device/\n"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "runtime" / "tool.sh").write_text("#!/bin/sh\n")
    (root / "runtime" / "tool.sh").chmod(0o755)
    (root / "runtime" / "__pycache__").mkdir()
    (root / "runtime" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    (root / "runtime" / "empty").mkdir()  # git stores no empty trees
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    return root


def commit(root: Path, message: str) -> None:
    git(root, "add", "-A")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message)


def stamp(root: Path, tmp_path: Path, summary: str = "3 passed in 1.00s", exit_code: int = 0) -> Path:
    path = tmp_path / "gpu-run.json"
    path.write_text(json.dumps({"ids": gpu_record.ids_from_files(root), "device": "NVIDIA H100 80GB HBM3",
                                "torch": "2.11.0+cu130", "command": "python3 -m pytest -m gpu",
                                "summary": summary, "exit_code": exit_code}))
    return path


def test_ids_from_files_equal_gits_own_on_this_repository(tmp_path):
    assert gpu_record.ids_from_files(ROOT) == ids_by_git(ROOT, tmp_path)


def test_ids_from_files_follow_gits_order_modes_and_ignores(tmp_path):
    root = scratch_repo(tmp_path)
    ids = gpu_record.ids_from_files(root)
    assert list(ids) == ["runtime", "benchmarks/harness", "benchmarks/decode.py", "benchmarks/front_door.py",
                         "benchmarks/moe.py", "benchmarks/moe_kernels.py", "benchmarks/parallel.py",
                         "benchmarks/prefill.py", "benchmarks/quantized.py", "benchmarks/memory.py",
                         "benchmarks/peers.py",
                         "benchmarks/peers", "tests/parallel_ranks.py",
                         "tests/quantized_models.py", "tests/a/b/test_y_gpu.py", "tests/test_x_gpu.py"]
    assert ids == gpu_record.ids_at_head(root) == {rel: git(root, "rev-parse", f"HEAD:{rel}") for rel in ids}


def test_write_then_check_passes_and_a_runtime_change_fails_ci(tmp_path, capsys):
    root = scratch_repo(tmp_path)
    (root / ".ci").mkdir()
    assert gpu_record.write(stamp(root, tmp_path), root) == 0
    record = json.loads((root / ".ci" / "gpu-run.json").read_text())
    assert record["ids"]["runtime"] == git(root, "rev-parse", "HEAD:runtime")
    assert record["summary"] == "3 passed in 1.00s" and record["device"] == "NVIDIA H100 80GB HBM3"
    commit(root, "record")
    assert gpu_record.check(root) == 0
    (root / "runtime" / "z.py").write_text("z changed")
    commit(root, "untested GPU change")
    capsys.readouterr()
    assert gpu_record.check(root) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: GPU code changed since the last recorded GPU run:\n  - runtime (recorded ")
    assert "python3 .ci/gpu_record.py run --out $OUT" in err


def test_a_new_gpu_test_file_needs_a_new_run(tmp_path, capsys):
    root = scratch_repo(tmp_path)
    (root / ".ci").mkdir()
    gpu_record.write(stamp(root, tmp_path), root)
    (root / "tests" / "test_new_gpu.py").write_text("new")
    commit(root, "new GPU test")
    assert gpu_record.check(root) == 1
    assert "tests/test_new_gpu.py (recorded nothing" in capsys.readouterr().err


def test_write_refuses_a_failed_run_or_one_of_other_code(tmp_path, capsys):
    root = scratch_repo(tmp_path)
    (root / ".ci").mkdir()
    assert gpu_record.write(stamp(root, tmp_path, "1 failed, 2 passed in 1.00s", 1), root) == 1
    assert "the GPU run did not pass (1 failed, 2 passed" in capsys.readouterr().err
    good = stamp(root, tmp_path)
    (root / "runtime" / "a.py").write_text("edited after the run")
    assert gpu_record.write(good, root) == 1
    assert "runtime: uncommitted changes" in capsys.readouterr().err
    commit(root, "edit")
    assert gpu_record.write(good, root) == 1
    assert "runtime: the run tested " in capsys.readouterr().err
    assert not (root / ".ci" / "gpu-run.json").exists()


def test_check_without_a_record_says_what_to_run(tmp_path, capsys):
    root = scratch_repo(tmp_path)
    assert gpu_record.check(root) == 1
    assert capsys.readouterr().err.startswith("error: no record of a GPU run (.ci/gpu-run.json). Run the GPU suite")


def part_stamp(root: Path, tmp_path: Path, k: int, n: int, summary: str = "3 passed in 1.00s",
               exit_code: int = 0) -> Path:
    path = stamp(root, tmp_path, summary, exit_code)
    data = json.loads(path.read_text())
    data["part"] = [k, n]
    out = tmp_path / f"gpu-run-{k}-of-{n}.json"
    out.write_text(json.dumps(data))
    return out


def test_a_suite_run_in_parts_makes_one_record(tmp_path, capsys):
    """Every part's stamp, of the same code: one record whose summary names each part's; CI then passes."""
    root = scratch_repo(tmp_path)
    (root / ".ci").mkdir()
    parts = [part_stamp(root, tmp_path, 2, 2, "2 passed in 9.00s"), part_stamp(root, tmp_path, 1, 2)]
    assert gpu_record.write(parts, root) == 0
    record = json.loads((root / ".ci" / "gpu-run.json").read_text())
    assert record["summary"] == "part 2/2: 2 passed in 9.00s; part 1/2: 3 passed in 1.00s"
    assert record["command"].endswith("in 2 parts by file (gpu_record.py run --part K/2)")
    commit(root, "record")
    assert gpu_record.check(root) == 0


def test_parts_must_be_whole_passing_and_of_one_code(tmp_path, capsys):
    root = scratch_repo(tmp_path)
    (root / ".ci").mkdir()
    one = part_stamp(root, tmp_path, 1, 2)
    assert gpu_record.write([one], root) == 1
    assert "the stamps are parts 1/2: give every part of one run, 1/2 to 2/2, once each" in capsys.readouterr().err
    two = part_stamp(root, tmp_path, 2, 2, "1 failed, 1 passed in 3.00s", 1)
    assert gpu_record.write([one, two], root) == 1
    assert "the GPU run did not pass (1 failed, 1 passed" in capsys.readouterr().err
    good = part_stamp(root, tmp_path, 2, 2)
    (root / "runtime" / "a.py").write_text("changed between the parts")
    other = part_stamp(root, tmp_path, 1, 2)
    assert gpu_record.write([other, good], root) == 1
    assert "not a run of the same code on the same device and torch" in capsys.readouterr().err
    assert not (root / ".ci" / "gpu-run.json").exists()


def test_the_parts_split_the_gpu_test_files(monkeypatch):
    """On this repository: the parts' files are disjoint and together every file that holds a GPU test."""
    every = gpu_record.part_files(1, 1)
    assert "tests/execute/test_generation_gpu.py" in every and not any("test_boundaries" in f for f in every)
    halves = gpu_record.part_files(1, 2), gpu_record.part_files(2, 2)
    assert not set(halves[0]) & set(halves[1]) and sorted(halves[0] + halves[1]) == every
