r"""MoE decode with experts in pinned host memory, against honest all-GPU baselines and the link floor.

    python benchmarks/moe.py --layers 8                               # on the H100 (benchmarks/RESULTS.md)
    python benchmarks/moe.py --layers 8 --modes graph --baselines batched_mm grouped_mm \
        --host-implementations offplan --skew 0.7 --resident 0.25 0.5 --budget-batches 1 8
    python benchmarks/moe.py --model tiny --device cpu --out /tmp/r    # smoke test, any machine

Qwen3-30B-A3B's shape (128 experts, top-8; `--layers` of its 48 layers, all of them by default: 61 GB of disk,
which the H100 machine holds; every per-layer figure is the real one), random bf16 weights saved as a sharded
safetensors checkpoint (harness/checkpoints.py `make_checkpoint`, a layer at a time). One run measures:

1. the hardware (`runtime.measure.calibrate`): the UVA read bandwidth sets the floor;
2. all on the GPU, per transformers experts implementation (`--baselines`:
   `batched_mm`, `grouped_mm`, and `eager`, transformers' default loop over
   experts), loaded by transformers alone (`--transformers-baselines`,
   `from_pretrained`) and by offplan's runtime applying a plan that offloads
   nothing; in each `--modes`: eager HF `generate`, CUDA-graph replay of a
   static-cache decode step (`graph`), and replay of the same step under
   `torch.compile` (`compiled-graph`: Inductor fuses the layers' small
   kernels, as vLLM's default compiled CUDA graphs do). The eager loop syncs
   on the host and cannot be captured;
3. every expert in pinned host memory (a rule puts `experts` on uva), read
   through offplan's experts implementation (runtime/execute/experts.py), and, for
   comparison, the same placement read by transformers' `batched_mm`;
4. the floor per batch: the bytes of the unique experts that routing touches in a decode step (counted in an
   untimed pass over the same prompts, all on the GPU with `grouped_mm`, whose arithmetic offplan reproduces above
   16 (token, expert) pairs, while one token's k experts are k in any arithmetic; its prefill holds no weight copy
   per pair, which at 48 layers and batch 32 would not fit the H100), over the UVA read bandwidth of step 1.
   Nothing can read them faster.

With `--cpu-fractions F...` (and `--cpu-threads N...`), rows with the first F of every layer's experts on cpu,
the rest on uva; with `--cpu-split`, the plan's own split at each batch (harness/host_rows.py).

With `--skew S`, every model of the run routes as real MoE models do, a few
experts taking most tokens (RouterSkew: random weights alone route uniformly),
and the run goes on to placements under a GPU budget:

5. a routing profile (`runtime.routing.record_routing`) recorded on other
   prompts than the timed ones;
6. for each `--resident` fraction F of the expert bytes kept on the GPU: a budget plan with per-expert placement
   (`backend: mixed`, the profile in `workload.routing`: the most-hit experts stay resident), the same with
   `cpu_experts: true` (the host computes some of the rest), and whole layers' experts on uva with the same GPU
   bytes (the best placement that moves whole layers: at these batches, reading a layer's touched experts in
   place moves fewer bytes than copying the whole layer). The plans are built for batch 1; the same placement's
   prediction of CUDA-graph decode (`workload.cuda_graphs`) at each `--budget-batches` batch is recorded beside
   the measurement, with the bytes actually read from pinned memory.

Every decode is greedy over the same prompts; its tokens are compared with the
all-GPU model's (transformers alone) under the same arithmetic, in the same mode: offplan's experts
implementation reproduces batched_mm at batch 1 and grouped_mm from batch 2 on
(runtime/execute/experts.py `arithmetic`). Records go to OUT/moe-MODEL.jsonl
(OUT/moe-MODEL-skewS.jsonl with `--skew`) as they are measured; the tables
are printed last.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

from harness import loops
from harness.budgets import budget_table, measure_budgets, record_profile
from harness.checkpoints import checkpoint_and_hardware, config_for
from harness.loops import prompts
from harness.host_rows import HostTiming, measure_cpu, measure_split
from harness.plans import make_plan
from harness.routers import RouterSkew, RouterSpread, touched_experts
from runtime.execute.experts import arithmetic
from runtime.execute.generation import PlainHandle

EXPERTS_HOST = "rules:\n  - {match: [experts], place: uva}\n"
REPLAYED = ("graph", "compiled-graph")  # modes that replay a captured decode step


def model_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The model, checkpoint and output options of this benchmark and its siblings (moe_kernels.py,
    moe_predict.py), which run on the same checkpoint."""
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=["qwen3-30b-a3b", "tiny"])
    ap.add_argument("--layers", type=int, help="decoder layers (default: the real count)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/offplan-bench"), help="where checkpoints go")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    ap = model_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                                 formatter_class=argparse.RawDescriptionHelpFormatter))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--modes", nargs="+", default=["graph", "compiled-graph", "eager"],
                    choices=REPLAYED + ("eager",))
    ap.add_argument("--baselines", nargs="*", default=["batched_mm", "grouped_mm", "eager"])
    ap.add_argument("--transformers-baselines", nargs="*", default=["batched_mm", "grouped_mm"],
                    help="all-GPU models loaded by transformers alone (from_pretrained), nothing of offplan's")
    ap.add_argument("--hardware", type=Path, help="a `plan calibrate` profile to use instead of calibrating now")
    ap.add_argument("--host-implementations", nargs="*", default=["offplan", "batched_mm"],
                    help="experts implementations to read every expert from pinned memory with")
    ap.add_argument("--spread", type=float, help="route each token apart, as a trained router does (RouterSpread "
                    "of this strength; 2 in RESULTS.md)")
    ap.add_argument("--skew", type=float, help="route with RouterSkew of this strength (0.7: about 45%% of the "
                    "experts take 90%% of the hits) and measure budget placements")
    ap.add_argument("--resident", type=float, nargs="+", default=[0.25, 0.5],
                    help="with --skew: fractions of the expert bytes a budget keeps on the GPU")
    ap.add_argument("--profile-prompts", type=int, default=64, help="with --skew: prompts to record routing on")
    ap.add_argument("--lookahead-ab", action="store_true", help="also every expert in pinned memory, and each "
                    "--cpu-fractions split, at batch 1 without the experts lookahead (runtime/execute/lookahead.py)")
    ap.add_argument("--cpu-fractions", type=float, nargs="*", default=[],
                    help="shares of every layer's experts on cpu, the rest on uva (module doc)")
    ap.add_argument("--cpu-threads", type=int, nargs="+", help="host threads for experts on cpu (default: the "
                    "hardware profile's cpu_threads)")
    ap.add_argument("--cpu-split", action="store_true", help="also the plan's own split of the experts between "
                    "cpu and uva at each batch (harness/host_rows.py)")
    ap.add_argument("--budget-batches", type=int, nargs="+", default=[1, 8],
                    help="with --skew: batches the budget placements decode at (and are predicted at)")
    return ap.parse_args(argv)


class Run:
    """One run: the checkpoint, the hardware measured now, the references and the records."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.cuda = args.device == "cuda"
        args.out.mkdir(parents=True, exist_ok=True)
        self.log = args.out / (f"moe-{args.model}{'' if args.skew is None else f'-skew{args.skew:g}'}"
                               f"{'' if args.spread is None else f'-spread{args.spread:g}'}.jsonl")
        self.log.write_text("")
        self.work = args.dir / f"moe-{args.model}"
        self.work.mkdir(parents=True, exist_ok=True)
        self.ckpt, self.info, self.hw = checkpoint_and_hardware(args, self.work, self.record)
        self.host_profiles: dict[int, str] = {}  # host threads -> their profile's file (harness/host_rows.py)
        config = config_for(args.model, args.layers)
        self.layers = config.num_hidden_layers
        self.expert_bytes = 3 * config.moe_intermediate_size * config.hidden_size * 2  # gate, up, down in bf16
        self.ids = prompts(config.vocab_size, args.device)
        self.top_k = config.num_experts_per_tok
        self.experts = config.num_experts
        self.vocab = config.vocab_size
        self.skew = None if args.skew is None else RouterSkew(self.ckpt, self.info, self.layers, args.skew,
                                                                 args.device)
        if self.skew is not None:
            self.record(kind="skew", strength=args.skew, seed=7)
        self.spread = None if args.spread is None else RouterSpread(
            self.layers, config.hidden_size, 4096, args.spread, args.device)
        if self.spread is not None:
            self.record(kind="spread", strength=args.spread, seed=RouterSpread.SEED)
        self.reference: dict = {}  # (implementation, mode, batch) -> all-GPU tokens
        self.best_gpu: dict = {}  # (mode, batch) -> the fastest all-GPU steps/s, and which implementation
        self.floor: dict = {}  # batch -> floor steps/s
        self.failures: list[str] = []

    def record(self, **r) -> None:
        with self.log.open("a") as f:
            f.write(json.dumps(r) + "\n")
        print(json.dumps(r), flush=True)

    def plan(self, name: str, body: str, hardware: str = "hw.yaml") -> Path:
        return make_plan(self.work, name, f"format_version: 1\ncheckpoint: ckpt\nhardware: {hardware}\n{body}")

    def load(self, plan: Path | None, implementation: str | None, lookahead: bool = True):
        """`plan` applied by offplan's runtime; None: the checkpoint loaded by transformers alone. `lookahead`
        False: without the runtime's experts lookahead (runtime/execute/lookahead.py), to measure what it gains."""
        import runtime
        from runtime.hf import build_meta_model
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
        if plan is None:
            from transformers import AutoModelForCausalLM
            model = AutoModelForCausalLM.from_pretrained(self.ckpt, dtype=torch.bfloat16,
                                                         device_map=self.args.device).eval()
            handle = PlainHandle(model)
        else:
            model = build_meta_model(self.ckpt)
            handle = runtime.load(model, plan, device=self.args.device, progress=False)
            if not lookahead and handle.lookahead is not None:
                handle.lookahead.remove()
                handle.lookahead = None
        if self.skew is not None:
            self.skew.install(model)
        if self.spread is not None:
            self.spread.install(model)
        if implementation is not None:
            model.set_experts_implementation(implementation)
        return model, handle

    def decode(self, model, handle, mode: str, batch: int, prepared=None) -> tuple[float, list]:
        if mode in REPLAYED:
            return loops.decode_static(model, handle, self.ids, self.args.new_tokens, mode, batch,
                                       prepared or (lambda: None))
        return loops.decode(model, self.ids, batch, self.args.new_tokens, self.args.device)

    def measure(self, name: str, plan: Path | None, implementation: str | None, modes: list[str], offloaded: bool,
                batches: list[int] | None = None, predicted: dict[int, float] | None = None,
                floor: bool = True, lookahead: bool = True, **extra) -> None:
        """Decode with `plan` in each mode and batch, and record it beside the all-GPU model's run and
        the floor (`floor`: every expert is in pinned memory); `predicted`: batch -> the plan's
        predicted steps/s; `extra` goes into every record."""
        model, handle = self.load(plan, implementation, lookahead)
        used = model.config._experts_implementation
        predicted = predicted or {}
        observed = {}  # batch -> bytes read from pinned memory per decode step on the timed prompts
        try:
            if "resident_fraction" in extra:
                observed = {b: touched_experts(model, self.ids, b, self.args.new_tokens)[1]
                            for b in batches or self.args.batches}
            for mode in modes:
                if mode in REPLAYED and (not self.cuda or used == "eager"):
                    continue  # the eager loop syncs on the host: it cannot be captured
                for b in batches or self.args.batches:
                    timing = HostTiming(handle)  # experts on cpu: the host's figures over the timed call
                    if timing.host is not None and mode not in REPLAYED:
                        timing.mark()
                    rate, tokens = self.decode(model, handle, mode, b, timing.mark if timing.host else None)
                    extra.update(timing.figures(b))
                    key = (mode, b)
                    if not offloaded:
                        self.reference.setdefault((used, mode, b), tokens)  # the first: transformers alone
                        if rate > self.best_gpu.get(key, (0, ""))[0]:
                            self.best_gpu[key] = (rate, used)
                    like = {"offplan": arithmetic(b * self.top_k), "offplan_grouped_mm": "grouped_mm"}.get(used, used)
                    ref = self.reference.get((like, mode, b))
                    same = None if ref is None else tokens == ref
                    if same is False and used != "eager" and timing.host is None:  # the host's GEMVs round apart
                        self.failures.append(f"{name} {mode} b={b}")
                    limit = self.floor.get(b) if offloaded and floor else None
                    best = self.best_gpu.get(key, (None, None))
                    guess = predicted.get(b) if mode in REPLAYED else None
                    self.record(kind="decode", name=name, implementation=used, mode=mode, batch=b, steps_per_s=rate,
                                offloaded=offloaded, floor_steps_per_s=limit,
                                ratio_to_floor=rate / limit if limit else None,
                                best_gpu_steps_per_s=best[0], best_gpu_implementation=best[1],
                                ratio_to_best_gpu=rate / best[0] if best[0] else None, same_tokens_as=like,
                                same_tokens=same, predicted_steps_per_s=guess,
                                ratio_to_predicted=rate / guess if guess else None,
                                **({"observed_h2d_bytes_per_step": observed[b]} if b in observed else {}), **extra)
        finally:
            handle.remove(restore=False)
            del model, handle

    def measure_floor(self, plan: Path) -> None:
        model, handle = self.load(plan, "grouped_mm")  # module doc, step 4
        try:
            for b in self.args.batches:
                unique, _ = touched_experts(model, self.ids, b, self.args.new_tokens)
                nbytes = unique * self.layers * self.expert_bytes
                self.floor[b] = self.hw.uva_read_gbps * 1e9 / nbytes
                self.record(kind="floor", batch=b, layers=self.layers, unique_experts_per_layer=unique,
                            expert_bytes=self.expert_bytes, bytes_per_step=nbytes,
                            uva_read_gbps=self.hw.uva_read_gbps, floor_steps_per_s=self.floor[b])
        finally:
            handle.remove(restore=False)

def main(argv=None) -> int:
    args = parse_args(argv)
    run = Run(args)
    gpu = run.plan("gpu", "")
    host = run.plan("experts-host", EXPERTS_HOST)
    run.measure_floor(gpu)
    if run.cuda:
        for implementation in args.transformers_baselines:
            run.measure(f"transformers-{implementation}", None, implementation, args.modes, offloaded=False)
    for implementation in args.baselines:
        run.measure(f"gpu-{implementation}", gpu, implementation, args.modes, offloaded=False)
    for implementation in args.host_implementations:
        run.measure(f"experts-host-{implementation}", host, None if implementation == "offplan" else implementation,
                    args.modes, offloaded=True)
    if args.lookahead_ab and "offplan" in args.host_implementations:
        run.measure("experts-host-offplan-no-lookahead", host, None, args.modes, offloaded=True, lookahead=False,
                    batches=[1])
    for threads, fraction in ((t, f) for t in args.cpu_threads or [None] for f in args.cpu_fractions):
        measure_cpu(run, fraction, threads)
    if args.cpu_split:
        measure_split(run, host, (args.cpu_threads or [None])[0])
    if run.skew is not None:
        measure_budgets(run, record_profile(run, gpu))
    rows = [json.loads(line) for line in run.log.read_text().splitlines()]
    print("\n| run | implementation | mode | batch | steps/s | x floor | x best all-GPU | tokens equal |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["kind"] == "decode":
            def f(x, spec=".2f"):
                return "-" if x is None else format(x, spec)
            print(f"| {r['name']} | {r['implementation']} | {r['mode']} | {r['batch']} | {r['steps_per_s']:.2f} | "
                  f"{f(r['ratio_to_floor'])} | {f(r['ratio_to_best_gpu'])} | {r['same_tokens_as']}: {r['same_tokens']} |")
    budget_table(rows)
    if run.failures:
        print(f"FAILED: greedy tokens differ from the all-GPU model's for {', '.join(run.failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
