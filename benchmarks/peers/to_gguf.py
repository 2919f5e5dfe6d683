"""A benchmark checkpoint as GGUF, for llama.cpp: the same weights, in llama.cpp's own names and layout.

    python benchmarks/peers/to_gguf.py CHECKPOINT OUT.gguf [--type bf16|q8_0]

It writes with the `gguf` package (llama.cpp's gguf-py: on PyPI as `gguf`, 0.19 here and in the llama.cpp tree
that stage.sh packs), as llama.cpp's convert_hf_to_gguf.py does for Qwen3-MoE (`qwen3moe`), the one architecture it
takes, with its experts stored one per tensor as Qwen3-MoE checkpoints ship them:

- names from gguf's own map (`TensorNameMap`): `model.layers.N.self_attn.q_proj.weight` -> `blk.N.attn_q.weight`;
  each layer's per-expert `experts.E.gate_proj` (and up, down) stacked into one `blk.N.ffn_gate_exps.weight`
  [E, I, H] (GGUF lists dimensions in reverse: {H, I, E});
- types as convert_hf_to_gguf.py's: norms (1-D) and the router (`ffn_gate_inp`) in F32, which holds bf16 values
  exactly; every other weight in BF16 (its bits copied: the same numbers) or Q8_0 (llama.cpp's 8-bit blocks of 32
  with an F16 scale, quantized here in torch with the arithmetic of gguf's `quants.Q8_0`, on `device` (the CPU
  unless asked; a GPU quantizes gigabytes faster): `q8_0` below; tests/bench/test_peers.py holds it bit for bit
  against gguf's);
- hyperparameters from config.json under the keys convert_hf_to_gguf.py writes; no tokenizer
  (`tokenizer.ggml.model = "none"` and `qwen3moe.vocab_size`): llama-bench then draws random token ids.

llama.cpp's qwen3moe always normalizes each token's top-k routing weights, as Qwen3-30B-A3B does
(`norm_topk_prob: true`). A checkpoint with `norm_topk_prob: false` (transformers' default, which the benchmarks'
random checkpoints keep) is written all the same, with a warning: the same weights and the same work per token,
but not the same outputs.

Tensors are streamed: the header and tensor table first, then one tensor's data at a time (a layer's experts
stacked), so memory holds a few copies of the largest such tensor (the embedding or head, or a layer's stacked
experts; Q8_0 works in float32), not the checkpoint. The file is written beside OUT and renamed; a failure removes it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from planner.units import human

ARCH = "qwen3moe"
EXPERT = ".mlp.experts."


def q8_0(x: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks of `x` [..., C] (C a multiple of 32) as bytes [..., C / 32 * 34]: per block of 32 values an F16
    scale d = max|x| / 127 and round(x / d) as int8, rounding half away from zero, all in float32: gguf's
    quants.Q8_0.quantize_blocks, which is bit-exact with ggml-quants.c."""
    blocks = x.float().reshape(-1, 32)
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    v = blocks * inverse
    a = v.abs()
    floored = a.floor()
    q = (torch.sign(v) * (floored + (2 * (a - floored)).floor())).to(torch.int8)
    out = torch.cat([d.to(torch.float16).view(torch.uint8), q.view(torch.uint8)], dim=1)
    return out.reshape(*x.shape[:-1], x.shape[-1] // 32 * 34)


class Source:
    """The checkpoint's tensors by name, read from its shards on demand."""

    def __init__(self, root: Path):
        index = root / "model.safetensors.index.json"
        if index.is_file():
            self.where = {n: root / f for n, f in json.loads(index.read_text())["weight_map"].items()}
        elif (root / "model.safetensors").is_file():
            with safe_open(root / "model.safetensors", "pt") as f:
                self.where = dict.fromkeys(f.keys(), root / "model.safetensors")
        else:
            raise SystemExit(f"error: {root}: no model.safetensors.index.json or model.safetensors")
        self.files: dict[Path, object] = {}

    def _file(self, name: str):
        path = self.where[name]
        if path not in self.files:
            self.files[path] = safe_open(path, "pt")
        return self.files[path]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._file(name).get_tensor(name)

    def shape(self, name: str) -> list[int]:
        return list(self._file(name).get_slice(name).get_shape())


def gguf_tensors(names, layers: int, experts: int):
    """[(gguf name, [checkpoint names], F32?)] in checkpoint order, experts stacked per layer and projection."""
    import gguf
    mapping = gguf.TensorNameMap(gguf.MODEL_ARCH.QWEN3MOE, layers)
    out, seen = [], set()
    for name in names:
        if EXPERT in name:  # model.layers.N.mlp.experts.E.gate_proj.weight
            head, rest = name.split(EXPERT)
            number, _, projection = rest.partition(".")
            if not number.isdigit() or not projection:
                raise SystemExit(f"error: {name}: experts stored fused (not one tensor per expert, as Qwen3-MoE "
                                 "checkpoints ship them); to_gguf.py writes per-expert checkpoints only")
            key = f"{head}{EXPERT}{projection}"
            if key in seen:
                continue
            seen.add(key)
            parts = [f"{head}{EXPERT}{e}.{projection}" for e in range(experts)]
        else:
            key, parts = name, [name]
        mapped = mapping.get_name(key, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise SystemExit(f"error: {name}: llama.cpp's {ARCH} has no tensor for it")
        out.append((mapped, parts, name.endswith("norm.weight") or ".mlp.gate." in name))
    return out


def write_gguf(checkpoint: Path, out: Path, kind: str = "bf16", device: str | None = None) -> Path:
    config = json.loads((checkpoint / "config.json").read_text())
    if config.get("model_type") != "qwen3_moe":
        raise SystemExit(f"error: {checkpoint}/config.json: model_type {config.get('model_type')!r}; to_gguf.py "
                         "writes qwen3_moe checkpoints (llama.cpp's qwen3moe) only")
    if not config.get("norm_topk_prob", False):
        print(f"warning: {checkpoint}/config.json: norm_topk_prob is false; llama.cpp's {ARCH} normalizes the "
              "routing weights all the same (module doc): same weights and work, other outputs", file=sys.stderr)
    source = Source(checkpoint)
    tensors = gguf_tensors(sorted(source.where, key=_order), config["num_hidden_layers"], _experts(config))
    odd = [name for name, parts, f32 in tensors if not f32 and kind == "q8_0" and source.shape(parts[0])[-1] % 32]
    if odd:
        raise SystemExit(f"error: {odd[0]}: its rows are not whole blocks of 32 values, which Q8_0 needs; write it "
                         "as bf16 (--type bf16)")
    tmp = out.with_name(out.name + ".tmp")
    try:
        _write(tmp, config, tensors, source, kind, device or "cpu")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _experts(config: dict) -> int:
    return config.get("num_experts") or config["num_local_experts"]  # transformers 5 writes the latter


def _write(tmp: Path, config: dict, tensors, source: Source, kind: str, device: str) -> None:
    """The header, the tensor table (shapes from the headers, no data read), then each tensor's data."""
    import gguf
    qtype = {"bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0}[kind]
    writer = gguf.GGUFWriter(tmp, ARCH)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(float(config.get("rope_theta") or config.get("rope_parameters", {})["rope_theta"]))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_expert_count(_experts(config))
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if kind == "bf16" else gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_tokenizer_model("none")
    for name, parts, f32 in tensors:
        shape = source.shape(parts[0])
        shape = [len(parts), *shape] if len(parts) > 1 else shape
        rows = math.prod(shape[:-1])
        if f32:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), rows * shape[-1] * 4)
        else:  # bytes per row: BF16 2 a value, Q8_0 34 per block of 32
            row = shape[-1] * 2 if kind == "bf16" else shape[-1] // 32 * 34
            writer.add_tensor_info(name, [*shape[:-1], row], np.dtype(np.uint8), rows * row, raw_dtype=qtype)
    writer.write_header_to_file(tmp)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, parts, f32 in tensors:
        t = torch.stack([source[p] for p in parts]) if len(parts) > 1 else source[parts[0]]
        t = t.float() if f32 else t.to(torch.bfloat16).view(torch.uint8) if kind == "bf16" else q8_0(t.to(device)).cpu()
        writer.write_tensor_data(t.numpy())
    writer.close()


def _order(name: str):
    """Checkpoint order by layer, then name (layer 10 after layer 9), experts by number."""
    parts = name.split(".")
    return [int(p) if p.isdigit() else p for p in parts]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--type", choices=["bf16", "q8_0"], default="bf16")
    ap.add_argument("--device", default="cpu", help="where Q8_0 is computed (default: cpu)")
    args = ap.parse_args(argv)
    write_gguf(args.checkpoint, args.out, args.type, args.device)
    print(f"wrote {args.out} ({human(args.out.stat().st_size)}, {args.type})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
