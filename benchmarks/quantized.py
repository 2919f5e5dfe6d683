r"""FP8 experts in pinned host memory against the same model in bf16: quantized bytes over the link.

    python benchmarks/quantized.py --layers 8                              # on the H100 (benchmarks/RESULTS.md)
    python benchmarks/quantized.py --model tiny --device cpu --out /tmp/r  # smoke test, any machine

Qwen3-30B-A3B's shape (128 experts, top-8; `--layers` of its 48 layers), random
weights. One run:

1. writes a random bf16 checkpoint (harness/checkpoints.py), quantizes it to block-scaled
   FP8 as DeepSeek-V3 and Qwen3-FP8 ship it (tests/quantized_models.py: every
   `*_proj.weight` F8_E4M3 with 128 x 128 `weight_scale_inv`), and writes the
   reference: the FP8 checkpoint dequantized on the host with the same formula,
   as bf16. The reference is "the same model in bf16";
2. measures the UVA read bandwidth (`runtime.measure.calibrate`);
3. for both checkpoints, plans every routed expert on uva (the rest on the
   GPU) and all on the GPU, loads each (FP8 stays FP8 in host memory and in
   HBM; runtime/place/quant.py), and decodes greedily at batch 1: eager `generate`
   and CUDA-graph replay of a static-cache step (harness/loops.py `decode_static`);
4. the floor of each experts-on-host run: the bytes of the 8 experts a token
   touches per layer (their quantized bytes and scales for FP8) over the
   measured UVA bandwidth.

Tokens of the FP8 runs must equal the reference's in the same placement and
mode (outputs are bitwise those of the dequantized model: runtime/place/dequant.py).
Records go to OUT/quantized-MODEL.jsonl; a table is printed last.
"""
from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from harness.checkpoints import config_for, make_checkpoint
from harness.loops import decode, decode_static, prompts
from harness.plans import make_plan
from planner.inputs.checkpoint import open_checkpoint
from runtime.hf import from_pretrained

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from quantized_models import reference_dir, write_fp8  # noqa: E402  (the published-layout writers)

EXPERTS_HOST = "rules:\n  - match: [experts]\n    place: uva\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3-30b-a3b", choices=["qwen3-30b-a3b", "tiny"])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dir", type=Path, default=Path("/tmp/offplan-quantized"), help="checkpoints and plans")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    return p.parse_args(argv)


def tiny_config(layers: int):
    """The tiny model of harness/checkpoints.py with FP8-sized experts: gate and up must each fill whole 128-row
    scale blocks."""
    config = config_for("tiny", layers)
    config.hidden_size, config.moe_intermediate_size, config.head_dim = 128, 128, 32
    return config


def make_checkpoints(args, work: Path, record) -> tuple[Path, Path]:
    """(FP8 checkpoint, its dequantized bf16 reference), made once per WORK."""
    fp8, ref = work / "fp8", work / "ref"
    if not (ref / "model.safetensors.index.json").is_file():
        t = time.perf_counter()
        shutil.rmtree(fp8, ignore_errors=True)
        shutil.rmtree(ref, ignore_errors=True)
        if args.model == "tiny":
            from transformers import AutoModelForCausalLM
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(tiny_config(args.layers), dtype=torch.bfloat16).save_pretrained(
                work / "ckpt", max_shard_size="1MB")
            src = work / "ckpt"
        else:
            src = make_checkpoint(args.model, args.layers, work / "ckpt", args.device)
        write_fp8(src, fp8, device=args.device)
        shutil.rmtree(src)  # the reference is the bf16 model now; the disk holds two copies, not three
        reference_dir(fp8, ref)
        record(kind="checkpoints", seconds=round(time.perf_counter() - t, 1))
    for name, path in (("fp8", fp8), ("bf16", ref)):
        info = open_checkpoint(path)
        record(kind="checkpoint", name=name, tensors=len(info.tensors), bytes=info.total_bytes)
    return fp8, ref


def expert_bytes_per_step(path: Path, top_k: int) -> int:
    """The bytes of the experts one token touches: k experts per MoE layer, each of every projection and its scales."""
    info = open_checkpoint(path)
    per_layer: dict[str, int] = {}
    experts: dict[str, set[str]] = {}
    for name, t in info.tensors.items():
        if ".experts." in name:
            layer, _, rest = name.partition(".experts.")
            per_layer[layer] = per_layer.get(layer, 0) + t.nbytes
            experts.setdefault(layer, set()).add(rest.split(".")[0])
    return sum(b * top_k // len(experts[layer]) for layer, b in per_layer.items())


def main(argv=None) -> int:
    args = parse_args(argv)
    work = args.dir
    work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / f"quantized-{args.model}.jsonl"
    log.write_text("")

    def record(**row):
        with log.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)

    fp8, ref = make_checkpoints(args, work, record)
    cuda = args.device == "cuda"
    if cuda:
        from runtime.measure.calibrate import calibrate
        hw = calibrate().hardware
        record(kind="hardware", **hw.__dict__)
    top_k = 2 if args.model == "tiny" else 8
    uva_gbps = hw.uva_read_gbps if cuda else None
    ids = prompts(json.loads((ref / "config.json").read_text())["vocab_size"], args.device)
    modes = ["eager", "graph"] if cuda else ["eager"]
    tokens: dict[tuple[str, str], list] = {}
    speed: dict[tuple[str, str, str], float] = {}
    failures = []
    for strategy, body in (("experts-host", EXPERTS_HOST), ("gpu", "")):
        for name, path in (("bf16", ref), ("fp8", fp8)):
            plan = make_plan(work, f"{name}-{strategy}", f"format_version: 1\ncheckpoint: {path.name}\n{body}")
            model, handle = from_pretrained(plan, device=args.device, progress=False)
            floor = None
            if strategy == "experts-host" and uva_gbps:
                floor = 1e9 * uva_gbps / expert_bytes_per_step(path, top_k)  # steps/s
            for mode in modes:
                if mode == "graph":
                    steps, out = decode_static(model, handle, ids, args.new_tokens, "graph")
                else:
                    steps, out = decode(model, ids, 1, args.new_tokens, args.device)
                speed[(strategy, name, mode)] = steps
                same = None
                if name == "fp8":
                    same = out == tokens[(strategy, mode)]
                    if not same:
                        failures.append(f"{strategy} {mode}")
                else:
                    tokens[(strategy, mode)] = out
                base = speed.get((strategy, "bf16", mode))
                record(kind="decode", checkpoint=name, strategy=strategy, mode=mode, batch=1, steps_per_s=steps,
                       floor_steps_per_s=floor, ratio_to_floor=steps / floor if floor else None,
                       ratio_to_bf16=steps / base if base else None, same_tokens_as_bf16=same,
                       host_bytes=handle.stats().uva_bytes, gpu_bytes=handle.stats().gpu_bytes)
            handle.remove(restore=False)
            del model, handle
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    print("\n| placement | checkpoint | mode | steps/s | x floor | x bf16 | tokens equal to bf16 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if r["kind"] == "decode":
            def f(x):
                return "-" if x is None else f"{x:.2f}"
            print(f"| {r['strategy']} | {r['checkpoint']} | {r['mode']} | {r['steps_per_s']:.2f} | "
                  f"{f(r['ratio_to_floor'])} | {f(r['ratio_to_bf16'])} | {r['same_tokens_as_bf16']} |")
    if failures:
        print(f"FAILED: FP8 greedy tokens differ from the dequantized bf16 model's for {', '.join(failures)}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
