"""Decode speed of offloaded models against the PCIe floor, all-on-GPU and accelerate.

    python benchmarks/decode.py --model llama-8b  --dir /tmp/bench --out results/  # on the H100
    python benchmarks/decode.py --model qwen3-30b-a3b --layers 16 --dir /tmp/bench --out results/
    python benchmarks/decode.py --model tiny --device cpu --out /tmp/r             # smoke test, any machine

For one model (random bf16 weights, real config shapes, saved as a sharded
safetensors checkpoint on local disk so the real load path is measured):

1. calibrate: pinned H2D copy, UVA GEMV and HBM GEMV bandwidths and the
   per-layer overhead, measured now, on this GPU (`runtime.measure.calibrate`); the
   profile feeds the mixed plans and the predictions;
2. all on GPU (a), then for each offloaded fraction f (25/50/75% of the
   decoder layers: layer i is offloaded iff i % g >= g - n, with g/n = 4/1,
   2/1, 4/3, the same layers for every strategy):
   (b) accelerate: transformers `from_pretrained(device_map=...)` with those
       layers on "cpu" (accelerate's dispatch hooks move them per forward);
   (c) offplan uva: a rule puts those layers on uva; `uva-64b` loads the same
       plan into an arena whose base sits 64 bytes past a page boundary, where
       the arena started before it was page-aligned (runtime/place/arena.py), so that
       one run measures what the alignment buys;
   (d) offplan prefetch: group_size g, num_in_group n, step 2;
   (e) offplan mixed: `backend: mixed` with the prefetch plan's GPU footprint
       as its budget (the same GPU memory as (d)), deciding for the mode the
       run measures (`cuda_graphs: false` when `--modes` is eager alone);
3. for each, at batch 1, 8 and 32 (distinct random prompts of 16 tokens):
   greedy decode of `--new-tokens` tokens after a warm-up; decode time is the
   time of generate(N+1) minus generate(1) (prefill excluded); the greedy
   tokens must equal all-GPU's. All-GPU runs first and again last (the
   report uses the faster of the two).

The limit at fraction f and batch b is 1 / max(offloaded bytes / H2D bandwidth,
all-GPU step time): the link cannot move the offloaded weights faster, and
offloading cannot beat the GPU. Each result is reported as a ratio to it.

Records go, one JSON object per line, to OUT/decode-MODEL.jsonl as they are
measured (a run cut short keeps what it measured). `benchmarks/report.py`
turns them into RESULTS.md tables and the plot.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

from harness.checkpoints import checkpoint_and_hardware, config_for
from harness.loops import decode, decode_static, prompts
from harness.plans import experts_working_bytes, make_plan, offloaded_layers, policy_text, predicted_us
from planner.inputs.config import read_config
from planner.layers.graph import build_graph
from planner.planfile import load_plan
from planner.units import GIB


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-8b", choices=["llama-8b", "qwen3-30b-a3b", "tiny"])
    ap.add_argument("--layers", type=int, help="decoder layers (default: the real count)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/offplan-bench"), help="where checkpoints go")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    ap.add_argument("--strategies", nargs="+", default=["accelerate", "uva", "prefetch", "mixed"],
                    choices=["accelerate", "uva", "uva-64b", "prefetch", "mixed"])
    ap.add_argument("--hardware", type=Path, help="a `plan calibrate` profile to use instead of calibrating now")
    ap.add_argument("--accelerate-batches", type=int, nargs="+", default=[1],
                    help="batches for accelerate, whose offloaded steps take seconds (default: 1)")
    ap.add_argument("--experts-host", action="store_true", help="also: a mixed plan with every expert off the GPU")
    ap.add_argument("--modes", nargs="+", default=["eager"], choices=["eager", "compiled", "graph"],
                    help="eager: HF generate; compiled / graph: a static-cache loop at batch 1, through "
                         "torch.compile or replaying a captured CUDA graph")
    return ap.parse_args(argv)


class Bench:
    """One run: the checkpoint, the hardware measured now, the all-GPU references, and the records."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.cuda = args.device == "cuda"
        args.out.mkdir(parents=True, exist_ok=True)
        self.log = args.out / f"decode-{args.model}.jsonl"
        self.log.write_text("")
        self.work = args.dir / args.model
        self.work.mkdir(parents=True, exist_ok=True)
        self.mismatches: list[str] = []
        self.reference: dict = {}  # batch or mode -> all-GPU greedy tokens
        self.allgpu_step: dict = {}  # batch or mode -> the best all-GPU step, seconds
        self.ckpt, self.info, self.hw = checkpoint_and_hardware(args, self.work, self.record)
        self.hw_path = self.work / "hw.yaml"
        self.layers = build_graph(list(self.info.tensors), facts=read_config(self.ckpt)).stack_layers()
        self.decoder_bytes = sum(self.info.tensors[n].nbytes for l in self.layers for n in l.params)
        self.ids = prompts(config_for(args.model, args.layers).vocab_size, args.device)
        self.graphs = args.modes != ["eager"]  # the mode mixed plans decide for: replayed unless only eager runs

    def record(self, **r) -> None:
        with self.log.open("a") as f:
            f.write(json.dumps(r) + "\n")
        print(json.dumps(r), flush=True)
        if r.get("same_tokens") is False and r.get("mode", "eager") != "compiled":
            self.mismatches.append(r["name"])

    def _decoded(self, strategy: str, name: str, fraction: float, key, rate: float, tokens: list,
                 offloaded: int, **extra) -> None:
        """Record one measurement; all-GPU runs set the reference tokens and the best step for `key`."""
        if strategy == "gpu":
            self.reference.setdefault(key, tokens)
            self.allgpu_step[key] = min(self.allgpu_step.get(key, 1e9), 1 / rate)
        # The limit: the link cannot move the offloaded bytes faster, offloading cannot beat all-GPU.
        limit = 1 / max(offloaded / (self.hw.h2d_copy_gbps * 1e9), self.allgpu_step.get(key, 0))
        mode = {} if isinstance(key, int) else {"mode": key}
        self.record(kind="decode", strategy=strategy, name=name, fraction=fraction,
                    batch=key if isinstance(key, int) else 1, **mode, steps_per_s=rate, limit_steps_per_s=limit,
                    ratio_to_limit=rate / limit, offloaded_bytes=offloaded, measured_step_ms=1e3 / rate,
                    same_tokens=tokens == self.reference.get(key), **extra)

    def run_offplan(self, name: str, strategy: str, fraction: float, plan_path: Path, offloaded: int) -> None:
        import runtime
        import runtime.place.arena
        from runtime.hf import build_meta_model

        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
        model = build_meta_model(self.ckpt)
        runtime.place.arena.BASE_OFFSET = 64 if strategy == "uva-64b" else 0
        try:
            handle = runtime.load(model, plan_path, device=self.args.device, progress=False)
        finally:
            runtime.place.arena.BASE_OFFSET = 0
        s, plan = handle.stats(), load_plan(plan_path)
        facts = dict(load_seconds=s.load_seconds, load_gb_per_s=s.load_bytes_per_s / 1e9,
                     peak_gpu_bytes_during_load=s.peak_gpu_bytes_during_load,
                     gpu_footprint_bytes=plan.summary.gpu_footprint_bytes, pinned_host_bytes=s.pinned_host_bytes,
                     uva_bytes=s.uva_bytes, prefetch_bytes=s.prefetch_bytes, backend=plan.backend.value)
        try:
            for mode in self.args.modes:
                if mode == "eager" or not self.cuda:
                    continue
                rate, tokens = decode_static(model, handle, self.ids, self.args.new_tokens, mode)
                self._decoded(strategy, name, fraction, mode, rate, tokens, offloaded, predicted_step_ms=None,
                              **facts)
                torch._dynamo.reset()
            for b in (self.args.batches if "eager" in self.args.modes else []):
                rate, tokens = decode(model, self.ids, b, self.args.new_tokens, self.args.device)
                self._decoded(strategy, name, fraction, b, rate, tokens, offloaded,
                              predicted_step_ms=predicted_us(plan_path, self.hw, b) / 1e3, **facts)
        finally:
            handle.remove(restore=False)
            del model, handle

    def run_accelerate(self, fraction: float, off: list[int], offloaded: int) -> None:
        from transformers import AutoModelForCausalLM
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        device_map = {"model.embed_tokens": 0, "model.norm": 0, "model.rotary_emb": 0, "lm_head": 0}
        device_map.update({f"model.layers.{i}": "cpu" if i in off else 0 for i in range(len(self.layers))})
        t = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(self.ckpt, device_map=device_map, dtype=torch.bfloat16).eval()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t
        facts = dict(predicted_step_ms=None, load_seconds=seconds, load_gb_per_s=self.info.total_bytes / seconds / 1e9,
                     peak_gpu_bytes_during_load=torch.cuda.max_memory_allocated() - base, gpu_footprint_bytes=None,
                     pinned_host_bytes=None, uva_bytes=None, prefetch_bytes=None, backend="accelerate")
        try:
            for b in self.args.accelerate_batches:
                rate, tokens = decode(model, self.ids, b, self.args.new_tokens, self.args.device)
                self._decoded("accelerate", f"accelerate-{fraction}", fraction, b, rate, tokens, offloaded, **facts)
        finally:
            del model

    def fraction(self, f: float) -> None:
        """Every strategy with the same layers offloaded: layer i iff i % g >= g - n (FRACTIONS)."""
        off = offloaded_layers(len(self.layers), f)
        offloaded = sum(self.info.tensors[n].nbytes for i in off for n in self.layers[i].params)
        self.record(kind="fraction", fraction=f, layers=off, offloaded_bytes=offloaded,
                    of_decoder=offloaded / self.decoder_bytes)
        prefetch_plan = make_plan(self.work, f"prefetch-{f}", policy_text("prefetch", f, off, self.hw_path, None))
        budget = load_plan(prefetch_plan).summary.gpu_footprint_bytes / GIB
        for strategy in self.args.strategies:
            if strategy == "accelerate":
                if self.cuda:
                    self.run_accelerate(f, off, offloaded)
                continue
            plan = prefetch_plan if strategy == "prefetch" else make_plan(
                self.work, f"{strategy}-{f}", policy_text(strategy, f, off, self.hw_path, budget, self.graphs))
            p = load_plan(plan)
            self.run_offplan(f"{strategy}-{f}", strategy, f, plan, p.summary.uva_bytes + p.summary.prefetch_bytes)

    def experts_on_host(self) -> None:
        """A mixed plan whose budget holds everything but the experts."""
        experts = sum(self.info.tensors[n].nbytes for n in self.info.tensors if ".experts." in n)
        working = experts_working_bytes(self.work, policy_text("gpu", 0, [], self.hw_path, None))  # in the budget
        budget = ((self.info.total_bytes - experts) * 1.02 + working) / GIB
        plan = make_plan(self.work, "mixed-experts-host",
                         policy_text("mixed-experts-host", 1.0, [], self.hw_path, budget, self.graphs))
        s = load_plan(plan).summary
        self.record(kind="fraction", fraction="experts", offloaded_bytes=s.uva_bytes + s.prefetch_bytes,
                    of_decoder=(s.uva_bytes + s.prefetch_bytes) / self.decoder_bytes, experts_bytes=experts)
        self.run_offplan("mixed-experts-host", "mixed", 1.0, plan, s.uva_bytes + s.prefetch_bytes)


def main(argv=None) -> int:
    args = parse_args(argv)
    bench = Bench(args)
    gpu_plan = make_plan(bench.work, "gpu", policy_text("gpu", 0, [], bench.hw_path, None))
    bench.run_offplan("gpu", "gpu", 0.0, gpu_plan, 0)
    for f in args.fractions:
        bench.fraction(f)
    bench.run_offplan("gpu-end", "gpu", 0.0, gpu_plan, 0)  # again, last: the report takes the faster
    if args.experts_host:
        bench.experts_on_host()
    if bench.mismatches:  # compiled runs are exempt: Inductor's default fusions round differently (RESULTS.md)
        print(f"FAILED: greedy tokens differ from all-GPU's for {', '.join(sorted(set(bench.mismatches)))}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
