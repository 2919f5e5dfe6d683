"""Decode speed of offloaded models against the PCIe floor, all-on-GPU and accelerate.

    python benchmarks/decode.py --model llama-8b  --dir /tmp/bench --out results/  # on the H100
    python benchmarks/decode.py --model qwen3-30b-a3b --layers 16 --dir /tmp/bench --out results/
    python benchmarks/decode.py --model tiny --device cpu --out /tmp/r             # smoke test, any machine

For one model (random bf16 weights, real config shapes, saved as a sharded
safetensors checkpoint on local disk so the real load path is measured):

1. calibrate: pinned H2D copy, UVA GEMV and HBM GEMV bandwidths and the
   per-layer overhead, measured now, on this GPU (`runtime.calibrate`); the
   profile feeds the mixed plans and the predictions;
2. all on GPU (a), then for each offloaded fraction f (25/50/75% of the
   decoder layers: layer i is offloaded iff i % g >= g - n, with g/n = 4/1,
   2/1, 4/3, the same layers for every strategy):
   (b) accelerate: transformers `from_pretrained(device_map=...)` with those
       layers on "cpu" (accelerate's dispatch hooks move them per forward);
   (c) offplan uva: a rule puts those layers on uva; `uva-64b` loads the same
       plan into an arena whose base sits 64 bytes past a page boundary, where
       the arena started before it was page-aligned (runtime/arena.py), so that
       one run measures what the alignment buys;
   (d) offplan prefetch: group_size g, num_in_group n, step 2;
   (e) offplan mixed: `backend: mixed` with the prefetch plan's GPU footprint
       as its budget (the same GPU memory as (d));
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
import functools
import gc
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from planner.build import build
from planner.checkpoint import open_checkpoint
from planner.config import read_config
from planner.cost import CostModel
from planner.graph import build_graph
from planner.groups import FusedGroups
from planner.hardware import H100, Hardware, dumps_hardware, load_hardware
from planner.files import write_atomic
from planner.planfile import dumps, load_plan
from planner.policy import load_policy
from planner.units import GIB

FRACTIONS = {0.25: (4, 1), 0.5: (2, 1), 0.75: (4, 3)}
PROMPT_LEN = 16


def config_for(model: str, layers: int | None):
    from transformers import LlamaConfig, Qwen3MoeConfig
    if model == "llama-8b":  # Llama-3.1-8B
        return LlamaConfig(hidden_size=4096, num_hidden_layers=layers or 32, intermediate_size=14336,
                           num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                           max_position_embeddings=4096, rope_theta=500000.0, tie_word_embeddings=False)
    if model == "qwen3-30b-a3b":  # Qwen3-30B-A3B
        return Qwen3MoeConfig(hidden_size=2048, num_hidden_layers=layers or 48, num_experts=128,
                              num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144,
                              num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                              vocab_size=151936, max_position_embeddings=4096, decoder_sparse_step=1,
                              mlp_only_layers=[], tie_word_embeddings=False)
    if model == "tiny":
        return Qwen3MoeConfig(hidden_size=64, num_hidden_layers=layers or 8, num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=32, intermediate_size=128, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=256,
                              decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)
    raise SystemExit(f"unknown model {model!r}")


def make_checkpoint(model: str, layers: int | None, directory: Path, device: str) -> Path:
    """Random bf16 weights in the real shapes, saved as sharded safetensors (reused if present)."""
    from transformers import AutoModelForCausalLM
    if (directory / "model.safetensors.index.json").is_file():
        return directory
    shutil.rmtree(directory, ignore_errors=True)
    torch.manual_seed(0)
    with torch.device(device):
        m = AutoModelForCausalLM.from_config(config_for(model, layers), dtype=torch.bfloat16)
    m.save_pretrained(directory, max_shard_size="5GB")
    del m
    os.sync()  # no writeback of 16+ GB competing with the first measurements
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return directory


def offloaded_layers(count: int, fraction: float) -> list[int]:
    g, n = FRACTIONS[fraction]
    return [i for i in range(count) if i % g >= g - n]


def policy_text(strategy: str, fraction: float, layers: list[int], hw: Path | None, budget_gib: float | None) -> str:
    head = "format_version: 1\ncheckpoint: ckpt\n" + (f"hardware: {hw.name}\n" if hw else "")
    if strategy == "gpu":
        return head
    if strategy in ("uva", "uva-64b"):
        alternation = "|".join(map(str, layers))
        return head + f"rules:\n  - match: ['re:^model\\.layers\\.({alternation})\\.']\n    place: uva\n"
    if strategy == "prefetch":
        g, n = FRACTIONS[fraction]
        return head + f"prefetch: {{group_size: {g}, num_in_group: {n}, step: 2}}\n"
    if strategy in ("mixed", "mixed-experts-host"):  # the latter's budget: everything but the experts
        return head + f"backend: mixed\nbudget_gib: {budget_gib!r}\nprefetch: {{step: 2}}\n"
    raise ValueError(strategy)


def make_plan(work: Path, name: str, text: str) -> Path:
    policy = work / f"{name}.policy.yaml"
    policy.write_text(text)
    out = work / f"{name}.plan.yaml"
    write_atomic(out, dumps(build(load_policy(policy), work)))
    return out


def prompts(vocab: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(3, vocab, (32, PROMPT_LEN), generator=g).to(device)


def sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def decode(model, ids: torch.Tensor, batch: int, new: int, device) -> tuple[float, list]:
    """(decode steps per second, greedy tokens) for `new` tokens at `batch`."""
    x = ids[:batch]
    mask = torch.ones_like(x)
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=0)

    def gen(n):
        sync(device)
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(x, max_new_tokens=n, min_new_tokens=n, **kw)
        sync(device)
        return time.perf_counter() - t, out

    gen(3)  # warm-up
    t1, _ = gen(1)
    tn, out = gen(new + 1)
    return new / max(tn - t1, 1e-9), out[:, PROMPT_LEN:].tolist()


def decode_static(model, handle, ids: torch.Tensor, new: int, mode: str) -> tuple[float, list]:
    """Batch-1 greedy decode with a static KV cache: `compiled` runs a torch.compile'd forward,
    `graph` replays one captured decode step (CUDA graph). Returns (steps per second, tokens)."""
    from transformers import StaticCache
    prompt = ids[:1]
    pos = torch.arange(PROMPT_LEN, device=prompt.device)
    cache = StaticCache(config=model.config, max_cache_len=PROMPT_LEN + new + 8)
    static_ids = torch.zeros(1, 1, dtype=torch.long, device=prompt.device)
    static_pos = torch.tensor([PROMPT_LEN], device=prompt.device)
    step = torch.compile(model) if mode == "compiled" else model
    with torch.no_grad():
        def prefill():
            cache.reset()
            out = model(prompt, past_key_values=cache, cache_position=pos).logits
            handle.join()
            return out[:, -1:].argmax(-1)
        prefill()
        if mode == "graph":
            graph, static_logits = handle.capture(
                lambda: model(static_ids, past_key_values=cache, cache_position=static_pos).logits, warmup=3)
        else:
            for _ in range(3):  # warm-up and compilation
                step(static_ids, past_key_values=cache, cache_position=static_pos)
                handle.join()
        token = prefill()
        tokens = [token]
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(new):
            static_ids.copy_(token)
            static_pos.fill_(PROMPT_LEN + i)
            if mode == "graph":
                graph.replay()
                logits = static_logits
            else:
                logits = step(static_ids, past_key_values=cache, cache_position=static_pos).logits
                handle.join()
            token = logits[:, -1:].argmax(-1)
            tokens.append(token)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t
    return new / seconds, torch.cat(tokens, 1)[:, :new].tolist()


@functools.lru_cache(maxsize=None)
def _plan_facts(plan_path: Path):
    """The plan, its checkpoint's layer graph, tensors, expert groups and top-k: read once per plan."""
    plan = load_plan(plan_path)
    ckpt = open_checkpoint(plan.checkpoint_dir(plan_path))
    graph = build_graph(list(ckpt.tensors), facts=read_config(ckpt.root))
    groups = FusedGroups.find(n for l in graph.stack_layers() for n in l.params)
    return plan, graph, ckpt.tensors, groups, read_config(ckpt.root).top_k


def predicted_us(plan_path: Path, hw: Hardware, batch: int) -> int:
    plan, graph, tensors, groups, top_k = _plan_facts(plan_path)
    return CostModel(graph, tensors, hw, batch, groups, top_k).predict(plan.params).step_us


def main(argv=None) -> int:
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
    args = ap.parse_args(argv)

    import runtime
    import runtime.arena
    from runtime.hf import build_meta_model

    cuda = args.device == "cuda"
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / f"decode-{args.model}.jsonl"
    log.write_text("")
    work = args.dir / args.model
    work.mkdir(parents=True, exist_ok=True)

    mismatches = []

    def record(**r):
        with log.open("a") as f:
            f.write(json.dumps(r) + "\n")
        print(json.dumps(r), flush=True)
        if r.get("same_tokens") is False and r.get("mode", "eager") != "compiled":
            mismatches.append(r["name"])

    t = time.perf_counter()
    ckpt = make_checkpoint(args.model, args.layers, work / "ckpt", args.device)
    info = open_checkpoint(ckpt)
    record(kind="checkpoint", model=args.model, tensors=len(info.tensors), bytes=info.total_bytes,
           seconds=round(time.perf_counter() - t, 1), device=torch.cuda.get_device_name() if cuda else "cpu",
           torch=torch.__version__)
    if args.hardware:
        hw = load_hardware(args.hardware)
    elif cuda:
        from runtime.calibrate import calibrate
        hw = calibrate().hardware
    else:
        hw = H100
    hw_path = work / "hw.yaml"
    hw_path.write_text(dumps_hardware(hw))
    record(kind="hardware", **hw.__dict__)
    floor = hw.h2d_copy_gbps  # measured in this run: the PCIe floor

    graph = build_graph(list(info.tensors), facts=read_config(ckpt))
    layers = [l for l in graph.stack_layers()]
    decoder_bytes = sum(info.tensors[n].nbytes for l in layers for n in l.params)
    ids = prompts(config_for(args.model, args.layers).vocab_size, args.device)
    reference: dict[int, list] = {}
    allgpu_step: dict[int, float] = {}

    def run_offplan(name: str, strategy: str, fraction: float, plan_path: Path, offloaded: int):
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        model = build_meta_model(ckpt)
        runtime.arena.BASE_OFFSET = 64 if strategy == "uva-64b" else 0
        try:
            handle = runtime.load(model, plan_path, device=args.device, progress=False)
        finally:
            runtime.arena.BASE_OFFSET = 0
        s = handle.stats()
        plan = load_plan(plan_path)
        try:
            for mode in args.modes:
                if mode == "eager" or not cuda:
                    continue
                rate, tokens = decode_static(model, handle, ids, args.new_tokens, mode)
                if strategy == "gpu":
                    reference.setdefault(mode, tokens)
                    allgpu_step[mode] = min(allgpu_step.get(mode, 1e9), 1 / rate)
                limit = 1 / max(offloaded / (floor * 1e9), allgpu_step.get(mode, 0))
                record(kind="decode", strategy=strategy, name=name, fraction=fraction, batch=1, mode=mode,
                       steps_per_s=rate, limit_steps_per_s=limit, ratio_to_limit=rate / limit,
                       offloaded_bytes=offloaded, predicted_step_ms=None, measured_step_ms=1e3 / rate,
                       same_tokens=tokens == reference.get(mode), load_seconds=s.load_seconds,
                       load_gb_per_s=s.load_bytes_per_s / 1e9, peak_gpu_bytes_during_load=s.peak_gpu_bytes_during_load,
                       gpu_footprint_bytes=plan.summary.gpu_footprint_bytes, pinned_host_bytes=s.pinned_host_bytes,
                       uva_bytes=s.uva_bytes, prefetch_bytes=s.prefetch_bytes, backend=plan.backend.value)
                torch._dynamo.reset()
            for b in (args.batches if "eager" in args.modes else []):
                rate, tokens = decode(model, ids, b, args.new_tokens, args.device)
                if strategy == "gpu":
                    reference.setdefault(b, tokens)
                    allgpu_step[b] = min(allgpu_step.get(b, 1e9), 1 / rate)
                limit = 1 / max(offloaded / (floor * 1e9), allgpu_step.get(b, 0))
                record(kind="decode", strategy=strategy, name=name, fraction=fraction, batch=b,
                       steps_per_s=rate, limit_steps_per_s=limit, ratio_to_limit=rate / limit,
                       offloaded_bytes=offloaded, predicted_step_ms=predicted_us(plan_path, hw, b) / 1e3,
                       measured_step_ms=1e3 / rate, same_tokens=tokens == reference.get(b),
                       load_seconds=s.load_seconds, load_gb_per_s=s.load_bytes_per_s / 1e9,
                       peak_gpu_bytes_during_load=s.peak_gpu_bytes_during_load,
                       gpu_footprint_bytes=plan.summary.gpu_footprint_bytes,
                       pinned_host_bytes=s.pinned_host_bytes, uva_bytes=s.uva_bytes,
                       prefetch_bytes=s.prefetch_bytes, backend=plan.backend.value)
        finally:
            handle.remove(restore=False)
            del model, handle

    def run_accelerate(fraction: float, off: list[int], offloaded: int):
        from transformers import AutoModelForCausalLM
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        device_map = {"model.embed_tokens": 0, "model.norm": 0, "model.rotary_emb": 0, "lm_head": 0}
        device_map.update({f"model.layers.{i}": "cpu" if i in off else 0 for i in range(len(layers))})
        t = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(ckpt, device_map=device_map, dtype=torch.bfloat16).eval()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t
        peak = torch.cuda.max_memory_allocated() - base
        try:
            for b in args.accelerate_batches:
                rate, tokens = decode(model, ids, b, args.new_tokens, args.device)
                limit = 1 / max(offloaded / (floor * 1e9), allgpu_step.get(b, 0))
                record(kind="decode", strategy="accelerate", name=f"accelerate-{fraction}", fraction=fraction,
                       batch=b, steps_per_s=rate, limit_steps_per_s=limit, ratio_to_limit=rate / limit,
                       offloaded_bytes=offloaded, predicted_step_ms=None, measured_step_ms=1e3 / rate,
                       same_tokens=tokens == reference.get(b), load_seconds=seconds,
                       load_gb_per_s=info.total_bytes / seconds / 1e9, peak_gpu_bytes_during_load=peak,
                       gpu_footprint_bytes=None, pinned_host_bytes=None, uva_bytes=None, prefetch_bytes=None,
                       backend="accelerate")
        finally:
            del model

    run_offplan("gpu", "gpu", 0.0, make_plan(work, "gpu", policy_text("gpu", 0, [], hw_path, None)), 0)
    for f in args.fractions:
        off = offloaded_layers(len(layers), f)
        offloaded = sum(info.tensors[n].nbytes for i in off for n in layers[i].params)
        record(kind="fraction", fraction=f, layers=off, offloaded_bytes=offloaded,
               of_decoder=offloaded / decoder_bytes)
        prefetch_plan = make_plan(work, f"prefetch-{f}", policy_text("prefetch", f, off, hw_path, None))
        budget = load_plan(prefetch_plan).summary.gpu_footprint_bytes / GIB
        for strategy in args.strategies:
            if strategy == "accelerate":
                if cuda:
                    run_accelerate(f, off, offloaded)
                continue
            plan = prefetch_plan if strategy == "prefetch" else make_plan(
                work, f"{strategy}-{f}", policy_text(strategy, f, off, hw_path, budget))
            p = load_plan(plan)
            run_offplan(f"{strategy}-{f}", strategy, f, plan, p.summary.uva_bytes + p.summary.prefetch_bytes)
    # All-GPU once more, last: the report takes the faster of the two as the reference.
    run_offplan("gpu-end", "gpu", 0.0, work / "gpu.plan.yaml", 0)
    if args.experts_host:
        experts = sum(info.tensors[n].nbytes for n in info.tensors if ".experts." in n)
        budget = (info.total_bytes - experts) / GIB * 1.02
        plan = make_plan(work, "mixed-experts-host", policy_text("mixed-experts-host", 1.0, [], hw_path, budget))
        p = load_plan(plan)
        record(kind="fraction", fraction="experts", offloaded_bytes=p.summary.uva_bytes + p.summary.prefetch_bytes,
               of_decoder=(p.summary.uva_bytes + p.summary.prefetch_bytes) / decoder_bytes,
               experts_bytes=experts)
        run_offplan("mixed-experts-host", "mixed", 1.0, plan, p.summary.uva_bytes + p.summary.prefetch_bytes)
    if mismatches:  # compiled runs are exempt: Inductor's default fusions round differently (RESULTS.md)
        print(f"FAILED: greedy tokens differ from all-GPU's for {', '.join(sorted(set(mismatches)))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
