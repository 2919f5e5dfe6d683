"""MXFP4 experts end to end: gpt-oss-120b's shape, decode at batch 1 replayed from a CUDA graph, with each way CUDA
has multiplied MXFP4 experts in turn, in one process.

    python3 docs/memory-peak/gpt_oss_decode.py OUT_DIR [LAYERS [VARIANTS]]  # on a GPU; OUT_DIR/gpt-oss-decode.jsonl

The checkpoint is written as gpt-oss ships (`*_proj_blocks` [E, out, in/32, 16] and `*_proj_scales` [E, out, in/32],
the rest bf16): gpt-oss-120b's shapes (GptOssConfig's defaults: 128 experts, top-4, hidden 2880) and LAYERS of its 36
decoder layers (8 unless given), random codes under scales 2^-8 to 2^-6, random bf16 elsewhere (normal, std 0.02;
norms ones). Two plans: every routed expert on uva (`rules: [{match: [experts], place: uva}]`), and all on the GPU.
The variants, for the experts a step touches (4 a layer at batch 1), gathered:

- `torch`: dequantized by the torch arithmetic (`_mxfp4`, then the transpose made contiguous), then multiplied;
  what CUDA ran before the kernels;
- `flat`: dequantized by `_mxfp4_flat_kernel` (one thread a stored byte), the first kernel, then multiplied;
- `tiled`: dequantized by `_mxfp4_tiled_kernel` (tiles stored along the output's rows), then multiplied;
- `fused`: gemv.py's `mxfp4_pairs`, which multiplies the stored bytes in registers: what this tree runs.

Argument 3 picks the variants (comma-separated; `tiled,fused` unless given). Each gets a fresh capture (the
generator dropped), and they run in turn over `ROUNDS` rounds: one line per (plan, round, variant) with its steps/s
and whether its tokens equal the first variant's (the dequantized values are bitwise equal, so the three dequantizing
variants' must; the fused one sums in another order, within a rounding). The floor of the uva plan: the MXFP4 bytes
(blocks and scales) and bf16 biases of the 4 experts a token touches per layer, over the UVA read rate measured in
the run.
"""
import gc
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from harness.loops import decode_static, prompts  # noqa: E402
from harness.plans import make_plan  # noqa: E402
from runtime.place import dequant, gemv  # noqa: E402

OUT = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/out")
LAYERS = int(sys.argv[2]) if len(sys.argv) > 2 else 8
CHOSEN = (sys.argv[3] if len(sys.argv) > 3 else "tiled,fused").split(",")
WORK = Path("/tmp/offplan-bench/gpt-oss")
ROUNDS, NEW = 2, 32
EXPERTS = ("experts.gate_up_proj", "experts.down_proj")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where the random values are drawn


def emit(**row):
    print(json.dumps(row), flush=True)
    with open(OUT / "gpt-oss-decode.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def write_checkpoint(directory: Path):
    """gpt-oss-120b's shapes, LAYERS decoder layers, one shard per layer (module doc)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, GptOssConfig
    if (directory / "model.safetensors.index.json").is_file():
        return json.loads((directory / "config.json").read_text())["num_hidden_layers"] == LAYERS
    config = GptOssConfig(num_hidden_layers=LAYERS, layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2),
                          max_position_embeddings=4096)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    g = torch.Generator(device=DEVICE).manual_seed(0)
    directory.mkdir(parents=True)
    weight_map, files = {}, {}
    for name, shape in shapes.items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        files.setdefault(layer, {})[name] = shape
    for layer, names in files.items():
        shard, file = {}, f"model-{layer}.safetensors"
        for name, shape in names.items():
            if name.endswith(EXPERTS):  # [E, in, out] held; stored [E, out, in/32, 16] and [E, out, in/32]
                e, rows, cols = shape[0], shape[2], shape[1]
                shard[name + "_blocks"] = torch.randint(0, 256, (e, rows, cols // 32, 16), dtype=torch.uint8,
                                                        device=DEVICE, generator=g).cpu()
                shard[name + "_scales"] = torch.randint(119, 122, (e, rows, cols // 32), dtype=torch.uint8,
                                                        device=DEVICE, generator=g).cpu()
            elif "norm" in name:
                shard[name] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                value = torch.empty(shape, dtype=torch.bfloat16, device=DEVICE)
                shard[name] = value.normal_(0, 0.02, generator=g).cpu()
        save_file(shard, directory / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    index = {"weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    saved = config.to_dict() | {"architectures": ["GptOssForCausalLM"], "dtype": "bfloat16", "quantization_config": {
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                            "model.embed_tokens", "lm_head"]}}
    (directory / "config.json").write_text(json.dumps(saved, indent=2))
    return True


def touched_bytes(directory: Path, top_k: int = 4) -> int:
    """The experts' stored bytes (blocks, scales, biases) a token reads per step: k of E experts a layer."""
    from planner.inputs.checkpoint import open_checkpoint
    info = open_checkpoint(directory)
    return sum(t.nbytes * top_k // t.shape[0] for name, t in info.tensors.items() if ".experts." in name)


def flat_transposed(blocks, scales, dtype, transposed):
    """The first kernel for every layout: one thread a stored byte, through the output's strides."""
    if not transposed:
        return ORIGINAL(blocks, scales, dtype, transposed)
    rows, groups, _ = blocks.shape[-3:]
    cols, n = 32 * groups, blocks.numel()
    out = torch.empty(dequant._mxfp4_shape(blocks, True), dtype=dtype, device=blocks.device)
    dequant._mxfp4_flat_kernel[(dequant.triton.cdiv(n, 1024),)](
        out.view(torch.int16), blocks.contiguous(), scales.contiguous(), n, rows, 16 * groups, rows * cols, 1, rows,
        BLOCK=1024)
    return out


def torch_arithmetic(blocks, scales, dtype, transposed):
    out = dequant._mxfp4(blocks, scales, dtype)
    return out.transpose(-2, -1).contiguous() if transposed else out


ORIGINAL, FUSES = dequant._dequant_mxfp4, gemv.mxfp4_applies
VARIANTS = {"torch": (torch_arithmetic, False), "flat": (flat_transposed, False), "tiled": (ORIGINAL, False),
            "fused": (ORIGINAL, True)}  # (the dequantization, whether one token's experts run mxfp4_pairs)


def main():
    from runtime.hf import from_pretrained
    from runtime.measure.calibrate import calibrate
    OUT.mkdir(parents=True, exist_ok=True)
    ckpt = WORK / f"ckpt-{LAYERS}"
    t = time.perf_counter()
    if not write_checkpoint(ckpt):
        raise SystemExit(f"{ckpt} holds another depth: remove it")
    emit(kind="checkpoint", layers=LAYERS, seconds=round(time.perf_counter() - t, 1),
         device=torch.cuda.get_device_name(), torch=torch.__version__)
    uva = calibrate().hardware.uva_read_gbps
    floor = uva * 1e9 / touched_bytes(ckpt)
    emit(kind="floor", uva_read_gbps=uva, touched_bytes=touched_bytes(ckpt), floor_steps_per_s=floor)
    ids = prompts(201088, "cuda")
    for plan_name, body in (("experts-uva", "rules:\n  - match: [experts]\n    place: uva\n"), ("gpu", "")):
        plan = make_plan(WORK, f"{plan_name}-{LAYERS}", f"format_version: 1\ncheckpoint: {ckpt.name}\n{body}")
        model, handle = from_pretrained(plan, device="cuda", progress=False)
        first = None
        for r in range(ROUNDS):
            for name in CHOSEN:
                run, fuses = VARIANTS[name]
                for generator in handle.generators.values():
                    generator.release()
                handle.generators.clear()
                dequant._dequant_mxfp4 = run
                gemv.mxfp4_applies = FUSES if fuses else lambda *_: False
                try:
                    steps, tokens = decode_static(model, handle, ids, NEW, "graph")
                finally:
                    dequant._dequant_mxfp4, gemv.mxfp4_applies = ORIGINAL, FUSES
                first = first or tokens
                emit(kind="decode", plan=plan_name, round=r, variant=name, steps_per_s=steps,
                     x_floor=steps / floor if plan_name == "experts-uva" else None, same_tokens=tokens == first)
        handle.remove(restore=False)
        del model, handle
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
