"""Experts on cpu through the front door: the runtime's generation (as benchmarks/peers.py measures it) against
`plan apply`, the same plan, one machine lease. 8 layers of Qwen3-30B-A3B's shape, random bf16; the plan puts
the first 70% of every layer's experts on cpu and the rest on uva (moe.py run3's best batch-1 share).

    python docs/host-experts/front_door_cpu.py --out DIR     # writes DIR/front-door-cpu.json
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from harness.checkpoints import config_for, make_checkpoint  # noqa: E402
from harness.loops import prompts  # noqa: E402
from harness.plans import make_plan  # noqa: E402

NEW = 64


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/front-door-cpu"))
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    import torch
    from runtime.hf import from_pretrained
    config = config_for("qwen3-30b-a3b", 8)
    args.dir.mkdir(parents=True, exist_ok=True)
    make_checkpoint("qwen3-30b-a3b", 8, args.dir / "ckpt", "cuda")
    share = "|".join(str(e) for e in range(round(0.7 * config.num_experts)))
    plan = make_plan(args.dir, "split70", "format_version: 1\ncheckpoint: ckpt\nworkload: {cuda_graphs: true}\n"
                     f"rules:\n  - {{match: ['re:experts\\.({share})\\.'], place: cpu}}\n"
                     "  - {match: [experts], place: uva}\n")
    model, handle = from_pretrained(plan, progress=False)
    ids = prompts(config.vocab_size, "cuda")[:1]
    gen = handle.generator()
    gen.prepare(ids, NEW + 1)
    rates = [gen(ids, NEW + 1).decode_tokens_per_s for _ in range(3)]
    handle.remove(restore=False)
    del model, handle
    torch.cuda.empty_cache()
    done = subprocess.run([sys.executable, "-m", "offplan", "apply", str(plan), "--max-new-tokens", str(NEW)],
                          capture_output=True, text=True, cwd=ROOT)
    found = re.search(r"decode ([\d.]+) tokens/s", done.stdout)
    row = dict(generate_steps_per_s=statistics.median(rates), generate_calls=rates,
               apply_steps_per_s=float(found.group(1)) if found else None, apply_rc=done.returncode,
               apply_tail=(done.stdout + done.stderr)[-600:], device=torch.cuda.get_device_name())
    row["apply_over_generate"] = row["apply_steps_per_s"] / row["generate_steps_per_s"] if found else None
    print(json.dumps(row, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "front-door-cpu.json").write_text(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
