"""Slot images (planner/layers/slots.py, planner.layers.groups.units): fused expert parameters in the runtime's
memory order."""
from __future__ import annotations

from planner.inputs.checkpoint import TensorInfo
from planner.layers.graph import build_graph
from planner.layers.expert_names import units
from planner.layers.slots import layout_bytes, layout_of
from planner.plan import Buffer, Layout


def info(name, shape, dtype="BF16"):
    n = 2 * shape[0] * shape[1]
    return TensorInfo(name, dtype, shape, n, "x.safetensors", 0)


def test_gate_and_up_of_each_expert_sit_together_as_transformers_fuses_them():
    """gate_up_proj[e] = [gate_e; up_e] (transformers 5.x, vLLM's w13): gate_0, up_0, gate_1, up_1; down alone."""
    names = [f"model.layers.0.mlp.experts.{e}.{p}.weight" for e in (0, 1) for p in ("down_proj", "gate_proj", "up_proj")]
    names.append("model.layers.0.mlp.gate.weight")
    tensors = {n: info(n, (32, 64) if "gate" in n.split(".")[-2] or "up" in n else (64, 32)) for n in names}
    layer = build_graph(names, ["model.layers"]).layers[0]
    got = layout_of(layer, layer.params, tensors)
    e = "mlp.experts"
    assert got == Layout(7 * 4096, (
        Buffer(f"{e}.0.down_proj.weight", "BF16", (64, 32), 0, 4096),
        Buffer(f"{e}.1.down_proj.weight", "BF16", (64, 32), 4096, 4096),
        Buffer(f"{e}.0.gate_proj.weight", "BF16", (32, 64), 8192, 4096),
        Buffer(f"{e}.0.up_proj.weight", "BF16", (32, 64), 12288, 4096),
        Buffer(f"{e}.1.gate_proj.weight", "BF16", (32, 64), 16384, 4096),
        Buffer(f"{e}.1.up_proj.weight", "BF16", (32, 64), 20480, 4096),
        Buffer("mlp.gate.weight", "BF16", (32, 64), 24576, 4096)))
    assert got.bytes == layout_bytes(layer.params, tensors)


def test_mixtral_w1_w3_fuse_and_w2_stands_alone_and_suffixes_fuse_with_their_kind():
    names = [f"b.experts.{e}.{p}.{s}" for e in (1, 0) for p in ("w1", "w2", "w3") for s in ("weight", "weight_scale")]
    got = units(names)
    assert got == [
        ("b.experts.0.w1.weight", "b.experts.0.w3.weight", "b.experts.1.w1.weight", "b.experts.1.w3.weight"),
        ("b.experts.0.w1.weight_scale", "b.experts.0.w3.weight_scale", "b.experts.1.w1.weight_scale",
         "b.experts.1.w3.weight_scale"),
        ("b.experts.0.w2.weight", "b.experts.1.w2.weight"),
        ("b.experts.0.w2.weight_scale", "b.experts.1.w2.weight_scale")]


def test_experts_are_ordered_as_numbers():
    names = [f"m.experts.{e}.down_proj.weight" for e in (10, 2, 1)]
    assert units(names) == [("m.experts.1.down_proj.weight", "m.experts.2.down_proj.weight",
                             "m.experts.10.down_proj.weight")]
