"""Header-only safetensors checkpoints of real architectures, for tests and examples.

A header-only shard has a valid header and the real file size, but its data
region is a sparse hole: it costs no disk, and a planner that reads any weight
data would crawl through gigabytes of zeros. The shapes below follow the
published configs; only tensor names, dtypes and shapes matter to the planner.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from planner.inputs.dtypes import nbytes

Tensor = tuple[str, str, tuple[int, ...]]  # name, dtype, shape


def write_header_only(directory: str | os.PathLike, tensors: Iterable[Tensor],
                      shard_bytes: int = 5 * 10**9, single: bool = False) -> Path:
    """Write `tensors` as sharded header-only safetensors files plus an index.

    Shards are cut when they would exceed `shard_bytes` of data, and named as
    transformers names them. With `single=True` one `model.safetensors` is written.
    Returns the directory.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shards: list[list[Tensor]] = [[]]
    used = 0
    for t in tensors:
        size = nbytes(t[1], t[2])
        if shards[-1] and used + size > shard_bytes and not single:
            shards.append([])
            used = 0
        shards[-1].append(t)
        used += size
    if single:
        _write_shard(directory / "model.safetensors", shards[0])
        return directory
    weight_map = {}
    total = 0
    for i, group in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += _write_shard(directory / name, group)
        weight_map.update((t[0], name) for t in group)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return directory


def _write_shard(path: Path, tensors: list[Tensor]) -> int:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in tensors:
        size = nbytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        f.truncate(8 + len(raw) + offset)
    return offset


def llama(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256,
          tied=False, dtype="BF16") -> list[Tensor]:
    """Llama-3.1-8B by default."""
    hd = hidden // heads
    out: list[Tensor] = [("model.embed_tokens.weight", dtype, (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}"
        out += [
            (f"{p}.input_layernorm.weight", dtype, (hidden,)),
            (f"{p}.self_attn.q_proj.weight", dtype, (heads * hd, hidden)),
            (f"{p}.self_attn.k_proj.weight", dtype, (kv_heads * hd, hidden)),
            (f"{p}.self_attn.v_proj.weight", dtype, (kv_heads * hd, hidden)),
            (f"{p}.self_attn.o_proj.weight", dtype, (hidden, heads * hd)),
            (f"{p}.post_attention_layernorm.weight", dtype, (hidden,)),
            (f"{p}.mlp.gate_proj.weight", dtype, (intermediate, hidden)),
            (f"{p}.mlp.up_proj.weight", dtype, (intermediate, hidden)),
            (f"{p}.mlp.down_proj.weight", dtype, (hidden, intermediate)),
        ]
    out.append(("model.norm.weight", dtype, (hidden,)))
    if not tied:
        out.append(("lm_head.weight", dtype, (vocab, hidden)))
    return out


def qwen3_moe(layers=48, hidden=2048, experts=128, moe_intermediate=768, heads=32,
              kv_heads=4, head_dim=128, vocab=151936, dtype="BF16") -> list[Tensor]:
    """Qwen3-30B-A3B by default: every layer is MoE, experts stored one tensor each."""
    out: list[Tensor] = [("model.embed_tokens.weight", dtype, (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}"
        out += [
            (f"{p}.input_layernorm.weight", dtype, (hidden,)),
            (f"{p}.self_attn.q_proj.weight", dtype, (heads * head_dim, hidden)),
            (f"{p}.self_attn.k_proj.weight", dtype, (kv_heads * head_dim, hidden)),
            (f"{p}.self_attn.v_proj.weight", dtype, (kv_heads * head_dim, hidden)),
            (f"{p}.self_attn.o_proj.weight", dtype, (hidden, heads * head_dim)),
            (f"{p}.self_attn.q_norm.weight", dtype, (head_dim,)),
            (f"{p}.self_attn.k_norm.weight", dtype, (head_dim,)),
            (f"{p}.post_attention_layernorm.weight", dtype, (hidden,)),
            (f"{p}.mlp.gate.weight", dtype, (experts, hidden)),
        ]
        for e in range(experts):
            q = f"{p}.mlp.experts.{e}"
            out += [
                (f"{q}.gate_proj.weight", dtype, (moe_intermediate, hidden)),
                (f"{q}.up_proj.weight", dtype, (moe_intermediate, hidden)),
                (f"{q}.down_proj.weight", dtype, (hidden, moe_intermediate)),
            ]
    out += [("model.norm.weight", dtype, (hidden,)), ("lm_head.weight", dtype, (vocab, hidden))]
    return out


def deepseek_v3(layers=61, dense_layers=3, hidden=7168, intermediate=18432, experts=256,
                moe_intermediate=2048, heads=128, q_lora=1536, kv_lora=512, nope=128, rope=64,
                v_head=128, vocab=129280, mtp_layers=1) -> list[Tensor]:
    """DeepSeek-V3 as released: FP8 (F8_E4M3) weights with F32 128x128 block scales.

    Layer 61 is the multi-token-prediction layer, stored in the same stack.
    About 91k tensors.
    """
    def fp8(name, shape):
        rows, cols = shape
        return [(name, "F8_E4M3", shape),
                (name + "_scale_inv", "F32", (-(-rows // 128), -(-cols // 128)))]

    out: list[Tensor] = [("model.embed_tokens.weight", "BF16", (vocab, hidden))]
    for i in range(layers + mtp_layers):
        p = f"model.layers.{i}"
        out += [(f"{p}.input_layernorm.weight", "BF16", (hidden,)),
                (f"{p}.post_attention_layernorm.weight", "BF16", (hidden,)),
                (f"{p}.self_attn.q_a_layernorm.weight", "BF16", (q_lora,)),
                (f"{p}.self_attn.kv_a_layernorm.weight", "BF16", (kv_lora,))]
        out += fp8(f"{p}.self_attn.q_a_proj.weight", (q_lora, hidden))
        out += fp8(f"{p}.self_attn.q_b_proj.weight", (heads * (nope + rope), q_lora))
        out += fp8(f"{p}.self_attn.kv_a_proj_with_mqa.weight", (kv_lora + rope, hidden))
        out += fp8(f"{p}.self_attn.kv_b_proj.weight", (heads * (nope + v_head), kv_lora))
        out += fp8(f"{p}.self_attn.o_proj.weight", (hidden, heads * v_head))
        if i < dense_layers:
            out += fp8(f"{p}.mlp.gate_proj.weight", (intermediate, hidden))
            out += fp8(f"{p}.mlp.up_proj.weight", (intermediate, hidden))
            out += fp8(f"{p}.mlp.down_proj.weight", (hidden, intermediate))
            continue
        out += [(f"{p}.mlp.gate.weight", "BF16", (experts, hidden)),
                (f"{p}.mlp.gate.e_score_correction_bias", "F32", (experts,))]
        for e in [*range(experts), "shared"]:
            q = f"{p}.mlp.experts.{e}" if e != "shared" else f"{p}.mlp.shared_experts"
            out += fp8(f"{q}.gate_proj.weight", (moe_intermediate, hidden))
            out += fp8(f"{q}.up_proj.weight", (moe_intermediate, hidden))
            out += fp8(f"{q}.down_proj.weight", (hidden, moe_intermediate))
        if i >= layers:  # the MTP layer's extra modules
            out += [(f"{p}.enorm.weight", "BF16", (hidden,)), (f"{p}.hnorm.weight", "BF16", (hidden,)),
                    (f"{p}.eh_proj.weight", "BF16", (hidden, 2 * hidden)),
                    (f"{p}.shared_head.norm.weight", "BF16", (hidden,)),
                    (f"{p}.shared_head.head.weight", "BF16", (vocab, hidden))]
    out += [("model.norm.weight", "BF16", (hidden,)), ("lm_head.weight", "BF16", (vocab, hidden))]
    return out


def kimi_k2() -> list[Tensor]:
    """Kimi-K2 (Kimi-K2-Instruct's config.json) as released: DeepSeek-V3's architecture, FP8 block-scaled,
    with 61 layers of which the first is dense, 384 routed experts and one shared, 64 heads, a 163,840-token
    vocabulary and no multi-token-prediction layer. About 140k tensors."""
    return deepseek_v3(layers=61, dense_layers=1, experts=384, heads=64, vocab=163840, mtp_layers=0)


def qwen2_vl(layers=28, hidden=1536, intermediate=8960, heads=12, kv_heads=2, vocab=151936, depth=32,
             vision=1280, vision_mlp=5120, patch=14, temporal=2, dtype="BF16") -> list[Tensor]:
    """Qwen2-VL-2B by default: a ViT (`visual.blocks`) whose merger (`visual.merger.mlp.0` and `.2`: an
    nn.Sequential around a GELU) projects into the text model's embedding space."""
    out: list[Tensor] = [("visual.patch_embed.proj.weight", dtype, (vision, 3, temporal, patch, patch))]
    for i in range(depth):
        p = f"visual.blocks.{i}"
        for norm in ("norm1", "norm2"):
            out += [(f"{p}.{norm}.weight", dtype, (vision,)), (f"{p}.{norm}.bias", dtype, (vision,))]
        out += [(f"{p}.attn.qkv.weight", dtype, (3 * vision, vision)), (f"{p}.attn.qkv.bias", dtype, (3 * vision,)),
                (f"{p}.attn.proj.weight", dtype, (vision, vision)), (f"{p}.attn.proj.bias", dtype, (vision,)),
                (f"{p}.mlp.fc1.weight", dtype, (vision_mlp, vision)), (f"{p}.mlp.fc1.bias", dtype, (vision_mlp,)),
                (f"{p}.mlp.fc2.weight", dtype, (vision, vision_mlp)), (f"{p}.mlp.fc2.bias", dtype, (vision,))]
    merged = 4 * vision  # 2x2 patches merged
    out += [("visual.merger.ln_q.weight", dtype, (vision,)), ("visual.merger.ln_q.bias", dtype, (vision,)),
            ("visual.merger.mlp.0.weight", dtype, (merged, merged)), ("visual.merger.mlp.0.bias", dtype, (merged,)),
            ("visual.merger.mlp.2.weight", dtype, (hidden, merged)), ("visual.merger.mlp.2.bias", dtype, (hidden,))]
    text = [t for t in llama(layers, hidden, intermediate, heads, kv_heads, vocab, dtype=dtype)]
    hd = hidden // heads
    for i in range(layers):
        p = f"model.layers.{i}.self_attn"
        text += [(f"{p}.q_proj.bias", dtype, (heads * hd,)), (f"{p}.k_proj.bias", dtype, (kv_heads * hd,)),
                 (f"{p}.v_proj.bias", dtype, (kv_heads * hd,))]
    return out + text


def gpt_oss(layers=36, hidden=2880, intermediate=2880, experts=128, heads=64, kv_heads=8, head_dim=64,
            vocab=201088, mxfp4=True) -> list[Tensor]:
    """gpt-oss-120b by default: experts stored already fused, one tensor per parameter holding all E.

    `mxfp4` (as released): each expert weight in MXFP4, 32 values per 16-byte block with one U8
    scale, `gate_up_proj_blocks` [E, 2I, H/32, 16] and `_scales` [E, 2I, H/32] (`down_proj_*`
    likewise, [E, H, I/32, ...]); else as transformers' save_pretrained writes it in BF16,
    `gate_up_proj` [E, H, 2I] and `down_proj` [E, I, H]. Biases [E, 2I] and [E, H] either way.
    """
    out: list[Tensor] = [("model.embed_tokens.weight", "BF16", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}"
        out += [(f"{p}.input_layernorm.weight", "BF16", (hidden,)),
                (f"{p}.self_attn.q_proj.weight", "BF16", (heads * head_dim, hidden)),
                (f"{p}.self_attn.q_proj.bias", "BF16", (heads * head_dim,)),
                (f"{p}.self_attn.k_proj.weight", "BF16", (kv_heads * head_dim, hidden)),
                (f"{p}.self_attn.k_proj.bias", "BF16", (kv_heads * head_dim,)),
                (f"{p}.self_attn.v_proj.weight", "BF16", (kv_heads * head_dim, hidden)),
                (f"{p}.self_attn.v_proj.bias", "BF16", (kv_heads * head_dim,)),
                (f"{p}.self_attn.o_proj.weight", "BF16", (hidden, heads * head_dim)),
                (f"{p}.self_attn.o_proj.bias", "BF16", (hidden,)),
                (f"{p}.self_attn.sinks", "BF16", (heads,)),
                (f"{p}.post_attention_layernorm.weight", "BF16", (hidden,)),
                (f"{p}.mlp.router.weight", "BF16", (experts, hidden)),
                (f"{p}.mlp.router.bias", "BF16", (experts,))]
        q = f"{p}.mlp.experts"
        if mxfp4:
            for proj, rows, cols in (("gate_up_proj", 2 * intermediate, hidden), ("down_proj", hidden, intermediate)):
                out += [(f"{q}.{proj}_blocks", "U8", (experts, rows, cols // 32, 16)),
                        (f"{q}.{proj}_scales", "U8", (experts, rows, cols // 32)),
                        (f"{q}.{proj}_bias", "BF16", (experts, rows))]
        else:
            out += [(f"{q}.gate_up_proj", "BF16", (experts, hidden, 2 * intermediate)),
                    (f"{q}.gate_up_proj_bias", "BF16", (experts, 2 * intermediate)),
                    (f"{q}.down_proj", "BF16", (experts, intermediate, hidden)),
                    (f"{q}.down_proj_bias", "BF16", (experts, hidden))]
    out += [("model.norm.weight", "BF16", (hidden,)), ("lm_head.weight", "BF16", (vocab, hidden))]
    return out


def llama4_text(layers=48, hidden=5120, intermediate=8192, intermediate_mlp=16384, experts=128, moe_every=2,
                heads=40, kv_heads=8, head_dim=128, vocab=202048) -> list[Tensor]:
    """Llama-4-Maverick's text model by default, named as transformers 5.17's save_pretrained writes
    Llama4ForConditionalGeneration (`language_model.model.layers.N`; the vision tower left out):
    every `moe_every`-th layer (1, 3, 5, ...) is MoE, its routed experts stored already fused,
    `feed_forward.experts.gate_up_proj` [E, H, 2I] and `down_proj` [E, I, H], beside a shared
    expert; the others have a dense MLP of `intermediate_mlp`."""
    lm = "language_model.model"
    out: list[Tensor] = [(f"{lm}.embed_tokens.weight", "BF16", (vocab, hidden))]
    for i in range(layers):
        p = f"{lm}.layers.{i}"
        out += [(f"{p}.input_layernorm.weight", "BF16", (hidden,)),
                (f"{p}.self_attn.q_proj.weight", "BF16", (heads * head_dim, hidden)),
                (f"{p}.self_attn.k_proj.weight", "BF16", (kv_heads * head_dim, hidden)),
                (f"{p}.self_attn.v_proj.weight", "BF16", (kv_heads * head_dim, hidden)),
                (f"{p}.self_attn.o_proj.weight", "BF16", (hidden, heads * head_dim)),
                (f"{p}.post_attention_layernorm.weight", "BF16", (hidden,))]
        f = f"{p}.feed_forward"
        if i % moe_every == moe_every - 1:
            out += [(f"{f}.router.weight", "BF16", (experts, hidden)),
                    (f"{f}.experts.gate_up_proj", "BF16", (experts, hidden, 2 * intermediate)),
                    (f"{f}.experts.down_proj", "BF16", (experts, intermediate, hidden)),
                    (f"{f}.shared_expert.gate_proj.weight", "BF16", (intermediate, hidden)),
                    (f"{f}.shared_expert.up_proj.weight", "BF16", (intermediate, hidden)),
                    (f"{f}.shared_expert.down_proj.weight", "BF16", (hidden, intermediate))]
        else:
            out += [(f"{f}.gate_proj.weight", "BF16", (intermediate_mlp, hidden)),
                    (f"{f}.up_proj.weight", "BF16", (intermediate_mlp, hidden)),
                    (f"{f}.down_proj.weight", "BF16", (hidden, intermediate_mlp))]
    out += [(f"{lm}.norm.weight", "BF16", (hidden,)), ("language_model.lm_head.weight", "BF16", (vocab, hidden))]
    return out
