"""Side by side with llama.cpp, in one run, on the same weights: the tool people pick for MoE offload.

    benchmarks/peers/stage.sh                                   # here: llama.cpp's source into .peers/ (carry it)
    python benchmarks/peers.py --layers 8 --build               # on the GPU machine: build llama.cpp, then measure
    python benchmarks/peers.py --layers 8 --llama-cpp DIR       # with llama-bench and llama-batched-bench in DIR
    python benchmarks/peers.py --layers 8 --llama-cpp DIR --rows equal gpu --compiled --label a   # a part, compiled too
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
   is the GPU bytes llama.cpp's own log reports for its model and compute buffers at that N, set up to process a
   `PROMPT`-token prompt ("CUDA0 model buffer size", "CUDA0 compute buffer size"), with `cpu_experts: true`
   (llama.cpp's cores compute what it keeps off the GPU: the plan may use them) and that prompt in its workload;
   decode, batch 1. Both sides' working memory for that prompt is in: offplan's budget counts its own (the prefill's
   expert ring and gathered rows, the host engine's buffers: planner/decide/working.py), and llama.cpp's compute
   buffer holds its activations and the copies of its host experts that op offload makes at prefill. Neither counts
   the KV cache; offplan's leaves out transformers' activations too;
3. 8 bits: llama.cpp Q8_0 against offplan's FP8 checkpoint, every expert off the GPU, decode at batch 1;
4. all on the GPU, both (`--n-cpu-moe 0`; offplan's all-GPU plan): the engines' own speed.

offplan decodes through the runtime's generation (each step replayed from a CUDA graph on a GPU, as `plan apply`
runs; with `--compiled`, the batch-1 decode rows once more with the step compiled by torch.compile first, as `plan
apply --compile` runs), greedy, `--new-tokens` steps after a 16-token prompt (batch 8: 8 distinct prompts); llama.cpp
draws its own token ids (the GGUF has no tokenizer). Ratios: offplan over llama.cpp, row by row. Without a llama.cpp
build (no `--llama-cpp`, no `--build`) the llama.cpp rows are skipped, saying why, and no GGUF is written. Records go
to OUT/peers-MODEL.jsonl (peers-MODEL-LABEL.jsonl with `--label`; `--rows` picks the groups above: uva, split,
equal, 8bit, gpu), a table is printed last (benchmarks/reporting/peers.py puts it in RESULTS.md).

The GGUF writer needs llama.cpp's `gguf` package: installed (the `test` extra), or else from the source that build.sh
unpacked beside its `bin` (`--build`, or `--llama-cpp BUILD/bin`), as on the GPU machine (no registry there).
"""
from __future__ import annotations

import argparse
import json
import os
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
from llama_cpp import LlamaCpp, gguf_writer  # noqa: E402  (peers/llama_cpp.py)

ROWS = ("uva", "split", "equal", "8bit", "gpu")  # the row groups, as the module doc numbers them
PROMPT = 512  # the prompt both sides make room for in the equal-memory rows (a plan's default workload.prompt_tokens)


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
    ap.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS),
                    help="which rows (default: all): uva (every expert on uva: decode, prefill), split (the plan's "
                         "share on cpu), equal (equal GPU memory), 8bit, gpu (all on the GPU)")
    ap.add_argument("--compiled", action="store_true",
                    help="offplan's batch-1 decode rows also with the step compiled (plan apply --compile)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/offplan-peers"), help="checkpoints, GGUFs and plans")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--label", default="", help="records to OUT/peers-MODEL-LABEL.jsonl (default: peers-MODEL.jsonl)")
    return ap.parse_args(argv)


class Offplan:
    """offplan's rows: one load per plan, the runtime's generation."""

    def __init__(self, device: str, vocab: int):
        self.device, self.vocab = device, vocab

    def measure(self, plan: Path, batches: list[int], new: int, prefill: list[int], compiled: bool = False) -> dict:
        """Rates by ("decode", batch), ("decode", batch, "compiled") when `compiled` (batch 1 only) and
        ("prefill", tokens)."""
        from runtime.hf import from_pretrained
        model, handle = from_pretrained(plan, device=self.device, progress=False)
        out = {}
        try:
            ids = prompts(self.vocab, self.device)
            for b, compile in [(b, False) for b in batches] + ([(1, True)] if compiled and 1 in batches else []):
                gen = handle.generator(compile=compile)
                gen.prepare(ids[:b], new + 1)
                out[("decode", b) + (("compiled",) if compile else ())] = gen(ids[:b], new + 1).decode_tokens_per_s
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
            torch._dynamo.reset()
            if self.device == "cuda":
                torch.cuda.empty_cache()
        return out


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = args.device == "cuda"
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / f"peers-{args.model}{'-' + args.label if args.label else ''}.jsonl"
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
    if "8bit" in args.rows and not (work / "fp8" / "model.safetensors.index.json").is_file():
        write_fp8(ckpt, work / "fp8", device=args.device)
    ggufs = {kind: work / f"model-{kind}.gguf" for kind in ("bf16", "q8_0")}
    kinds = [kind for kind, rows in (("bf16", set(args.rows) - {"8bit"}), ("q8_0", {"8bit"} & set(args.rows))) if rows]
    for kind, path in ggufs.items() if llama else ():  # without llama.cpp, no GGUF; each only where a row reads it
        if kind in kinds and not path.is_file():
            gguf_writer(args.llama_cpp)(ckpt, path, kind, device=args.device)
    if cuda:  # the budget plans are planned with this machine's figures, as front_door.py's
        from runtime.measure.calibrate import calibrate
        (work / "hw.yaml").write_text(dumps_hardware(calibrate().hardware))
    else:
        (work / "hw.yaml").write_text(dumps_hardware(H100))
    record(kind="run", model=args.model, layers=layers, device=torch.cuda.get_device_name() if cuda else "cpu",
           torch=torch.__version__, threads=args.threads, setup_seconds=round(time.perf_counter() - start, 1),
           llama_cpp=llama.build_facts(ggufs[kinds[0]]) if llama else None, new_tokens=args.new_tokens)
    if llama is None:
        record(kind="skipped", what="llama.cpp rows", why="no llama.cpp build: give --llama-cpp DIR or --build")
    ours = Offplan(args.device, config.vocab_size)
    new = args.new_tokens

    def plan(name: str, body: str, checkpoint: str = "ckpt") -> Path:
        return make_plan(work, name, f"format_version: 1\ncheckpoint: {checkpoint}\nhardware: hw.yaml\n{body}")

    step = "graph" if cuda else "eager"  # how the runtime's generation runs a decode step here (generation.py)

    def row(what: str, batch_or_tokens: int, offplan_rate: float | None, llama_rate: float | None, **extra):
        record(kind="row", what=what, n=batch_or_tokens, offplan=offplan_rate, llama_cpp=llama_rate,
               ratio=offplan_rate / llama_rate if offplan_rate and llama_rate else None, **extra)

    def decode_rows(what: str, batch: int, rates: dict, llama_rate: float | None, **extra):
        """The decode row of `batch`, and at batch 1 its compiled twin where `rates` has one (`--compiled`)."""
        row(what, batch, rates["decode", batch], llama_rate, mode=step, **extra)
        if ("decode", batch, "compiled") in rates:
            row(what, batch, rates["decode", batch, "compiled"], llama_rate,
                mode="compiled-graph" if cuda else "compiled", **extra)

    compiled, groups = args.compiled, set(args.rows)
    lc1, lc8, cmds = None, None, {}
    if llama and groups & {"uva", "split"}:  # llama.cpp computing every expert on the host's cores
        rows, cmds["decode"] = llama.bench(ggufs["bf16"], layers, ["-p", "0", "-n", str(new)])
        lc1 = rows[0]["avg_ts"]
        lc8, cmds["batched"] = llama.batched(ggufs["bf16"], layers, 8, new)
    if "uva" in groups:  # 1. every expert off the GPU: offplan reads them over the link
        off = ours.measure(plan("experts-uva", EXPERTS_UVA), [1, 8], new, args.prompts, compiled)
        decode_rows("experts off the GPU: decode steps/s", 1, off, lc1, plan="experts-uva (uva)",
                    command=cmds.get("decode"))
        decode_rows("experts off the GPU: decode steps/s", 8, off, lc8, plan="experts-uva (uva)",
                    command=cmds.get("batched"))
        for t in args.prompts:
            by_ub = {}
            if llama:
                for ub in (512, 2048):
                    rows, cmd = llama.bench(ggufs["bf16"], layers, ["-p", str(t), "-n", "0", "-b",
                                                                    str(max(t, 2048)), "-ub", str(ub)])
                    by_ub[ub] = rows[0]["avg_ts"], cmd
            for ub in (512, 2048):
                rate, cmd = by_ub.get(ub, (None, None))
                row(f"experts off the GPU: prefill tokens/s, llama.cpp -ub {ub}", t, off["prefill", t][0], rate,
                    plan="experts-uva", command=cmd)
    budget = loads(plan("experts-uva", EXPERTS_UVA).read_text()).summary.gpu_footprint_bytes / 2**30
    for b, lc in ((1, lc1), (8, lc8)) if "split" in groups else ():  # the plan's split at the all-uva footprint
        p = plan(f"experts-split-b{b}", f"backend: mixed\ncpu_experts: true\nbudget_gib: {budget!r}\nworkload: "
                                       f"{{cuda_graphs: true, batch_size: {b}}}\n")
        decode_rows("experts off the GPU, split by the plan between the host's cores and the link: decode steps/s", b,
                    ours.measure(p, [b], new, [], compiled), lc, plan=f"experts-split-b{b} (mixed, cpu_experts)",
                    command=cmds.get("decode" if b == 1 else "batched"),
                    cpu_bytes=loads(p.read_text()).summary.cpu_bytes)
    equal = args.n_cpu_moe or sorted({max(1, layers // 4), layers // 2, 3 * layers // 4})
    for n in equal if "equal" in groups else ():  # 2. equal GPU memory
        buffers = llama.gpu_bytes(ggufs["bf16"], n, PROMPT) if llama else None
        if buffers is None:
            record(kind="skipped", what=f"equal GPU memory at --n-cpu-moe {n}",
                   why="no GPU byte count from llama.cpp (no build, or no CUDA)")
            continue
        gpu_bytes = sum(buffers.values())  # its weights and its working memory, as offplan's budget counts both
        p = plan(f"budget-{n}", f"backend: mixed\ncpu_experts: true\nbudget_gib: {gpu_bytes / 2**30!r}\n"
                                f"workload: {{cuda_graphs: true, prompt_tokens: {PROMPT}}}\n")
        rates = ours.measure(p, [1], new, [], compiled)
        rows, cmd = llama.bench(ggufs["bf16"], n, ["-p", "0", "-n", str(new)])
        decode_rows("equal GPU memory: decode steps/s", 1, rates, rows[0]["avg_ts"], n_cpu_moe=n,
                    gpu_bytes=gpu_bytes, gpu_model_bytes=buffers["model"], gpu_compute_bytes=buffers.get("compute", 0),
                    plan=f"budget-{n} (mixed, cpu_experts, {gpu_bytes / 2**30:.2f} GiB)", command=cmd,
                    cpu_bytes=loads(p.read_text()).summary.cpu_bytes)
    # 3. 8 bits, 4. all on the GPU
    for group, what, name, body, checkpoint, gguf, cpu_moe in (
            ("8bit", "8 bits, experts off the GPU: decode steps/s (offplan FP8, llama.cpp Q8_0)", "fp8-experts-uva",
             EXPERTS_UVA, "fp8", ggufs["q8_0"], layers),
            ("gpu", "all on the GPU: decode steps/s", "gpu", "", "ckpt", ggufs["bf16"], 0)):
        if group not in groups:
            continue
        rates = ours.measure(plan(name, body, checkpoint), [1], new, [], compiled)
        lc, cmd = None, None
        if llama:
            rows, cmd = llama.bench(gguf, cpu_moe, ["-p", "0", "-n", str(new)])
            lc = rows[0]["avg_ts"]
        decode_rows(what, 1, rates, lc, plan=name, command=cmd)
    print("\n" + "\n".join(rows_table([json.loads(l) for l in log.read_text().splitlines()])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
