"""The record of the last full GPU run, and the CI guard that keeps untested GPU code off main.

CI has no GPU. Code that runs on the GPU (GPU_PATHS: the runtime, the GPU
tests, the decode, front-door, memory, MoE, MoE-kernel, parallel, peers, prefill and quantized benchmarks with the
harness they share, the quantized checkpoint writer the front-door and quantized ones use, and what each process of the
tensor-parallel GPU tests runs) therefore lands only with a
record, committed in
RECORD, of a full GPU test run on exactly that code: the git object id of each
path (as `git rev-parse HEAD:runtime` prints it), the device, and pytest's
summary line.

    # on the GPU machine, in a copy of the tree (no .git needed): run the GPU suite and stamp it
    python3 .ci/gpu_record.py run --out $OUT
    # here: check the stamp against HEAD and write the record; then commit it
    python3 .ci/gpu_record.py write PATH/TO/gpu-run.json
    # CI (.ci/run): exit 1, saying what to run, if GPU code changed since the record
    python3 .ci/gpu_record.py check

A suite that does not fit one device call (10 minutes) runs in parts, each
its own call: `run --part K/N` runs the GPU tests of every Nth file that has
any (their files in order, the Kth of each N) and writes gpu-run-K-of-N.json;
`write` then takes all N stamps, which must be of the same code, and records
their summaries together:

    python3 .ci/gpu_record.py run --out $OUT --part 1/2      # one device call
    python3 .ci/gpu_record.py run --out $OUT --part 2/2      # another
    python3 .ci/gpu_record.py write gpu-run-1-of-2.json gpu-run-2-of-2.json

The device copy of the tree has no .git, so `run` computes the object ids
from the files, the way git does (blob: sha1 of "blob <size>\\0" + bytes; tree:
sha1 over "<mode> <name>\\0<id>" entries in git's order), skipping what
.gitignore ignores. `write` refuses a stamp whose ids differ from HEAD's: the
run was not of the committed code. Standard library only.
"""
from __future__ import annotations

import argparse
import fnmatch
import functools
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORD = ".ci/gpu-run.json"  # relative to the root
GPU_PATHS = ("runtime", "benchmarks/harness", "benchmarks/decode.py", "benchmarks/front_door.py",
             "benchmarks/moe.py", "benchmarks/moe_kernels.py", "benchmarks/parallel.py", "benchmarks/prefill.py",
             "benchmarks/quantized.py", "benchmarks/memory.py", "benchmarks/peers.py", "benchmarks/peers", "tests/parallel_ranks.py", "tests/quantized_models.py", "tests/**/*_gpu.py")  # globs relative to the root; `**/`: any folders, none included
SUITE = ["-m", "pytest", "-m", "gpu", "-v", "-s", "-p", "no:cacheprovider", "tests"]
SUMMARY = re.compile(r"^=+ (.* in [\d.]+s.*?) =+$")


# ------------------------------------------------------------ object ids

def _ignore_rules(root: Path) -> list[tuple[str, bool, bool]]:
    """(pattern, anchored, directories only) for each line of the root .gitignore."""
    rules = []
    path = root / ".gitignore"
    for line in path.read_text().splitlines() if path.is_file() else []:
        line = line.strip()
        if not line or line.startswith("#") or line.startswith("!"):
            continue
        dir_only = line.endswith("/")
        line = line.rstrip("/")
        anchored = "/" in line
        rules.append((line.lstrip("/"), anchored, dir_only))
    return rules


def _ignored(rel: str, is_dir: bool, rules) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return any((not dir_only or is_dir) and fnmatch.fnmatchcase(rel if anchored else name, pattern)
               for pattern, anchored, dir_only in rules)


def _object(kind: str, body: bytes) -> str:
    return hashlib.sha1(f"{kind} {len(body)}\0".encode() + body).hexdigest()


def _tree(root: Path, rel: str, rules) -> str | None:
    """git's tree id of root/rel as `git add` would store it; None for a tree with nothing tracked."""
    entries = []
    for child in (root / rel).iterdir():
        crel = f"{rel}/{child.name}"
        is_dir = child.is_dir() and not child.is_symlink()
        if _ignored(crel, is_dir, rules):
            continue
        if child.is_symlink():
            mode, oid = "120000", _object("blob", os.readlink(child).encode())
        elif is_dir:
            oid = _tree(root, crel, rules)
            if oid is None:
                continue
            mode = "40000"
        else:
            mode = "100755" if child.stat().st_mode & 0o100 else "100644"
            oid = _object("blob", child.read_bytes())
        # git orders entries by name, a directory's name compared as if it ended in "/"
        entries.append((child.name + ("/" if is_dir else ""), mode, child.name, oid))
    if not entries:
        return None
    body = b"".join(f"{mode} {name}\0".encode() + bytes.fromhex(oid) for _, mode, name, oid in sorted(entries))
    return _object("tree", body)


def _glob(pattern: str) -> re.Pattern:
    """A GPU_PATHS glob as `Path.glob` reads it: `*` within a name, `**/` any folders (none too)."""
    parts = re.split(r"(\*\*/|\*|\?)", pattern)
    return re.compile("".join({"**/": "(?:[^/]+/)*", "*": "[^/]*", "?": "[^/]"}.get(p, re.escape(p)) for p in parts))


def gpu_paths(root: Path = ROOT) -> list[str]:
    out = []
    for pattern in GPU_PATHS:
        out += sorted(p.relative_to(root).as_posix() for p in root.glob(pattern)) if "*" in pattern else [pattern]
    return out


def ids_from_files(root: Path = ROOT) -> dict[str, str]:
    """Object id of every GPU path, computed from the files on disk (no git needed)."""
    rules = _ignore_rules(root)
    out = {}
    for rel in gpu_paths(root):
        path = root / rel
        out[rel] = _tree(root, rel, rules) if path.is_dir() else _object("blob", path.read_bytes())
    return out


def _git(*args: str, root: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout.strip()


def ids_at_head(root: Path = ROOT) -> dict[str, str]:
    """Object id of every GPU path at HEAD, as `git rev-parse HEAD:PATH` prints it."""
    committed = _git("ls-tree", "-r", "--name-only", "HEAD", root=root).splitlines()
    out = {}
    for pattern in GPU_PATHS:
        for rel in sorted(p for p in committed if _glob(pattern).fullmatch(p)) if "*" in pattern else [pattern]:
            try:
                out[rel] = _git("rev-parse", f"HEAD:{rel}", root=root)
            except subprocess.CalledProcessError:
                out[rel] = "(not committed)"
    return out


# ------------------------------------------------------------ commands

@functools.cache
def _gpu_test_files() -> tuple[str, ...]:
    """The test files that hold GPU tests, in order, as pytest collects them."""
    listed = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "--collect-only",
                             "-q", "tests"], cwd=ROOT, capture_output=True, text=True).stdout
    return tuple(sorted({line.split("::")[0] for line in listed.splitlines() if "::" in line}))


def part_files(part: int, parts: int) -> list[str]:
    """The test files of part `part` of `parts` (1-based): of the files that hold GPU tests, every `parts`th
    from the `part`th."""
    return list(_gpu_test_files()[part - 1::parts])


def run(out: Path, part: tuple[int, int] = (1, 1)) -> int:
    """On the GPU machine: stamp the tree, run the GPU suite (or part `part` = (K, N) of it), write
    OUT/gpu-run.json (gpu-run-K-of-N.json) and the log."""
    import torch  # only here: the GPU machine has it

    if not torch.cuda.is_available():
        print("error: no CUDA device here: run this on the GPU machine", file=sys.stderr)
        return 1
    k, n = part
    suite = SUITE if n == 1 else [*SUITE[:-1], *part_files(k, n)]
    stamp = {"ids": ids_from_files(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
             "command": "python3 " + " ".join(SUITE), "part": [k, n]}
    if n > 1:
        stamp["files"] = suite[len(SUITE) - 1:]
    name = "gpu-run.json" if n == 1 else f"gpu-run-{k}-of-{n}.json"
    out.mkdir(parents=True, exist_ok=True)
    summary = None
    with open(out / ("gpu-tests.log" if n == 1 else f"gpu-tests-{k}-of-{n}.log"), "w") as log:
        proc = subprocess.Popen([sys.executable, *suite], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
            m = SUMMARY.match(line.strip())
            if m:
                summary = m.group(1)
        rc = proc.wait()
    if ids_from_files() != stamp["ids"]:
        print("error: files under the GPU paths changed during the run", file=sys.stderr)
        return 1
    stamp.update(summary=summary, exit_code=rc)
    (out / name).write_text(json.dumps(stamp, indent=2) + "\n")
    print(f"stamped: {summary} (exit {rc}) -> {out / name}")
    return rc


def _passed(summary: str | None, exit_code: int | None) -> bool:
    return bool(summary) and exit_code == 0 and "passed" in summary and not re.search(r"\b(failed|errors?)\b", summary)


def _joined(paths: list[Path]) -> tuple[dict | None, str]:
    """One stamp of the parts' stamps (module doc), or (None, why they do not make a whole run)."""
    stamps = [json.loads(Path(p).read_text()) for p in paths]
    parts = [tuple(s.get("part", (1, 1))) for s in stamps]
    n = parts[0][1]
    if sorted(parts) != [(k, n) for k in range(1, n + 1)]:
        got = ", ".join(f"{k}/{m}" for k, m in parts)
        return None, f"the stamps are parts {got}: give every part of one run, 1/{n} to {n}/{n}, once each"
    odd = [str(p) for p, s in zip(paths, stamps) if (s["ids"], s["device"], s["torch"]) !=
           (stamps[0]["ids"], stamps[0]["device"], stamps[0]["torch"])]
    if odd:
        return None, f"{', '.join(odd)}: not a run of the same code on the same device and torch as {paths[0]}"
    failed = next((s for s in stamps if not _passed(s.get("summary"), s.get("exit_code"))), None)
    joined = dict(stamps[0], summary="; ".join(f"part {s['part'][0]}/{n}: {s['summary']}" for s in stamps)
                  if n > 1 else stamps[0].get("summary"), exit_code=max(s.get("exit_code") or 0 for s in stamps))
    if failed is not None:
        joined.update(summary=failed.get("summary"), exit_code=failed.get("exit_code"))
    if n > 1:
        joined["command"] = f"{stamps[0]['command']}, in {n} parts by file (gpu_record.py run --part K/{n})"
    return joined, ""


def write(stamp_path: Path | list[Path], root: Path = ROOT) -> int:
    """Here: check a device stamp (or every part's) against HEAD and the working tree, then write RECORD."""
    paths = stamp_path if isinstance(stamp_path, list) else [stamp_path]
    stamp, why = _joined(paths)
    stamp_path = ", ".join(map(str, paths))
    if stamp is None:
        print(f"error: {why}", file=sys.stderr)
        return 1
    if not _passed(stamp.get("summary"), stamp.get("exit_code")):
        print(f"error: {stamp_path}: the GPU run did not pass ({stamp.get('summary')}, exit {stamp.get('exit_code')}); "
              "fix the failures and run it again", file=sys.stderr)
        return 1
    head, files = ids_at_head(root), ids_from_files(root)
    problems = [f"{p}: the run tested {stamp['ids'].get(p, '(absent)')}, HEAD has {head.get(p, '(absent)')}"
                for p in sorted(set(head) | set(stamp["ids"])) if head.get(p) != stamp["ids"].get(p)]
    problems += [f"{p}: uncommitted changes" for p in sorted(files) if files[p] != head.get(p)]
    if problems:
        print(f"error: {stamp_path} is not a run of the committed GPU code; commit first, then run the GPU suite "
              "on the device again:\n" + "\n".join(f"  - {p}" for p in problems), file=sys.stderr)
        return 1
    record = {"device": stamp["device"], "torch": stamp["torch"], "command": stamp["command"],
              "summary": stamp["summary"], "ids": stamp["ids"]}
    path = root / RECORD
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".gpu-run.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(record, indent=2) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    print(f"wrote {RECORD}: {record['summary']} on {record['device']}; commit it")
    return 0


def check(root: Path = ROOT) -> int:
    """CI: exit 1 unless RECORD is a passing GPU run of exactly HEAD's GPU paths."""
    how = ("Run the GPU suite on the GPU machine: `python3 .ci/gpu_record.py run --out $OUT` in a copy of this tree; "
           "then here `python3 .ci/gpu_record.py write $OUT/gpu-run.json` and commit .ci/gpu-run.json. "
           "GPU code that could not run on a GPU must not land: revert it or keep it on a branch.")
    path = root / RECORD
    if not path.is_file():
        print(f"error: no record of a GPU run ({RECORD}). {how}", file=sys.stderr)
        return 1
    record = json.loads(path.read_text())
    head = ids_at_head(root)
    changed = [f"{p} (recorded {record['ids'].get(p, 'nothing')}, HEAD {head.get(p, 'nothing')})"
               for p in sorted(set(head) | set(record["ids"])) if head.get(p) != record["ids"].get(p)]
    if changed:
        print("error: GPU code changed since the last recorded GPU run:\n" + "\n".join(f"  - {c}" for c in changed)
              + f"\n{how}", file=sys.stderr)
        return 1
    if not _passed(record.get("summary"), 0):
        print(f"error: the recorded GPU run did not pass: {record.get('summary')}. {how}", file=sys.stderr)
        return 1
    print(f"GPU record matches HEAD: {record['summary']} on {record['device']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="on the GPU machine: run the GPU suite and stamp it")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-run")))
    p.add_argument("--part", default="1/1", help="K/N: the Kth of N parts of the suite, by file (default: all)")
    p = sub.add_parser("write", help="write the record from a device stamp (gpu-run.json), or every part's")
    p.add_argument("stamp", type=Path, nargs="+")
    sub.add_parser("check", help="CI: fail if the GPU paths changed since the record")
    sub.add_parser("ids", help="print the object ids computed from the files")
    args = ap.parse_args(argv)
    if args.command == "run":
        k, _, n = args.part.partition("/")
        if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
            ap.error(f"--part {args.part}: expected K/N with 1 <= K <= N, for example 1/2")
        return run(args.out, (int(k), int(n)))
    if args.command == "write":
        return write(list(args.stamp))
    if args.command == "ids":
        print(json.dumps(ids_from_files(), indent=2))
        return 0
    return check()


if __name__ == "__main__":
    sys.exit(main())
