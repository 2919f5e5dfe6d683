r"""How well a layer's input predicts the next MoE layer's experts (pre-gating), on moe.py's model.

    python benchmarks/moe_predict.py --layers 8             # uniform (random) routing, on the H100
    python benchmarks/moe_predict.py --layers 8 --skew 0.7  # moe.py's skewed routing
    python benchmarks/moe_predict.py --model tiny --device cpu --out /tmp/p   # smoke test

A decode step cannot read layer L+1's experts over the link before layer L+1's
router has run, so at batch 1 the link idles while attention and the rest of
a step run (benchmarks/RESULTS.md, "Where a batch-1 step's time goes"). Reading
predicted experts during that time would fill it. The cheapest predictor is
layer L+1's router applied to layer L's experts input (the published
"pre-gated MoE" idea): this script measures, over greedy decode steps of
moe.py's prompts, how often its top S experts are among the k the router then
picks, per S, with all weights on the GPU (transformers alone: nothing of
offplan's runs). With `--skew`, both the prediction and the routing see
moe.py's RouterSkew bias. Random weights are not a trained model; the figure
says what this benchmark's model would gain, not what a real one would.

Records go to OUT/moe-predict-MODEL[-skewS].jsonl.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

import moe
from harness.checkpoints import config_for, make_checkpoint
from harness.loops import prompts
from harness.routers import RouterSkew


def parse_args(argv=None) -> argparse.Namespace:
    ap = moe.model_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                                     formatter_class=argparse.RawDescriptionHelpFormatter))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--skew", type=float)
    ap.add_argument("--prompts", type=int, default=8, help="moe.py's prompts decoded, one at a time")
    ap.add_argument("--new-tokens", type=int, default=32)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM
    work = args.dir / f"moe-{args.model}"
    ckpt = make_checkpoint(args.model, args.layers, work / "ckpt", args.device)
    from planner.inputs.checkpoint import open_checkpoint
    info = open_checkpoint(ckpt)
    config = config_for(args.model, args.layers)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).to(args.device).eval()
    model.set_experts_implementation("batched_mm")
    layers = config.num_hidden_layers
    skew = None if args.skew is None else RouterSkew(ckpt, info, layers, args.skew, args.device)
    if skew is not None:
        skew.install(model)
    k = config.num_experts_per_tok
    inputs: dict[int, torch.Tensor] = {}  # layer -> its experts' input at this decode step (before any skew)
    picked: dict[int, torch.Tensor] = {}  # layer -> the router's top-k at this decode step

    def grab(i):
        def hook(module, a):
            if a[0].shape[1] == 1:  # one token: a decode step
                inputs[i] = a[0].reshape(-1, a[0].shape[-1])
        return hook

    def route(i):
        def hook(module, a, out):
            if a[0].shape[0] == 1:
                picked[i] = out[2] if isinstance(out, tuple) and len(out) == 3 else out[1]
        return hook
    hooks = []
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.mlp.register_forward_pre_hook(grab(i)))
        hooks.append(layer.mlp.gate.register_forward_hook(route(i)))
    S = tuple(sorted({1, 2, 4, k}))
    hits = {s: 0 for s in S}
    steps = 0
    out_path = args.out / f"moe-predict-{args.model}{'' if args.skew is None else f'-skew{args.skew:g}'}.jsonl"
    args.out.mkdir(parents=True, exist_ok=True)
    ids = prompts(config.vocab_size, args.device)[:args.prompts]
    with torch.no_grad():
        for p in range(ids.shape[0]):
            x = ids[p:p + 1]
            cache = None
            token = x
            for _ in range(args.new_tokens):
                inputs.clear()
                picked.clear()
                out = model(token, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                token = out.logits[:, -1:].argmax(-1)
                if len(picked) < layers:
                    continue  # the prompt's forward
                steps += 1
                for i in range(layers - 1):
                    gate = model.model.layers[i + 1].mlp.gate
                    h = inputs[i] + (skew.vectors[i + 1] if skew is not None else 0)
                    guess = torch.nn.functional.linear(h, gate.weight).topk(max(S), dim=-1).indices[0]
                    actual = set(picked[i + 1].reshape(-1).tolist())
                    for s in S:
                        hits[s] += len(actual & set(guess[:s].tolist()))
    for h in hooks:
        h.remove()
    pairs = steps * (layers - 1)
    rows = [{"kind": "prediction", "model": args.model, "layers": layers, "skew": args.skew, "top_k": k,
             "predicted": s, "decode_steps": steps, "precision": hits[s] / (pairs * s)} for s in S]
    out_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for r in rows:
        print(f"top {r['predicted']} predicted from the previous layer's experts input: {r['precision']:.1%} of them "
              f"among the {k} the router picks ({steps} decode steps x {layers - 1} layer pairs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
