# Every FP8 expert on cpu, then on uva, through plan apply (graph), on the GPU machine: OUT set, .device staged
# (../shared/device/stage.sh). Records: every-expert-on-{cpu,uva}-h200.txt.
source .device/env.sh >/dev/null && bash .device/build.sh || exit 1
W=/tmp/f8; mkdir -p $W; T=$(date +%s)
python3 - <<'PY'
import sys
sys.path[:0] = ["benchmarks", "tests"]
from pathlib import Path
from harness.checkpoints import make_checkpoint
from quantized_models import write_fp8
ck = make_checkpoint("qwen3-30b-a3b", 8, Path("/tmp/f8/ckpt"), "cuda")
write_fp8(ck, Path("/tmp/f8/fp8"), device="cuda")
PY
echo "ckpt $(( $(date +%s)-T ))s"; sync
cp .device/h200.yaml $W/hw.yaml
printf 'format_version: 1\ncheckpoint: fp8\nhardware: hw.yaml\nrules:\n  - {match: [experts], place: cpu}\nworkload: {cuda_graphs: true}\n' > $W/fp8-cpu.policy.yaml
printf 'format_version: 1\ncheckpoint: fp8\nhardware: hw.yaml\nrules:\n  - {match: [experts], place: uva}\nworkload: {cuda_graphs: true}\n' > $W/fp8-uva.policy.yaml
for p in fp8-cpu fp8-uva; do python3 -m offplan build $W/$p.policy.yaml > /dev/null && python3 -m offplan apply $W/$p.plan.yaml --max-new-tokens 64 > $OUT/$p.txt 2>&1; echo "$p rc=$? $(( $(date +%s)-T ))s"; grep -E "decode|predicted|token ids" $OUT/$p.txt | cut -c1-200; done
python3 -m offplan show $W/fp8-cpu.plan.yaml | grep -E "host CPU|predicted at" > $OUT/show.txt; cat $OUT/show.txt | cut -c1-250
