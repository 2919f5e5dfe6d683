"""Lockstep: offplan (experts on cpu, or on uva as the control) against transformers on CUDA, fed the same tokens.

    python docs/host-experts/lockstep.py [--runs N] [--out FILE]

The failing GPU test's setup (3-layer tiny Qwen3-MoE, init std 0.2, two prompts of 6 tokens, 12 new tokens).
For each plan: transformers' greedy tokens R; offplan's `handle.generate` tokens, N times (same or not: a race
shows as runs that differ); then both models stepped with static caches over the prompts and R, and per step
the largest logit difference, the reference's top-2 margin per sequence and whether the argmaxes agree. A
divergence where the reference's margin is below the logit difference is a near tie, not a wrong model.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import tempfile

sys.path[:0] = ["tests", "tests/execute", "."]
import torch  # noqa: E402
from transformers import StaticCache  # noqa: E402

from planner.inputs.hardware import H100, dumps_hardware  # noqa: E402
from runtime.execute.generation import CACHE_QUANTUM  # noqa: E402
from runtime.hf import from_pretrained  # noqa: E402
from test_generation import transformers_greedy  # noqa: E402
from tiny_models import make_plan, qwen3_moe_config, reference, save_model  # noqa: E402

PLANS = {
    "cpu": "rules:\n  - {match: ['re:experts\\.[01]\\.'], place: cpu}\n  - {match: ['re:experts\\.2\\.'], place: uva}\n",
    "uva": "rules:\n  - {match: ['re:experts\\.[012]\\.'], place: uva}\n",
}
PROMPTS = [[5, 17, 99, 3, 41, 7], [8, 8, 200, 31, 2, 6]]


def lockstep(model, handle, ref, tokens: list[list[int]], device: str, graph: bool) -> list[dict]:
    """Per step: ours against the reference's logits, the same tokens fed. `graph`: our decode steps replayed
    from one CUDA graph captured through the handle (as the runtime's generation does), the prefill eager."""
    caches = [StaticCache(config=m.config, max_cache_len=CACHE_QUANTUM) for m in (model, ref)]
    ids = torch.tensor(PROMPTS, device=device)
    pos = torch.arange(ids.shape[1], device=device)
    steps, replay = [], None
    with torch.no_grad():
        for t in range(len(tokens[0])):
            if replay is not None:
                static_ids.copy_(ids)
                static_pos.copy_(pos)
                replay.replay()
                a = out[:, -1].float()
            else:
                a = model(ids, past_key_values=caches[0], cache_position=pos).logits[:, -1].float()
            b = ref(ids, past_key_values=caches[1], cache_position=pos).logits[:, -1].float()
            top = b.topk(2, dim=-1).values
            steps.append({"step": t, "max_diff": (a - b).abs().max().item(),
                          "ref_margin": (top[:, 0] - top[:, 1]).tolist(),
                          "argmax_equal": (a.argmax(-1) == b.argmax(-1)).tolist()})
            ids = torch.tensor([[seq[t]] for seq in tokens], device=device)
            pos = pos[-1:] + 1
            if graph and replay is None:
                handle.join()
                static_ids, static_pos = ids.clone(), pos.clone()  # the capture's warm-ups write this step's KV
                replay, out = handle.capture(lambda: model(static_ids, past_key_values=caches[0],
                                                           cache_position=static_pos).logits)
    return steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=pathlib.Path)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tmp = pathlib.Path(tempfile.mkdtemp())
    ckpt = save_model(qwen3_moe_config(num_hidden_layers=3, initializer_range=0.2), tmp / "m")
    (tmp / "hw.yaml").write_text(dumps_hardware(dataclasses.replace(H100, cpu_threads=args.threads,
                                                                    stage_above_tokens=8)))
    report = {}
    for name, body in PLANS.items():
        model, handle = from_pretrained(make_plan(tmp, ckpt, body + "hardware: hw.yaml\n", name), progress=False,
                                        device=device)
        try:
            ref = reference(ckpt, device)
            ref.set_experts_implementation(model.config._experts_implementation)
            want = transformers_greedy(ckpt, PROMPTS, 12, model, device=device)
            gens = [handle.generate(PROMPTS, 12, eager=eager) for eager in (True, False) for _ in range(args.runs)]
            runs = [g.tokens for g in gens]
            report[name] = {"want": want, "runs": runs, "equal": [r == want for r in runs],
                            "modes": [g.mode for g in gens], "lockstep": lockstep(model, handle, ref, want, device,
                                                                                    False)}
            if device == "cuda":
                try:
                    report[name]["lockstep_graph"] = lockstep(model, handle, ref, want, device, True)
                except RuntimeError as e:
                    report[name]["lockstep_graph"] = f"refused: {e}"
        finally:
            handle.remove()
        print(json.dumps({name: report[name]}), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
