"""The listener against the host node in whole decode steps: one plan (a benchmark's, with experts on cpu), loaded
once per round with each hand-over (native.py `can_listen` made false for the host node), alternating; each load
decodes `--new-tokens` steps at batch 1 through the runtime's generation (CUDA graph replay), after a warm-up
call. Prints and writes JSONL rows: steps/s per round and hand-over.

    python docs/host-experts/listener_ab.py PLAN --rounds 3 --out listener-ab.jsonl

Runs against commit 52bf1f6's runtime, whose listener is not on main (README.md here, "native.cpp's listener"):
`git worktree add /tmp/listener 52bf1f6`, then run it there.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from runtime.execute.host import native  # noqa: E402
from runtime.hf import from_pretrained  # noqa: E402


def steps_per_s(plan: Path, listen: bool, new: int) -> float:
    can_listen = native.can_listen
    native.can_listen = lambda: listen and can_listen()
    try:
        model, handle = from_pretrained(plan, progress=False)
    finally:
        native.can_listen = can_listen
    try:
        assert handle.host_experts is not None and handle.host_experts.native.listening == listen
        vocab = model.config.get_text_config().vocab_size
        ids = torch.randint(3, vocab, (1, 16), generator=torch.Generator().manual_seed(1234)).cuda()
        handle.generate(ids, new + 1)  # capture, warm-up
        return handle.generate(ids, new + 1).decode_tokens_per_s
    finally:
        handle.remove(restore=False)
        del model, handle
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rows = []
    for r in range(args.rounds):
        for listen in (r % 2 == 0, r % 2 == 1):  # which goes first alternates
            rows.append({"round": r, "handover": "listener" if listen else "host node", "plan": args.plan.name,
                         "device": torch.cuda.get_device_name(),
                         "steps_per_s": round(steps_per_s(args.plan, listen, args.new_tokens), 1)})
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
