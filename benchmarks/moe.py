"""MoE decode with experts in pinned host memory, against honest all-GPU baselines and the link floor.

    python benchmarks/moe.py --layers 16 --out benchmarks/results     # on the H100
    python benchmarks/moe.py --model tiny --device cpu --out /tmp/r    # smoke test, any machine

Qwen3-30B-A3B's shape (128 experts, top-8; `--layers` of its 48 layers, so the
checkpoint fits the disk; every per-layer figure is the real one), random bf16
weights saved as a sharded safetensors checkpoint. One run measures:

1. the hardware (`runtime.calibrate`): the UVA read bandwidth sets the floor;
2. all on the GPU, per transformers experts implementation (`--baselines`:
   `batched_mm`, `grouped_mm`, and `eager`, transformers' default loop over
   experts): eager HF `generate` and CUDA-graph replay of a static-cache decode
   step (`--modes`; the eager loop syncs on the host and cannot be captured);
3. every expert in pinned host memory (a rule puts `experts` on uva), read
   through offplan's experts implementation (runtime/experts.py), and, for
   comparison, the same placement read by transformers' `batched_mm`;
4. the floor per batch: the bytes of the unique experts that routing touches
   in a decode step (counted in an untimed pass over the same prompts), over
   the UVA read bandwidth of step 1. Nothing can read them faster.

Every decode is greedy over the same prompts; its tokens are compared with the
all-GPU model's under the same arithmetic, in the same mode: offplan's experts
implementation reproduces batched_mm at batch 1 and grouped_mm from batch 2 on
(runtime/experts.py `arithmetic`). Records go
to OUT/moe-MODEL.jsonl as they are measured; the table is printed last.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import decode  # the sibling benchmark: checkpoints, prompts, plans, decode loops
from runtime.experts import arithmetic
from planner.checkpoint import open_checkpoint
from planner.hardware import H100, dumps_hardware, load_hardware

EXPERTS_HOST = "rules:\n  - {match: [experts], place: uva}\n"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=["qwen3-30b-a3b", "tiny"])
    ap.add_argument("--layers", type=int, help="decoder layers (default: the real count)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/offplan-bench"), help="where checkpoints go")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--modes", nargs="+", default=["graph", "eager"], choices=["graph", "eager"])
    ap.add_argument("--baselines", nargs="+", default=["batched_mm", "grouped_mm", "eager"])
    ap.add_argument("--hardware", type=Path, help="a `plan calibrate` profile to use instead of calibrating now")
    return ap.parse_args(argv)


def touched_experts(model, ids: torch.Tensor, batch: int, new: int) -> float:
    """Mean unique experts per MoE layer per decode step, counted in an untimed eager pass."""
    from runtime.experts import supports
    counts: list[int] = []

    def count(module, args):
        if args[1].shape[0] == batch:  # one token per sequence: a decode step, not a prefill
            counts.append(args[1].unique().numel())
    hooks = [m.register_forward_pre_hook(count) for m in model.modules() if supports(m)]
    try:
        decode.decode(model, ids, batch, new, ids.device)
    finally:
        for h in hooks:
            h.remove()
    return statistics.fmean(counts)


class Run:
    """One run: the checkpoint, the hardware measured now, the references and the records."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.cuda = args.device == "cuda"
        args.out.mkdir(parents=True, exist_ok=True)
        self.log = args.out / f"moe-{args.model}.jsonl"
        self.log.write_text("")
        self.work = args.dir / f"moe-{args.model}"
        self.work.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        self.ckpt = decode.make_checkpoint(args.model, args.layers, self.work / "ckpt", args.device)
        self.info = open_checkpoint(self.ckpt)
        self.record(kind="checkpoint", model=args.model, tensors=len(self.info.tensors), bytes=self.info.total_bytes,
                    seconds=round(time.perf_counter() - t, 1),
                    device=torch.cuda.get_device_name() if self.cuda else "cpu", torch=torch.__version__)
        if args.hardware:
            self.hw = load_hardware(args.hardware)
        elif self.cuda:
            from runtime.calibrate import calibrate
            self.hw = calibrate().hardware
        else:
            self.hw = H100
        (self.work / "hw.yaml").write_text(dumps_hardware(self.hw))
        self.record(kind="hardware", **self.hw.__dict__)
        config = decode.config_for(args.model, args.layers)
        self.layers = config.num_hidden_layers
        self.expert_bytes = 3 * config.moe_intermediate_size * config.hidden_size * 2  # gate, up, down in bf16
        self.ids = decode.prompts(config.vocab_size, args.device)
        self.top_k = config.num_experts_per_tok
        self.reference: dict = {}  # (implementation, mode, batch) -> all-GPU tokens
        self.best_gpu: dict = {}  # (mode, batch) -> the fastest all-GPU steps/s, and which implementation
        self.floor: dict = {}  # batch -> floor steps/s
        self.failures: list[str] = []

    def record(self, **r) -> None:
        with self.log.open("a") as f:
            f.write(json.dumps(r) + "\n")
        print(json.dumps(r), flush=True)

    def plan(self, name: str, body: str) -> Path:
        text = f"format_version: 1\ncheckpoint: ckpt\nhardware: hw.yaml\n{body}"
        return decode.make_plan(self.work, name, text)

    def load(self, plan: Path, implementation: str | None):
        import runtime
        from runtime.hf import build_meta_model
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
        model = build_meta_model(self.ckpt)
        handle = runtime.load(model, plan, device=self.args.device, progress=False)
        if implementation is not None:
            model.set_experts_implementation(implementation)
        return model, handle

    def decode(self, model, handle, mode: str, batch: int) -> tuple[float, list]:
        if mode == "graph":
            return decode.decode_static(model, handle, self.ids, self.args.new_tokens, "graph", batch)
        return decode.decode(model, self.ids, batch, self.args.new_tokens, self.args.device)

    def measure(self, name: str, plan: Path, implementation: str | None, modes: list[str], offloaded: bool) -> None:
        model, handle = self.load(plan, implementation)
        used = model.config._experts_implementation
        try:
            for mode in modes:
                if mode == "graph" and (not self.cuda or used == "eager"):
                    continue  # the eager loop syncs on the host: it cannot be captured
                for b in self.args.batches:
                    rate, tokens = self.decode(model, handle, mode, b)
                    key = (mode, b)
                    if not offloaded:
                        self.reference[(used, mode, b)] = tokens
                        if rate > self.best_gpu.get(key, (0, ""))[0]:
                            self.best_gpu[key] = (rate, used)
                    like = arithmetic(b * self.top_k) if used == "offplan" else used
                    ref = self.reference.get((like, mode, b))
                    same = None if ref is None else tokens == ref
                    if same is False and used != "eager":
                        self.failures.append(f"{name} {mode} b={b}")
                    floor = self.floor.get(b)
                    best = self.best_gpu.get(key, (None, None))
                    self.record(kind="decode", name=name, implementation=used, mode=mode, batch=b, steps_per_s=rate,
                                offloaded=offloaded, floor_steps_per_s=floor if offloaded else None,
                                ratio_to_floor=rate / floor if offloaded and floor else None,
                                best_gpu_steps_per_s=best[0], best_gpu_implementation=best[1],
                                ratio_to_best_gpu=rate / best[0] if best[0] else None, same_tokens_as=like,
                                same_tokens=same)
        finally:
            handle.remove(restore=False)
            del model, handle

    def measure_floor(self, plan: Path) -> None:
        model, handle = self.load(plan, "batched_mm")
        try:
            for b in self.args.batches:
                unique = touched_experts(model, self.ids, b, self.args.new_tokens)
                nbytes = unique * self.layers * self.expert_bytes
                self.floor[b] = self.hw.uva_read_gbps * 1e9 / nbytes
                self.record(kind="floor", batch=b, unique_experts_per_layer=unique, bytes_per_step=nbytes,
                            uva_read_gbps=self.hw.uva_read_gbps, floor_steps_per_s=self.floor[b])
        finally:
            handle.remove(restore=False)


def main(argv=None) -> int:
    args = parse_args(argv)
    run = Run(args)
    gpu = run.plan("gpu", "")
    host = run.plan("experts-host", EXPERTS_HOST)
    run.measure_floor(gpu)
    for implementation in args.baselines:
        run.measure(f"gpu-{implementation}", gpu, implementation, args.modes, offloaded=False)
    run.measure("experts-host-offplan", host, None, args.modes, offloaded=True)
    run.measure("experts-host-batched_mm", host, "batched_mm", args.modes, offloaded=True)
    rows = [json.loads(line) for line in run.log.read_text().splitlines()]
    print("\n| run | implementation | mode | batch | steps/s | x floor | x best all-GPU | tokens equal |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["kind"] == "decode":
            def f(x, spec=".2f"):
                return "-" if x is None else format(x, spec)
            print(f"| {r['name']} | {r['implementation']} | {r['mode']} | {r['batch']} | {r['steps_per_s']:.2f} | "
                  f"{f(r['ratio_to_floor'])} | {f(r['ratio_to_best_gpu'])} | {r['same_tokens_as']}: {r['same_tokens']} |")
    if run.failures:
        print(f"FAILED: greedy tokens differ from the all-GPU model's for {', '.join(run.failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
