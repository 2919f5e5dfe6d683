#!/usr/bin/env bash
# FP8 experts computed on the host's cores beside the link, through the front door, and llama.cpp's Q8_0 beside them,
# in one run on a GPU machine (issue 24: FP8 on cpu, its speed; issue 29: the 8-bit row). From the project's root,
# with a peers/build.sh source staged in .peers (benchmarks/peers/stage.sh) and OUT set:
#
#   bash docs/fp8-cpu/run.sh      # OUT/fp8-cpu.jsonl: one JSON line per run, then the table on stdout
#
# The checkpoint is benchmarks/peers.py's (8 random bf16 layers of Qwen3-30B-A3B's shape, the same seed), quantized
# to block-scaled FP8 as DeepSeek-V3 ships it (tests/quantized_models.py), and written as Q8_0 GGUF from the bf16 one
# (benchmarks/peers/to_gguf.py). Plans, built as a user builds them with a profile `plan calibrate` measures first:
# fp8-uva (every routed expert on uva) and fp8-split (`backend: mixed`, `cpu_experts: true`, the fp8-uva plan's GPU
# footprint as the budget). Each runs `plan apply PLAN --max-new-tokens 64 --json` (a CUDA graph) and with --compile.
set -euo pipefail
W=${W:-/tmp/fp8-cpu} MODEL=${MODEL:-qwen3-30b-a3b} LAYERS=${LAYERS:-8} DEVICE=${DEVICE:-cuda}  # a smoke test: MODEL=tiny-128 LAYERS=2 DEVICE=cpu HW=profile.yaml
mkdir -p "$W" "$OUT"
[ "$DEVICE" = cpu ] || (bash benchmarks/peers/build.sh > "$OUT/build.log" 2>&1) &
python3 - "$W" "$MODEL" "$LAYERS" "$DEVICE" <<'PY'
import sys
sys.path[:0] = ["benchmarks", "tests"]
from pathlib import Path
from harness.checkpoints import make_checkpoint
from quantized_models import write_fp8
w = Path(sys.argv[1])
ckpt = make_checkpoint(sys.argv[2], int(sys.argv[3]), w / "ckpt", sys.argv[4])
if not (w / "fp8" / "model.safetensors.index.json").is_file():
    write_fp8(ckpt, w / "fp8", device=sys.argv[4])
PY
wait
[ -x build/llama.cpp/bin/llama-bench ] && python3 - "$W" <<'PY'
import sys
sys.path[:0] = ["benchmarks/peers"]
from pathlib import Path
from llama_cpp import gguf_writer
w = Path(sys.argv[1])
if not (w / "model-q8_0.gguf").is_file():
    gguf_writer(Path("build/llama.cpp/bin"))(w / "ckpt", w / "model-q8_0.gguf", "q8_0")
PY
sync
if [ -n "${HW:-}" ]; then cp "$HW" "$W/hw.yaml"; else python3 -m offplan calibrate -o "$W/hw.yaml" > "$OUT/calibrate.log"; fi
printf 'format_version: 1\ncheckpoint: fp8\nhardware: hw.yaml\nrules:\n  - {match: [experts], place: uva}\n' > "$W/fp8-uva.policy.yaml"
python3 -m offplan build "$W/fp8-uva.policy.yaml" > /dev/null
budget=$(python3 -c "from planner.planfile import load_plan; print(repr(load_plan('$W/fp8-uva.plan.yaml').summary.gpu_footprint_bytes / 2**30))")
printf 'format_version: 1\ncheckpoint: fp8\nhardware: hw.yaml\nbackend: mixed\ncpu_experts: true\nbudget_gib: %s\nworkload: {cuda_graphs: true, batch_size: 1}\n' "$budget" > "$W/fp8-split.policy.yaml"
python3 -m offplan build "$W/fp8-split.policy.yaml" > /dev/null
python3 -m offplan show "$W/fp8-split.plan.yaml" > "$OUT/fp8-split.show.txt"
: > "$OUT/fp8-cpu.jsonl"
for plan in fp8-uva fp8-split; do
    for how in "" --compile; do
        python3 -m offplan apply "$W/$plan.plan.yaml" --max-new-tokens 64 --json --device "$DEVICE" $how > "$W/run.json"
        python3 - "$W/run.json" "$plan" "${how:-graph}" >> "$OUT/fp8-cpu.jsonl" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(json.dumps({"plan": sys.argv[2], "how": sys.argv[3], "mode": r["mode"], "decode_tokens_per_s": r["decode_tokens_per_s"],
                  "predicted_step_us": r["predicted_step_us"], "tokens": r["sequences"][0]["token_ids"]}))
PY
    done
done
[ -x build/llama.cpp/bin/llama-bench ] && build/llama.cpp/bin/llama-bench -m "$W/model-q8_0.gguf" -ngl 99 --n-cpu-moe 8 -p 0 -n 64 -t 16 -o jsonl 2> "$OUT/llama.log" \
    | python3 -c "import json, sys; [print(json.dumps({'plan': 'llama.cpp Q8_0 --n-cpu-moe 8', 'how': 'llama-bench -p 0 -n 64 -t 16', 'decode_tokens_per_s': json.loads(l)['avg_ts']})) for l in sys.stdin if l.startswith('{')]" >> "$OUT/fp8-cpu.jsonl"
cut -c1-200 "$OUT/fp8-cpu.jsonl"
