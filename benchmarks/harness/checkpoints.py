"""The benchmarks' checkpoints: random bf16 weights in real models' shapes, written as sharded safetensors on
local disk so that the real load path is measured, and the run's hardware profile beside them."""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import time
from pathlib import Path

import torch

from planner.inputs.checkpoint import Checkpoint, open_checkpoint
from planner.inputs.hardware import H100, Hardware, dumps_hardware, load_hardware


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
    if model == "tiny-128":  # the tiny model with FP8-sized experts: gate and up fill whole 128-row scale blocks
        config = config_for("tiny", layers)
        config.hidden_size, config.moe_intermediate_size, config.head_dim = 128, 128, 32
        return config
    raise SystemExit(f"unknown model {model!r}")


SAME = ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_experts",
        "moe_intermediate_size", "head_dim", "vocab_size")  # what a checkpoint in `directory` must match to be reused


def make_checkpoint(model: str, layers: int | None, directory: Path, device: str) -> Path:
    """Random bf16 weights in the real shapes, saved as sharded safetensors (reused if present, of the same
    model and depth: a run with another `--layers` over the same `--dir` writes its own again).

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
    config = config_for(model, layers)
    if (directory / "model.safetensors.index.json").is_file() and (directory / "config.json").is_file():
        found, want = json.loads((directory / "config.json").read_text()), config.to_dict()
        if all(found.get(key) == want.get(key) for key in SAME):
            return directory
    shutil.rmtree(directory, ignore_errors=True)
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
