"""Quantized pairs found once per kind of layer (planner/layers/scales.py) are what quantized.py's `pairs` finds
tensor by tensor: the same partners and the same problems, in its order, for every checkpoint it falls back on."""
from __future__ import annotations

import pytest

from headeronly import infos
from planner.inputs.quantized import pairs
from planner.layers.alike import Shapes
from planner.layers.graph import build_graph
from planner.layers.scales import layer_pairs
from synthetic import deepseek_v3, gpt_oss

SMALL = dict(layers=5, dense_layers=2, hidden=256, intermediate=384, experts=6, moe_intermediate=128, heads=2,
             q_lora=128, kv_lora=128, nope=16, rope=8, v_head=16, vocab=64)
W = "model.layers.3.mlp.experts.1.up_proj.weight"


def both(tensors: list, block=(128, 128)) -> tuple:
    t = infos(tensors)
    graph = build_graph(list(t))
    return layer_pairs(graph.layers, t, block, Shapes(t)), pairs(t, block)


def edited(tensors: list, name: str, to) -> list:
    """`tensors` with `name`'s entry replaced by `to` (a list of entries: none removes it)."""
    return [e for n, d, s in tensors for e in ([(n, d, s)] if n != name else to)]


CASES = {
    "deepseek-v3": lambda: deepseek_v3(**SMALL),
    "gpt-oss (MXFP4 blocks and scales)": lambda: gpt_oss(layers=3, hidden=64, intermediate=64, experts=4, heads=2,
                                                          kv_heads=1, head_dim=16, vocab=64),
    "a layer stored in bf16": lambda: edited(edited(deepseek_v3(**SMALL), W, [(W, "BF16", (128, 256))]),
                                             W + "_scale_inv", []),
    "a missing scale": lambda: edited(deepseek_v3(**SMALL), W + "_scale_inv", []),
    "a scale of another shape": lambda: edited(deepseek_v3(**SMALL), W + "_scale_inv",
                                               [(W + "_scale_inv", "F32", (3,))]),
    "scales that are a quantized weight too": lambda: edited(deepseek_v3(**SMALL), W + "_scale_inv", [
        (W + "_scale_inv", "F8_E4M3", (1, 2)), (W + "_scale_inv_scale_inv", "F32", (1, 1))]),
    # a weight and its scales in two layers (a name without a dot is its own module)
    "a name without a dot": lambda: [("w", "F8_E4M3", (128, 128)), ("w_scale_inv", "F32", (1, 1)),
                                     ("v", "F8_E4M3", (128, 128)), ("v_scale_inv", "F32", (1, 1))],
}


@pytest.mark.parametrize("case", CASES)
def test_the_pairs_by_kind_of_layer_are_the_checkpoints_pairs_and_problems(case):
    (found, problems), (want, want_problems) = both(CASES[case]())
    assert found == want and problems == want_problems
    assert want or problems  # each case pairs something, or says what it cannot

