"""Side by side with llama.cpp, in one run, on the same weights: the tool people pick for MoE offload.

    benchmarks/peers/stage.sh                                   # here: llama.cpp's source into .peers/ (carry it)
    python benchmarks/peers.py --layers 8 --build               # on the GPU machine: build llama.cpp, then measure
    python benchmarks/peers.py --layers 8 --llama-cpp DIR       # with llama-bench and llama-batched-bench in DIR
    python benchmarks/peers.py --model tiny --layers 2 --device cpu --llama-cpp DIR --out /tmp/r   # smoke test

One checkpoint (harness/checkpoints.py: random bf16 in Qwen3-30B-A3B's shape, `--layers` of its 48), written once
more as GGUF for llama.cpp (peers/to_gguf.py: the same weights under llama.cpp's names, BF16; and Q8_0 for the
8-bit rows) and once more as block-scaled FP8 for offplan's 8-bit rows (tests/quantized_models.py). Rows, each
with its command line (llama.cpp) or plan (offplan) and its thread count:

1. every routed expert off the GPU: llama.cpp `-ngl 99 --n-cpu-moe L` (the host's cores compute them) against offplan
   with every expert on uva (the GPU reads them over the link); decode at batch 1 (`llama-bench -n`) and batch 8
   (`llama-batched-bench -npl 8`, its text-generation rate over 8: steps/s), prefill of each `--prompts` length at
   llama.cpp's default micro-batch (512) and at 2048 (`-ub`), offplan's time to first token; and, at batch 1 and 8,
   offplan splitting the experts between the host's cores and the link as its plan chooses (`backend: mixed`,
   `cpu_experts: true`, the all-uva plan's GPU footprint as the budget, one plan per batch);
2. equal GPU memory: `--n-cpu-moe N` for each `--n-cpu-moe` N, against an offplan `backend: mixed` plan whose budget
   is the GPU bytes llama.cpp's own log reports for its model buffer at that N ("CUDA0 model buffer size"), with
   `cpu_experts: true` (llama.cpp's cores compute what it keeps off the GPU: the plan may use them); decode, batch 1;
3. 8 bits: llama.cpp Q8_0 against offplan's FP8 checkpoint, every expert off the GPU, decode at batch 1;
4. all on the GPU, both (`--n-cpu-moe 0`; offplan's all-GPU plan): the engines' own speed.

offplan decodes through the runtime's generation (each step replayed from a CUDA graph on a GPU, as `plan apply`
runs), greedy, `--new-tokens` steps after a 16-token prompt (batch 8: 8 distinct prompts); llama.cpp draws its
own token ids (the GGUF has no tokenizer). Ratios: offplan over llama.cpp, row by row. Without a llama.cpp build
(no `--llama-cpp`, no `--build`) the llama.cpp rows are skipped, saying why, and no GGUF is written. Records go to
OUT/peers-MODEL.jsonl, a table is printed last (benchmarks/reporting/peers.py puts it in RESULTS.md).

The GGUF writer needs llama.cpp's `gguf` package: installed (the `test` extra), or else from the source that build.sh
unpacked beside its `bin` (`--build`, or `--llama-cpp BUILD/bin`), as on the GPU machine (no registry there).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

from harness.checkpoints import config_for, make_checkpoint
from harness.loops import prompts
from front_door import EXPERTS_UVA
from harness.plans import make_plan
from reporting.peers import rows_table
from planner.inputs.hardware import H100, dumps_hardware
from planner.planfile import loads

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "peers"))
sys.path.insert(0, str(HERE.parent / "tests"))
from quantized_models import write_fp8  # noqa: E402  (the published FP8 layout's writer)

GPU_BUFFER = re.compile(r"CUDA\d+ model buffer size\s*=\s*([\d.]+) MiB")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=["qwen3-30b-a3b", "tiny"])
    ap.add_argument("--layers", type=int, default=8, help="decoder layers (default: 8)")
    ap.add_argument("--llama-cpp", type=Path, help="the folder of llama-bench and llama-batched-bench")
    ap.add_argument("--build", action="store_true", help="build llama.cpp from .peers/ first (peers/build.sh)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp's threads (default: all)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, nargs="+", default=[2048, 8192], help="prefill lengths")
    ap.add_argument("--n-cpu-moe", type=int, nargs="+", help="equal-memory rows' N (default: L/4, L/2, 3L/4)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/offplan-peers"), help="checkpoints, GGUFs and plans")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    return ap.parse_args(argv)


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

    def gpu_bytes(self, gguf: Path, cpu_moe: int) -> int | None:
        """The bytes llama.cpp's log says it put in GPU memory for the model at `--n-cpu-moe cpu_moe`."""
        if not self.cuda:
            return None
        _, _, log = self._run("llama-bench", ["-m", str(gguf), "-ngl", "99", "--n-cpu-moe", str(cpu_moe), "-p", "0",
                                              "-n", "1", "-r", "1", "-v", "-o", "jsonl"])
        sizes = [float(m) for m in GPU_BUFFER.findall(log)]
        return round(sum(sizes) * 2**20) if sizes else None


class Offplan:
    """offplan's rows: one load per plan, the runtime's generation."""

    def __init__(self, device: str, vocab: int):
        self.device, self.vocab = device, vocab

    def measure(self, plan: Path, batches: list[int], new: int, prefill: list[int]) -> dict:
        from runtime.hf import from_pretrained
        model, handle = from_pretrained(plan, device=self.device, progress=False)
        out = {}
        try:
            ids = prompts(self.vocab, self.device)
            for b in batches:
                gen = handle.generator()
                gen.prepare(ids[:b], new + 1)
                out["decode", b] = gen(ids[:b], new + 1).decode_tokens_per_s
            g = torch.Generator().manual_seed(7)
            for t in prefill:
                x = torch.randint(3, self.vocab, (1, t), generator=g).to(self.device)
                handle.generate(x, 1)  # warm-up: the prefill's staging, allocations
                start = time.perf_counter()
                got = handle.generate(x, 1)
                out["prefill", t] = t / got.ttft_s, time.perf_counter() - start
        finally:
            handle.remove(restore=False)
            del model, handle
            if self.device == "cuda":
                torch.cuda.empty_cache()
        return out


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = args.device == "cuda"
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / f"peers-{args.model}.jsonl"
    log.write_text("")

    def record(**r) -> None:
        with log.open("a") as f:
            f.write(json.dumps(r) + "\n")
        print(json.dumps(r), flush=True)
    shape = "tiny-128" if args.model == "tiny" else args.model
    config = config_for(shape, args.layers)
    work = args.dir / f"{shape}-{config.num_hidden_layers}layers"  # a checkpoint of another shape is not reused
    work.mkdir(parents=True, exist_ok=True)
    layers = config.num_hidden_layers
    start = time.perf_counter()
    llama = None
    if args.build:  # first: the build's source holds the gguf writer, where the package is not installed
        built = subprocess.run(["bash", str(HERE / "peers" / "build.sh")], capture_output=True, text=True,
                               cwd=HERE.parent)
        if built.returncode != 0:
            raise SystemExit(f"peers/build.sh failed:\n{built.stderr[-3000:]}")
        args.llama_cpp = HERE.parent / built.stdout.strip().splitlines()[-1]  # relative to the root it ran in
    if args.llama_cpp is not None:
        llama = LlamaCpp(args.llama_cpp, args.threads, cuda)
    ckpt = make_checkpoint(shape, args.layers, work / "ckpt", args.device)
    if not (work / "fp8" / "model.safetensors.index.json").is_file():
        write_fp8(ckpt, work / "fp8", device=args.device)
    ggufs = {kind: work / f"model-{kind}.gguf" for kind in ("bf16", "q8_0")}
    for kind, path in ggufs.items() if llama else ():  # without llama.cpp, no GGUF
        if not path.is_file():
            gguf_writer(args.llama_cpp)(ckpt, path, kind, device=args.device)
    if cuda:  # the budget plans are planned with this machine's figures, as front_door.py's
        from runtime.measure.calibrate import calibrate
        (work / "hw.yaml").write_text(dumps_hardware(calibrate().hardware))
    else:
        (work / "hw.yaml").write_text(dumps_hardware(H100))
    record(kind="run", model=args.model, layers=layers, device=torch.cuda.get_device_name() if cuda else "cpu",
           torch=torch.__version__, threads=args.threads, setup_seconds=round(time.perf_counter() - start, 1),
           llama_cpp=llama.build_facts(ggufs["bf16"]) if llama else None, new_tokens=args.new_tokens)
    if llama is None:
        record(kind="skipped", what="llama.cpp rows", why="no llama.cpp build: give --llama-cpp DIR or --build")
    ours = Offplan(args.device, config.vocab_size)
    new = args.new_tokens

    def plan(name: str, body: str, checkpoint: str = "ckpt") -> Path:
        return make_plan(work, name, f"format_version: 1\ncheckpoint: {checkpoint}\nhardware: hw.yaml\n{body}")

    def row(what: str, batch_or_tokens: int, offplan_rate: float | None, llama_rate: float | None, **extra):
        record(kind="row", what=what, n=batch_or_tokens, offplan=offplan_rate, llama_cpp=llama_rate,
               ratio=offplan_rate / llama_rate if offplan_rate and llama_rate else None, **extra)

    off = ours.measure(plan("experts-uva", EXPERTS_UVA), [1, 8], new, args.prompts)  # 1. every expert off the GPU
    lc1, lc8, cmds = None, None, {}
    if llama:
        rows, cmds["decode"] = llama.bench(ggufs["bf16"], layers, ["-p", "0", "-n", str(new)])
        lc1 = rows[0]["avg_ts"]
        lc8, cmds["batched"] = llama.batched(ggufs["bf16"], layers, 8, new)
    row("experts off the GPU: decode steps/s", 1, off["decode", 1], lc1, plan="experts-uva (uva, graph)",
        command=cmds.get("decode"))
    row("experts off the GPU: decode steps/s", 8, off["decode", 8], lc8, plan="experts-uva (uva, graph)",
        command=cmds.get("batched"))
    budget = loads(plan("experts-uva", EXPERTS_UVA).read_text()).summary.gpu_footprint_bytes / 2**30
    for b, lc in ((1, lc1), (8, lc8)):  # the split: the plan's, at the all-uva plan's footprint, per batch
        p = plan(f"experts-split-b{b}", f"backend: mixed\ncpu_experts: true\nbudget_gib: {budget!r}\nworkload: "
                                       f"{{cuda_graphs: true, batch_size: {b}}}\n")
        row("experts off the GPU, split by the plan between the host's cores and the link: decode steps/s", b,
            ours.measure(p, [b], new, [])["decode", b], lc, plan=f"experts-split-b{b} (mixed, cpu_experts)",
            command=cmds.get("decode" if b == 1 else "batched"), cpu_bytes=loads(p.read_text()).summary.cpu_bytes)
    for t in args.prompts:
        by_ub = {}
        if llama:
            for ub in (512, 2048):
                rows, cmd = llama.bench(ggufs["bf16"], layers, ["-p", str(t), "-n", "0", "-b", str(max(t, 2048)),
                                                                "-ub", str(ub)])
                by_ub[ub] = rows[0]["avg_ts"], cmd
        for ub in (512, 2048):
            rate, cmd = by_ub.get(ub, (None, None))
            row(f"experts off the GPU: prefill tokens/s, llama.cpp -ub {ub}", t, off["prefill", t][0], rate,
                plan="experts-uva", command=cmd)
    for n in args.n_cpu_moe or sorted({max(1, layers // 4), layers // 2, 3 * layers // 4}):  # 2. equal GPU memory
        gpu_bytes = llama.gpu_bytes(ggufs["bf16"], n) if llama else None
        if gpu_bytes is None:
            record(kind="skipped", what=f"equal GPU memory at --n-cpu-moe {n}",
                   why="no GPU byte count from llama.cpp (no build, or no CUDA)")
            continue
        p = plan(f"budget-{n}", f"backend: mixed\ncpu_experts: true\nbudget_gib: {gpu_bytes / 2**30!r}\n"
                                "workload: {cuda_graphs: true}\n")
        rate = ours.measure(p, [1], new, [])["decode", 1]
        rows, cmd = llama.bench(ggufs["bf16"], n, ["-p", "0", "-n", str(new)])
        row("equal GPU memory: decode steps/s", 1, rate, rows[0]["avg_ts"], n_cpu_moe=n, gpu_bytes=gpu_bytes,
            plan=f"budget-{n} (mixed, cpu_experts, {gpu_bytes / 2**30:.2f} GiB)", command=cmd,
            cpu_bytes=loads(p.read_text()).summary.cpu_bytes)
    # 3. 8 bits, 4. all on the GPU
    for what, name, body, checkpoint, gguf, cpu_moe in (
            ("8 bits, experts off the GPU: decode steps/s (offplan FP8, llama.cpp Q8_0)", "fp8-experts-uva",
             EXPERTS_UVA, "fp8", ggufs["q8_0"], layers),
            ("all on the GPU: decode steps/s", "gpu", "", "ckpt", ggufs["bf16"], 0)):
        rate = ours.measure(plan(name, body, checkpoint), [1], new, [])["decode", 1]
        lc, cmd = None, None
        if llama:
            rows, cmd = llama.bench(gguf, cpu_moe, ["-p", "0", "-n", str(new)])
            lc = rows[0]["avg_ts"]
        row(what, 1, rate, lc, plan=name, command=cmd)
    print("\n" + "\n".join(rows_table([json.loads(l) for l in log.read_text().splitlines()])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
