"""FP8 weights need their block scales (planner/inputs/quantized.py `unreadable`): what `plan build` refuses,
before the runtime fails on it at load, and the block size it reads from config.json (config.py)."""
from __future__ import annotations

import json

from headeronly import infos
from planner.inputs.config import read_config
from planner.inputs.quantized import block_scales, unreadable

W = "model.layers.0.mlp.down_proj.weight"


def fp8(scales: tuple[int, ...], shape: tuple[int, ...] = (300, 256)) -> dict:
    return infos([(W, "F8_E4M3", shape), (W + "_scale_inv", "F32", scales)])


def test_block_scales_count_the_blocks_of_each_matrix_the_last_cut_short():
    assert block_scales((300, 256), (128, 128)) == (3, 2)
    assert block_scales((8, 300, 256), (128, 64)) == (8, 3, 4)  # a stack of experts' matrices
    assert block_scales((256,), (128, 128)) is None


def test_block_scaled_fp8_passes_and_other_scales_are_refused_naming_the_tensor_and_the_fix():
    assert unreadable(fp8((3, 2)), (128, 128)) == []
    assert unreadable(fp8((5, 4)), (64, 64)) == []
    (problem,) = unreadable(fp8(()), (128, 128))
    assert problem == (f"{W}: F8_E4M3 [300, 256] with scales {W}_scale_inv [], which are not its 128 x 128 block "
                       "scales (those would be [3, 2]; the block is config.json's quantization_config."
                       "weight_block_size, default 128 x 128): only block-scaled FP8 is supported: use the model's "
                       "block-scaled FP8 release, or its bf16 one")
    assert "which are not its 64 x 64 block scales (those would be [5, 4]" in unreadable(fp8((3, 2)), (64, 64))[0]
    assert "a block-scaled FP8 weight is a matrix" in unreadable(fp8((1,), shape=(256,)), (128, 128))[0]


def test_without_a_block_only_missing_scales_are_refused_as_the_runtime_checks():
    assert unreadable(fp8(())) == []  # the runtime's scan: shapes are checked against its model at load
    (problem,) = unreadable(infos([(W, "F8_E4M3", (256, 256))]))
    assert problem.startswith(f"{W}: F8_E4M3 without {W}_scale_inv: only block-scaled FP8 is supported")


def test_the_block_comes_from_config_json_as_the_runtime_reads_it(tmp_path):
    def block(quantization) -> tuple[int, int]:
        (tmp_path / "config.json").write_text(json.dumps({"quantization_config": quantization}))
        return read_config(tmp_path).fp8_block

    assert read_config(tmp_path / "nowhere").fp8_block == (128, 128)
    assert block({"quant_method": "fp8", "weight_block_size": [64, 32]}) == (64, 32)
    assert block({"weight_block_size": [128.0, 128]}) == (128, 128)
    assert block({"quant_method": "fp8"}) == block({"weight_block_size": None}) == (128, 128)
    assert block({"weight_block_size": "128"}) == block({"weight_block_size": [0, 64]}) == (128, 128)
