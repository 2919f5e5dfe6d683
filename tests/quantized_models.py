"""Tiny quantized checkpoints for the runtime tests, written from the formats' published layouts.

Independent of runtime/place/quant.py on purpose: the runtime must read what other
tools write, not what it writes itself.

- FP8 block-scaled, as DeepSeek-V3 and Qwen3-FP8 ship (config.json
  `quantization_config: {quant_method: fp8, fmt: e4m3, weight_block_size: [128, 128]}`):
  every linear projection `*_proj.weight` [R, C] becomes F8_E4M3 with
  `*_proj.weight_scale_inv` F32 [ceil(R/b), ceil(C/b)] (b = 128 as shipped;
  `write_fp8(block=)` writes square blocks of another size), the factor that
  multiplies the FP8 values back (scale = block amax / 448). Embeddings,
  norms, routers and the head stay bf16.
- MXFP4, as gpt-oss ships (OCP Microscaling v1.0: 32-element blocks of E2M1
  values sharing one E8M0 scale): each fused expert parameter `P` [E, H, 2I]
  is stored transposed as `P_blocks` U8 [E, 2I, H/32, 16] (two values a
  byte, the low nibble holding the even element) and `P_scales` U8
  [E, 2I, H/32] (the exponent + 127).

`reference_dir` writes the same checkpoint dequantized with the same formula
(f32 product, rounded once to bf16) as a plain bf16 checkpoint, which
transformers' `from_pretrained` loads: the tests' expected outputs.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

E4M3_MAX = 448.0
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _blocks(w: torch.Tensor, b: int = 128) -> torch.Tensor:
    """w [R, C] padded to whole b x b blocks, as [R/b, b, C/b, b]."""
    rows, cols = w.shape
    padded = torch.zeros(-(-rows // b) * b, -(-cols // b) * b, device=w.device)
    padded[:rows, :cols] = w
    return padded.view(padded.shape[0] // b, b, padded.shape[1] // b, b)


def fp8_quantize(w: torch.Tensor, b: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(F8_E4M3 values [R, C], scale_inv F32 [ceil(R/b), ceil(C/b)]) of a weight, block by block."""
    blocks = _blocks(w.float(), b)
    scale = (blocks.abs().amax(dim=(1, 3)) / E4M3_MAX).clamp(min=1e-12)  # [R/b, C/b]
    q = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    q = q.view(blocks.shape[0] * b, blocks.shape[2] * b)[:w.shape[0], :w.shape[1]].contiguous()
    return q, scale


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor, b: int = 128) -> torch.Tensor:
    full = scale.repeat_interleave(b, 0).repeat_interleave(b, 1)[:q.shape[0], :q.shape[1]]
    return (q.float() * full).to(torch.bfloat16)


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks U8 [..., R, C/32, 16], scales U8 [..., R, C/32]) of w [..., R, C]."""
    x = w.float().reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = x.abs().amax(dim=-1).clamp(min=2.0**-120)
    exponent = torch.ceil(torch.log2(amax / 6.0))  # the block's largest value fits E2M1's 6
    scaled = x / torch.exp2(exponent)[..., None]
    codes = (scaled[..., None] - E2M1).abs().argmin(dim=-1).to(torch.uint8)  # nearest E2M1 value
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), (exponent + 127).to(torch.uint8)


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()  # [..., R, G, 32]
    values = E2M1[codes] * torch.exp2(scales.float() - 127)[..., None]
    return values.flatten(-2).to(torch.bfloat16)


def _rewrite(src: Path, dst: Path, convert, quantization_config: dict | None) -> Path:
    """Copy checkpoint `src` to `dst`, each shard's tensors passed through `convert(name, tensor) -> dict`."""
    dst.mkdir(parents=True, exist_ok=True)
    index = _index(src)
    weight_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        out = {}
        for name, t in load_file(src / shard).items():
            out.update(convert(name, t))
        save_file(out, dst / shard, metadata={"format": "pt"})
        weight_map.update({n: shard for n in out})
    if (src / "model.safetensors.index.json").is_file():
        index["weight_map"] = weight_map
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = json.loads((src / "config.json").read_text())
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for extra in ("generation_config.json",):
        if (src / extra).exists():
            shutil.copy(src / extra, dst / extra)
    return dst


def _index(root: Path) -> dict:
    """The checkpoint's index, or one made up for a single-file checkpoint."""
    if (root / "model.safetensors.index.json").is_file():
        return json.loads((root / "model.safetensors.index.json").read_text())
    return {"weight_map": {n: "model.safetensors" for n in load_file(root / "model.safetensors")}}


def _is_projection(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and name.endswith("_proj.weight")


def write_fp8(src: Path, dst: Path, device: str = "cpu", block: int = 128) -> Path:
    """`src` (a save_pretrained checkpoint) as a block-scaled FP8 checkpoint (module doc), `block` x `block`
    elements a scale; `device` does the arithmetic (the benchmark's gigabytes quantize faster on a GPU)."""
    def convert(name, t):
        if not _is_projection(name, t):
            return {name: t}
        q, scale = fp8_quantize(t.to(device), block)
        return {name: q.cpu(), name + "_scale_inv": scale.cpu()}
    return _rewrite(src, dst, convert, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                        "weight_block_size": [block, block]})


def write_mxfp4(src: Path, dst: Path) -> Path:
    """`src` (a bf16 gpt-oss save_pretrained checkpoint) with MXFP4 experts (module doc)."""
    def convert(name, t):
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            return {name: t}
        blocks, scales = mxfp4_quantize(t.transpose(1, 2))  # stored [E, out, in]
        return {name + "_blocks": blocks, name + "_scales": scales}
    return _rewrite(src, dst, convert, {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]})


def reference_dir(quantized: Path, dst: Path) -> Path:
    """The quantized checkpoint dequantized on the host, as a plain bf16 checkpoint (module doc)."""
    block = (json.loads((quantized / "config.json").read_text()).get("quantization_config") or {}).get(
        "weight_block_size", [128])[0]

    def convert(name, t):
        if name.endswith("_scale_inv") or name.endswith("_scales"):
            return {}
        if t.dtype == torch.float8_e4m3fn:
            return {name: fp8_dequantize(t, load_scale(name + "_scale_inv"), block)}
        if name.endswith("_blocks"):
            base = name[:-len("_blocks")]
            return {base: mxfp4_dequantize(t, load_scale(base + "_scales")).transpose(1, 2).contiguous()}
        return {name: t}
    everything = {}
    for shard in sorted(set(_index(quantized)["weight_map"].values())):
        everything.update(load_file(quantized / shard))

    def load_scale(name):
        return everything[name]
    out = _rewrite(quantized, dst, convert, None)
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
