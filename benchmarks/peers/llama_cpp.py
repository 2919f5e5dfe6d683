"""llama.cpp's side of benchmarks/peers.py: its benchmark tools run as a user runs them, each row with its command
line, and the GGUF writer (peers/to_gguf.py) found where it lies."""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

GPU_BUFFER = re.compile(r"(CUDA\d+) (model|compute) buffer size\s*=\s*([\d.]+) MiB")


def gguf_writer(bin_dir: Path | None):
    """peers/to_gguf.py's `write_gguf`. It needs the `gguf` package (llama.cpp's gguf-py): installed (the `test`
    extra), or else from the source beside a build.sh build (`BUILD/bin` -> `BUILD/source/gguf-py`)."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        source = None if bin_dir is None else bin_dir.resolve().parent / "source" / "gguf-py"
        if source is None or not source.is_dir():
            raise SystemExit("the gguf package is missing: pip install 'gguf>=0.19,<0.20' (the test extra), or give "
                             "--build or the --llama-cpp folder of a peers/build.sh build (its source has gguf-py)")
        sys.path.insert(0, str(source))
    from to_gguf import write_gguf
    return write_gguf


class LlamaCpp:
    """llama.cpp's benchmarks, run as a user runs them; each row keeps its command line."""

    def __init__(self, bin_dir: Path, threads: int, cuda: bool):
        self.bin, self.threads, self.cuda = bin_dir, threads, cuda

    def _gpu(self, cpu_moe: int) -> list[str]:
        return ["-ngl", "99", "--n-cpu-moe", str(cpu_moe)] if self.cuda else ["-ngl", "0"]

    def build_facts(self, gguf: Path) -> dict:
        """The build's commit, backends and flash attention, from one short run; a build without CUDA on a GPU
        machine is refused (its -ngl would be ignored, and its rows would be the CPU's)."""
        rows, _, _ = self._run("llama-bench", ["-m", str(gguf), *self._gpu(0), "-p", "0", "-n", "1", "-r", "1",
                                               "-o", "jsonl"])
        facts = {k: rows[0].get(k) for k in ("build_commit", "backends", "flash_attn", "cpu_info", "gpu_info")}
        staged = self.bin.resolve().parent / "COMMIT"  # build.sh's: the source's commit, as stage.sh found it
        facts["source"] = staged.read_text().strip() if staged.is_file() else None
        if self.cuda and "CUDA" not in str(facts["backends"]):
            raise SystemExit(f"{self.bin}: llama.cpp built without CUDA (backends {facts['backends']!r}) on a GPU "
                             "machine: build it with CUDA (benchmarks/peers/build.sh, LLAMA_CUDA=ON)")
        return facts

    def _run(self, tool: str, args: list[str], tries: int = 1) -> tuple[list[dict], str, str]:
        """(its JSON rows, its command line, its log). `tries`: llama-batched-bench prints its rows through
        llama.cpp's logger thread, which at exit sometimes has not written them (seen at 0c1e57098, about one
        run in two): such a run is repeated."""
        cmd = [str(self.bin / tool), *args, "-t", str(self.threads)]
        for _ in range(tries):
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"{shlex.join(cmd)} failed:\n{done.stderr[-3000:]}")
            try:
                rows = [json.loads(l) for l in done.stdout.splitlines() if l.startswith("{")]
            except json.JSONDecodeError:  # a row cut short by the same logger
                rows = []
            if rows:
                break
        else:
            raise SystemExit(f"{shlex.join(cmd)} printed no result in {tries} runs:\n{done.stderr[-3000:]}")
        return rows, shlex.join([tool, *args, "-t", str(self.threads)]), done.stderr

    def bench(self, gguf: Path, cpu_moe: int, extra: list[str]) -> tuple[list[dict], str]:
        rows, cmd, _ = self._run("llama-bench", ["-m", str(gguf), *self._gpu(cpu_moe), "-o", "jsonl", *extra])
        return rows, cmd

    def batched(self, gguf: Path, cpu_moe: int, batch: int, new: int) -> tuple[float, str]:
        """Decode steps per second of `batch` sequences (text-generation tokens/s over the batch)."""
        rows, cmd, _ = self._run("llama-batched-bench", [
            "-m", str(gguf), *self._gpu(cpu_moe), "-c", str(batch * (16 + new) + 64), "-npp", "16", "-ntg", str(new),
            "-npl", str(batch), "--output-format", "jsonl"], tries=8)
        return rows[-1]["speed_tg"] / batch, cmd

    def gpu_bytes(self, gguf: Path, cpu_moe: int, prompt: int) -> dict[str, int] | None:
        """The bytes llama.cpp's log says it holds in GPU memory at `--n-cpu-moe cpu_moe` to process a `prompt`-token
        prompt (its default micro-batch, 512), by buffer: "model" (its weights) and "compute" (activations, and the
        copies of host experts that op offload makes at prefill); each buffer's largest (a context's buffers are
        logged again by each context made), summed over the GPUs. The KV cache is left out."""
        if not self.cuda:
            return None
        _, _, log = self._run("llama-bench", ["-m", str(gguf), "-ngl", "99", "--n-cpu-moe", str(cpu_moe), "-p",
                                              str(prompt), "-n", "0", "-r", "1", "-v", "-o", "jsonl"])
        largest: dict[tuple[str, str], int] = {}
        for gpu, kind, mib in GPU_BUFFER.findall(log):
            largest[gpu, kind] = max(largest.get((gpu, kind), 0), round(float(mib) * 2**20))
        sizes = {}
        for (_, kind), size in largest.items():
            sizes[kind] = sizes.get(kind, 0) + size
        return sizes if "model" in sizes else None
