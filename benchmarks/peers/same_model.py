"""Is the GGUF that to_gguf.py writes the same model? llama.cpp's logits against transformers', on one prompt.

    benchmarks/peers/stage.sh && LLAMA_CUDA=OFF benchmarks/peers/build.sh .peers /tmp/llama-cpu
    python benchmarks/peers/same_model.py --build /tmp/llama-cpu [--out benchmarks/results]

A tiny Qwen3-MoE (harness/checkpoints.py's `tiny-128`: 2 layers, 8 experts, top-2; transformers' initialisation),
with `norm_topk_prob: true` as Qwen3-30B-A3B ships it (llama.cpp's qwen3moe normalizes the routing weights always),
written as BF16 GGUF; logits.cpp (beside this file, compiled against the build's static libraries) evaluates a
12-token prompt with llama.cpp on the CPU and prints the last token's logits; transformers computes the same in
float32 from the safetensors. llama.cpp's CPU backend rounds each activation to bf16 before a bf16 matmul, so the
two differ by rounding; the check asks the same top 5 tokens in the same order and a largest difference within 1%
of the largest logit. Exit 1 otherwise. Writes OUT/peers-same-model.json.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from harness.checkpoints import make_checkpoint  # noqa: E402
from to_gguf import write_gguf  # noqa: E402

PROMPT = [5, 17, 300, 42, 99, 7, 256, 3, 11, 480, 64, 1]


def compile_logits(build: Path, source: Path, out: Path) -> Path:
    libs = [build / "src/libllama.a", build / "ggml/src/libggml.a", build / "ggml/src/libggml-cpu.a",
            build / "ggml/src/libggml-base.a"]
    missing = [str(l) for l in libs if not l.is_file()]
    if missing:
        raise SystemExit(f"error: {build}: no {', '.join(missing)}; build llama.cpp for the CPU first "
                         "(LLAMA_CUDA=OFF benchmarks/peers/build.sh .peers BUILD)")
    subprocess.run(["g++", "-O2", "-std=c++17", str(HERE / "logits.cpp"), f"-I{source}/include",
                    f"-I{source}/ggml/include", *map(str, libs), "-fopenmp", "-lpthread", "-o", str(out)], check=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", type=Path, required=True, help="a CPU build of llama.cpp (build.sh's BUILD)")
    ap.add_argument("--source", type=Path, help="the llama.cpp source it was built from (default: BUILD/source)")
    ap.add_argument("--out", type=Path, default=HERE.parent / "results")
    args = ap.parse_args(argv)
    args.source = args.source or args.build / "source"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        binary = compile_logits(args.build, args.source, work / "logits")
        ckpt = make_checkpoint("tiny-128", 2, work / "ckpt", "cpu")
        config = json.loads((ckpt / "config.json").read_text())
        config["norm_topk_prob"] = True
        (ckpt / "config.json").write_text(json.dumps(config))
        gguf = write_gguf(ckpt, work / "model.gguf", "bf16")
        done = subprocess.run([str(binary), str(gguf), *map(str, PROMPT)], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"logits failed ({done.returncode}):\n{done.stderr[-2000:]}")
        theirs = torch.tensor([float(x) for x in done.stdout.split()])
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
        with torch.no_grad():
            ours = model(torch.tensor([PROMPT])).logits[0, -1]
        shutil.rmtree(work / "ckpt")
    diff = float((theirs - ours).abs().max())
    scale = float(ours.abs().max())
    top = (theirs.topk(5).indices.tolist(), ours.topk(5).indices.tolist())
    ok = top[0] == top[1] and diff <= 0.01 * scale
    commit = HERE.parent.parent / ".peers" / "COMMIT"
    record = {"llama_cpp": commit.read_text().strip() if commit.is_file() else None,
              "prompt": PROMPT, "max_abs_diff": diff, "largest_logit": scale, "ratio": diff / scale,
              "top5_llama_cpp": top[0], "top5_transformers": top[1],
              "cosine": float(torch.nn.functional.cosine_similarity(theirs, ours, dim=0)), "same_model": ok}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peers-same-model.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
