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

from planner.decide.build import build
from planner.inputs.checkpoint import Checkpoint, open_checkpoint
from planner.inputs.config import read_config
from planner.decide.cost import CostModel
from planner.layers.graph import build_graph
from planner.layers.groups import FusedGroups
from planner.inputs.hardware import H100, Hardware, dumps_hardware, load_hardware
from planner.files import write_atomic
from planner.planfile import dumps, load_plan
from planner.inputs.policy import load_policy
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
    """Random bf16 weights in the real shapes, saved as sharded safetensors (reused if present).

    One decoder layer at a time, so that the checkpoint may be as large as the
    disk allows, beyond the GPU's memory and half the host's (transformers'
    `save_pretrained` converts a whole model's fused experts back to
    per-expert tensors at once): transformers builds and saves a model of one
    layer (its checkpoint names, its initialisation); every layer is then drawn
    afresh under layer 0's names and shapes, a tensor that layer 0 holds
    constant (a norm's ones) copied, any other normal around 0 with layer 0's
    standard deviation. The embedding, final norm and head are the one-layer
    model's. One shard per layer.
    """
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    if (directory / "model.safetensors.index.json").is_file():
        return directory
    shutil.rmtree(directory, ignore_errors=True)
    config = config_for(model, layers)
    one = config_for(model, 1)
    torch.manual_seed(0)
    with torch.device(device):
        m = AutoModelForCausalLM.from_config(one, dtype=torch.bfloat16)
    one_layer = directory.with_name(directory.name + ".one-layer")
    shutil.rmtree(one_layer, ignore_errors=True)
    m.save_pretrained(one_layer)
    del m
    saved: dict[str, torch.Tensor] = {}
    for f in sorted(one_layer.glob("*.safetensors")):
        saved.update(load_file(f))
    prefix = "model.layers.0."
    layer0 = {k[len(prefix):]: v for k, v in saved.items() if k.startswith(prefix)}
    # per name: layer 0's tensor where it is constant (copied), else the standard deviation to draw with
    draw = {name: v if bool((v.view(-1) == v.view(-1)[0]).all()) else float(v.float().std())
            for name, v in layer0.items()}
    count = config.num_hidden_layers
    files = [f"model-{i + 1:05d}-of-{count + 1:05d}.safetensors" for i in range(count + 1)]
    directory.mkdir(parents=True)
    weight_map, total = {}, 0
    for i in range(count + 1):
        if i < count:
            shard = {}
            for name, v in layer0.items():
                t = torch.empty(v.shape, dtype=v.dtype, device=device)
                how = draw[name]
                shard[f"model.layers.{i}.{name}"] = (t.copy_(how) if isinstance(how, torch.Tensor)
                                                     else t.normal_(0.0, how)).cpu()
        else:
            shard = {k: v for k, v in saved.items() if not k.startswith("model.layers.")}
        save_file(shard, directory / files[i], metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, files[i]))
        total += sum(t.nbytes for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    shown = json.loads((one_layer / "config.json").read_text())
    full = config.to_dict()
    full.update({k: shown[k] for k in ("architectures", "dtype", "torch_dtype") if k in shown})
    (directory / "config.json").write_text(json.dumps(full, indent=2) + "\n")
    if (one_layer / "generation_config.json").is_file():
        shutil.copy(one_layer / "generation_config.json", directory / "generation_config.json")
    shutil.rmtree(one_layer)
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


def checkpoint_and_hardware(args: argparse.Namespace, work: Path, record) -> tuple[Path, Checkpoint, Hardware]:
    """The run's checkpoint in WORK/ckpt (made if absent, `make_checkpoint`) and its hardware profile (--hardware's
    file, else calibrated now on CUDA, else the built-in H100, written to WORK/hw.yaml), each passed to `record`."""
    t = time.perf_counter()
    ckpt = make_checkpoint(args.model, args.layers, work / "ckpt", args.device)
    info = open_checkpoint(ckpt)
    cuda = args.device == "cuda"
    record(kind="checkpoint", model=args.model, tensors=len(info.tensors), bytes=info.total_bytes,
           seconds=round(time.perf_counter() - t, 1), device=torch.cuda.get_device_name() if cuda else "cpu",
           torch=torch.__version__)
    if args.hardware:
        hw = load_hardware(args.hardware)
    elif cuda:
        from runtime.measure.calibrate import calibrate
        hw = calibrate().hardware
    else:
        hw = H100
    (work / "hw.yaml").write_text(dumps_hardware(hw))
    record(kind="hardware", **hw.__dict__)
    return ckpt, info, hw


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


def decode_static(model, handle, ids: torch.Tensor, new: int, mode: str, batch: int = 1) -> tuple[float, list]:
    """Greedy decode of `batch` sequences with a static KV cache: `compiled` runs a torch.compile'd forward,
    `graph` replays one captured decode step (CUDA graph), `compiled-graph` one captured step of the
    torch.compile'd forward (Inductor's fused kernels, replayed). Returns (steps per second, tokens)."""
    from transformers import StaticCache
    prompt = ids[:batch]
    pos = torch.arange(PROMPT_LEN, device=prompt.device)
    cache = StaticCache(config=model.config, max_cache_len=PROMPT_LEN + new + 8)
    static_ids = torch.zeros(batch, 1, dtype=torch.long, device=prompt.device)
    static_pos = torch.tensor([PROMPT_LEN], device=prompt.device)
    step = torch.compile(model) if mode in ("compiled", "compiled-graph") else model
    replayed = mode in ("graph", "compiled-graph")
    with torch.no_grad():
        def prefill():
            cache.reset()
            out = model(prompt, past_key_values=cache, cache_position=pos).logits
            handle.join()
            return out[:, -1:].argmax(-1)
        prefill()
        if replayed:
            graph, static_logits = handle.capture(
                lambda: step(static_ids, past_key_values=cache, cache_position=static_pos).logits, warmup=3)
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
            if replayed:
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
                self.work, f"{strategy}-{f}", policy_text(strategy, f, off, self.hw_path, budget))
            p = load_plan(plan)
            self.run_offplan(f"{strategy}-{f}", strategy, f, plan, p.summary.uva_bytes + p.summary.prefetch_bytes)

    def experts_on_host(self) -> None:
        """A mixed plan whose budget holds everything but the experts."""
        experts = sum(self.info.tensors[n].nbytes for n in self.info.tensors if ".experts." in n)
        budget = (self.info.total_bytes - experts) / GIB * 1.02
        plan = make_plan(self.work, "mixed-experts-host",
                         policy_text("mixed-experts-host", 1.0, [], self.hw_path, budget))
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
