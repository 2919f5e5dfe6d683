"""A layer's hand-over to the host, as a decode step's captured graph runs it (runtime/measure/host.py `handover`:
the tokens and their routing copied to pinned memory, native.cpp's turn with no expert to compute, the outputs
copied back), through native.cpp's listener and through a host node, alternating, a few rounds of each: the
median replay of each round, in microseconds. Prints and writes one JSON object.

    python docs/host-experts/handover_probe.py --rounds 3 --out handover.json

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
from runtime.measure.host import handover  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    lib = native.library()
    if lib is None:
        sys.exit(f"error: {native.why_not}")
    got = {"device": torch.cuda.get_device_name(), "listener_us": [], "host_node_us": []}
    for _ in range(args.rounds):
        got["listener_us"].append(round(handover(lib, True), 1))
        got["host_node_us"].append(round(handover(lib, False), 1))
    print(json.dumps(got))
    if args.out:
        args.out.write_text(json.dumps(got, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
