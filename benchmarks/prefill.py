"""Prefill (time to first token) of offloaded models against the link floor, all-GPU and the prefetch plan.

    python benchmarks/prefill.py --model llama-8b --out results/                 # on the H100
    python benchmarks/prefill.py --model qwen3-30b-a3b --layers 8 --out results/
    python benchmarks/prefill.py --model qwen3-30b-a3b --layers 8 --spread 2 --out results/
    python benchmarks/prefill.py --model tiny --device cpu --out /tmp/r          # smoke test, any machine

For one model (random bf16 weights, real config shapes; the
harness's checkpoint, and its calibration measured now on this GPU):

1. plans with the same decoder layers offloaded (fraction f: layer i iff
   i % g >= g - n, harness/plans.py's FRACTIONS):
   - gpu: nothing offloaded;
   - uva: a rule puts those layers on uva; the plan stages them for prefill
     (runtime/execute/prefill.py: copied to the GPU before a forward over more than
     the profile's `stage_above_tokens` tokens), routed experts too, through
     the expert ring (`uva: {stage_experts: true}`);
   - uva-gathered (MoE models): the same, but `stage_experts: false`: each
     touched expert is read once, after the router, through offplan's
     experts implementation;
   - uva-in-place: the same rule with `uva: {stage_prefill: false}`: every
     forward reads the pinned weights in place, as before staging existed;
   - prefetch: group_size g, num_in_group n, step 2;
   - mixed: `backend: mixed` with the prefetch plan's GPU footprint as budget
     (the planner decides whether to stage experts);
   - experts-host, experts-host-gathered (MoE models): a rule puts every
     routed expert on uva, streamed through the ring at prefill or gathered
     once touched;
   - experts-cpu (MoE models): a rule puts every routed expert on cpu; above
     the plan's `stage_above_tokens` the ring streams them to the GPU as it
     does uva ones (at or below it the host computes them, and the logits
     are not compared bitwise: the host sums in another order);
2. per plan and prompt length T (--tokens): the forward that yields the
   first token, as generate's prefill runs it (a fresh cache, logits of the
   last position only), timed with a CUDA synchronize around it: the median of
   3 after a warm-up. Its logits are compared bitwise with all-GPU's;
3. per plan, decode at batch 1 (eager `generate`, and replaying a captured
   CUDA graph), so that what staging costs decode shows beside it;
4. beside each measured prefill, the plan's prediction (`cost.prefill_us`)
   for the same placement at workload.prompt_tokens = T (null for `mixed`
   where the planner would place differently for that T).

The floor at T is max(link bytes / H2D copy bandwidth, all-GPU's prefill at
T): every offloaded byte the forward needs crosses the link at least once, and
offloading cannot beat all-GPU. The link bytes are the plan's offloaded bytes,
except that a routed expert on uva counts only if the prompt routes a token to
it (which experts each layer touches at T is recorded in all-GPU's forward:
the same routing as every plan's, their logits being bitwise equal), and an
embedding on uva only by the rows of the prompt's distinct tokens (a lookup;
Qwen3-30B-A3B's table is 622 MB, which the floor counted whole before
2026-11-23). A prefetched layer is copied whole, touched or not.

A random-weight MoE routes unlike a trained one: its hidden states collapse
with depth, so past the first layer a long prompt reaches only a third of
the experts (30-40 of 128 per layer at 1024 tokens, measured on a small
Qwen3-MoE config), where uniform routing, and a trained model's long
prompts, reach nearly all. `--spread S` (harness/routers.py `RouterSpread`) adds to each
router's input a fixed random vector per token, picked by the token's hidden
state, S times its RMS. Synthetic: it stands for a trained router, and only
the routers see it.

Records go, one JSON object per line, to OUT/prefill-MODEL.jsonl (with
--spread S, OUT/prefill-MODEL-spreadS.jsonl) as they are measured. `benchmarks/report.py` turns them into the RESULTS.md table.
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

from planner.planfile import load_plan
from planner.units import GIB

sys.path.insert(0, str(Path(__file__).parent))
from harness.checkpoints import checkpoint_and_hardware, config_for  # noqa: E402
from harness.loops import decode, decode_static, prompts, sync  # noqa: E402
from harness.plans import FRACTIONS, link_bytes, make_plan, offloaded_layers, predicted_prefill  # noqa: E402

REPEAT = 3
STRATEGIES = ["uva", "uva-gathered", "uva-in-place", "prefetch", "mixed", "experts-host", "experts-host-gathered",
              "experts-cpu"]
MOE_ONLY = {"uva-gathered", "experts-host", "experts-host-gathered", "experts-cpu"}  # they differ from the others in experts only


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-8b", choices=["llama-8b", "qwen3-30b-a3b", "tiny"])
    ap.add_argument("--layers", type=int, help="decoder layers (default: the real count)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/offplan-bench"), help="where checkpoints go")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048, 8192])
    ap.add_argument("--fraction", type=float, default=0.5, choices=sorted(FRACTIONS))
    ap.add_argument("--strategies", nargs="+", default=STRATEGIES, choices=STRATEGIES)
    ap.add_argument("--spread", type=float, help="MoE: route as a trained model's long prompt does, nearly every "
                    "expert touched (RouterSpread of this strength; 2 in RESULTS.md)")
    ap.add_argument("--new-tokens", type=int, default=32, help="decode steps timed per plan")
    ap.add_argument("--hardware", type=Path, help="a `plan calibrate` profile to use instead of calibrating now")
    return ap.parse_args(argv)


def policy(strategy: str, layers: list[int], fraction: float, hw: Path, budget_gib: float | None) -> str:
    head = f"format_version: 1\ncheckpoint: ckpt\nhardware: {hw.name}\n"
    layer_rule = "  - match: ['re:^model\\.layers\\.(" + "|".join(map(str, layers)) + ")\\.']\n    place: uva\n"
    if strategy == "gpu":
        return head
    if strategy in ("uva", "uva-gathered"):  # routed experts staged whole at prefill, or gathered once touched
        return head + f"uva: {{stage_experts: {'true' if strategy == 'uva' else 'false'}}}\nrules:\n" + layer_rule
    if strategy == "uva-in-place":
        return head + "uva: {stage_prefill: false}\nrules:\n" + layer_rule
    if strategy == "prefetch":
        g, n = FRACTIONS[fraction]
        return head + f"prefetch: {{group_size: {g}, num_in_group: {n}, step: 2}}\n"
    if strategy == "mixed":
        return head + f"backend: mixed\nbudget_gib: {budget_gib!r}\nprefetch: {{step: 2}}\n"
    if strategy in ("experts-host", "experts-host-gathered"):
        staged = "true" if strategy == "experts-host" else "false"
        return head + f"uva: {{stage_experts: {staged}}}\nrules:\n  - {{match: [experts], place: uva}}\n"
    if strategy == "experts-cpu":
        return head + "rules:\n  - {match: [experts], place: cpu}\n"
    raise ValueError(strategy)


def touched_experts(model, ids: torch.Tensor, device) -> dict[str, set[int]]:
    """Experts module path -> the experts that the prefill forward over `ids` routes at least one token to."""
    from runtime.execute.experts import supports
    touched: dict[str, set[int]] = {}

    def hook(path):
        def count(module, args, kwargs):
            index = args[1] if len(args) > 1 else kwargs["top_k_index"]
            touched.setdefault(path, set()).update(index.unique().tolist())
        return count
    hooks = [m.register_forward_pre_hook(hook(path), with_kwargs=True)
             for path, m in model.named_modules() if supports(m)]
    try:
        first_token(model, ids, device)
    finally:
        for h in hooks:
            h.remove()
    return touched


def first_token(model, ids: torch.Tensor, device) -> tuple[float, torch.Tensor]:
    """(seconds, last-position logits) of the prefill forward over `ids` [1, T], as generate runs it."""
    from transformers import DynamicCache
    sync(device)
    t = time.perf_counter()
    with torch.no_grad():
        logits = model(ids, past_key_values=DynamicCache(config=model.config), logits_to_keep=1).logits
    sync(device)
    return time.perf_counter() - t, logits


class Prefill:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.cuda = args.device == "cuda"
        args.out.mkdir(parents=True, exist_ok=True)
        self.log = args.out / f"prefill-{args.model}{'' if args.spread is None else f'-spread{args.spread:g}'}.jsonl"
        self.log.write_text("")
        self.work = args.dir / args.model
        self.work.mkdir(parents=True, exist_ok=True)
        self.ckpt, self.info, self.hw = checkpoint_and_hardware(args, self.work, self.record)
        self.hw_path = self.work / "hw.yaml"
        vocab = config_for(args.model, args.layers).vocab_size
        g = torch.Generator().manual_seed(4321)
        self.prompt = torch.randint(3, vocab, (1, max(args.tokens)), generator=g).to(args.device)
        self.ids = prompts(vocab, args.device)
        self.spread = None
        if args.spread is not None:
            from moe import RouterSpread
            cfg = config_for(args.model, args.layers)
            self.spread = RouterSpread(cfg.num_hidden_layers, cfg.hidden_size, max(args.tokens), args.spread, args.device)
            self.record(kind="spread", strength=args.spread, seed=RouterSpread.SEED)
        self.reference: dict[int, torch.Tensor] = {}  # T -> all-GPU logits
        self.allgpu: dict[int, float] = {}  # T -> all-GPU prefill seconds
        self.touched: dict[int, dict[str, set[int]]] = {}  # T -> experts module -> experts routed to
        self.decode_reference: dict[str, list] = {}
        self.mismatches: list[str] = []

    def record(self, **r) -> None:
        with self.log.open("a") as f:
            f.write(json.dumps(r) + "\n")
        print(json.dumps(r), flush=True)
        host = r.get("cpu_bytes") and (r["kind"] == "decode" or r["tokens"] <= (r["stage_above_tokens"] or 0))
        if (r.get("same_logits") is False or r.get("same_tokens") is False) and not host:  # module doc, experts-cpu
            self.mismatches.append(f"{r['strategy']} {r.get('tokens', r.get('mode'))}")

    def run(self, strategy: str, plan_path: Path, offloaded: int, predicted: dict[int, float | None]) -> None:
        import runtime
        from runtime.hf import build_meta_model
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
        plan = load_plan(plan_path)
        model = build_meta_model(self.ckpt)
        handle = runtime.load(model, plan_path, device=self.args.device, progress=False)
        if self.spread is not None:
            self.spread.install(model)
        staged = plan.prefill.above_tokens if plan.prefill else None
        facts = dict(strategy=strategy, offloaded_bytes=offloaded, uva_bytes=plan.summary.uva_bytes,
                     prefetch_bytes=plan.summary.prefetch_bytes, gpu_footprint_bytes=plan.summary.gpu_footprint_bytes,
                     stage_above_tokens=staged, stage_buffer_bytes=plan.prefill.pool_bytes if plan.prefill else 0,
                     staged_experts=bool(plan.prefill and plan.prefill.experts),
                     ring_bytes=plan.prefill.ring_bytes if plan.prefill else 0, cpu_bytes=plan.summary.cpu_bytes)
        try:
            for n in self.args.tokens:
                ids = self.prompt[:, :n]
                if strategy == "gpu":
                    self.touched[n] = touched_experts(model, ids, self.args.device)  # also the warm-up
                first_token(model, ids, self.args.device)  # warm-up
                before = handle.stats().prefill_staged_layers
                times, logits = [], None
                for _ in range(REPEAT):
                    s, logits = first_token(model, ids, self.args.device)
                    times.append(s)
                seconds = statistics.median(times)
                if strategy == "gpu":
                    self.reference[n], self.allgpu[n] = logits, seconds
                link = link_bytes(plan, self.info.tensors, self.touched[n], ids)
                floor = max(link / (self.hw.h2d_copy_gbps * 1e9), self.allgpu[n])
                self.record(kind="prefill", tokens=n, prefill_ms=seconds * 1e3, link_bytes=link, floor_ms=floor * 1e3,
                            ratio_to_floor=seconds / floor, same_logits=bool(torch.equal(logits, self.reference[n])),
                            predicted_ms=predicted[n],
                            staged_layers=(handle.stats().prefill_staged_layers - before) // REPEAT, **facts)
            for mode in ("eager", "graph") if self.cuda else ("eager",):
                if mode == "eager":
                    rate, tokens = decode(model, self.ids, 1, self.args.new_tokens, self.args.device)
                else:
                    rate, tokens = decode_static(model, handle, self.ids, self.args.new_tokens, "graph")
                self.decode_reference.setdefault(mode, tokens)
                self.record(kind="decode", mode=mode, batch=1, steps_per_s=rate,
                            same_tokens=tokens == self.decode_reference[mode], **facts)
        finally:
            handle.remove(restore=False)
            del model, handle


def main(argv=None) -> int:
    args = parse_args(argv)
    bench = Prefill(args)
    layers = [l for l in range(config_for(args.model, args.layers).num_hidden_layers)]
    off = offloaded_layers(len(layers), args.fraction)
    layer_bytes = sum(t.nbytes for n, t in bench.info.tensors.items()
                      if any(n.startswith(f"model.layers.{i}.") for i in off))
    experts_bytes = sum(t.nbytes for n, t in bench.info.tensors.items() if ".experts." in n)

    budget = None

    def run(strategy: str) -> Path:
        text = policy(strategy, off, args.fraction, bench.hw_path, budget)
        path = make_plan(bench.work, f"prefill-{strategy}", text)
        plan = load_plan(path)
        offloaded = {"gpu": 0, "uva": layer_bytes, "uva-gathered": layer_bytes, "uva-in-place": layer_bytes,
                     "experts-host": experts_bytes, "experts-host-gathered": experts_bytes,
                     "experts-cpu": experts_bytes}.get(
            strategy, plan.summary.uva_bytes + plan.summary.prefetch_bytes)
        bench.run(strategy, path, offloaded, predicted_prefill(bench.work, f"prefill-{strategy}", text, plan,
                                                                 args.tokens))
        return path
    run("gpu")
    if "prefetch" in args.strategies:
        prefetch = run("prefetch")
    else:
        prefetch = make_plan(bench.work, "prefill-prefetch", policy("prefetch", off, args.fraction, bench.hw_path, None))
    budget = load_plan(prefetch).summary.gpu_footprint_bytes / GIB  # mixed gets prefetch's GPU footprint
    for strategy in args.strategies:
        if strategy != "prefetch" and (strategy not in MOE_ONLY or experts_bytes):
            run(strategy)
    if bench.mismatches:
        print(f"FAILED: logits or tokens differ from all-GPU's for {', '.join(bench.mismatches)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
