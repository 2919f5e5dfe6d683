"""The experts' working memory (planner/decide/working.py): sized from the headers per phase, written in the plan's
summary, shown beside the footprint, and noted where it breaks the budget."""
from __future__ import annotations

import pytest

from offplan.cli import main
from planner.decide.working import LOOKAHEAD, Working, working
from planner.inputs.shard_header import TensorInfo
from planner.plan import Placement
from planner.planfile import load_plan
from synthetic import qwen3_moe, write_header_only

GPU, UVA, PREFETCH, CPU = Placement.GPU, Placement.UVA, Placement.PREFETCH, Placement.CPU
EXPERT = 3 * 768 * 2048 * 2  # one Qwen3-30B-A3B expert's bf16 weights: gate, up, down


def _group(experts: int, fp8: bool = False) -> dict[str, TensorInfo]:
    """One experts module's per-expert tensors: 64 x 32 projections, FP8 with 1 x 1 block scales if `fp8`."""
    out = {}
    for e in range(experts):
        for p, shape in (("gate_proj", (64, 32)), ("up_proj", (64, 32)), ("down_proj", (32, 64))):
            name = f"model.layers.0.mlp.experts.{e}.{p}.weight"
            out[name] = TensorInfo(name, "F8_E4M3" if fp8 else "BF16", shape, 2048 * (1 if fp8 else 2), "s", 0)
            if fp8:
                out[name + "_scale_inv"] = TensorInfo(name + "_scale_inv", "F32", (1, 1), 4, "s", 0)
    return out


def _working(tensors, place, top_k=2, batch=1, prompt=512, staged=None):
    group = "model.layers.0.mlp.experts"
    return working({group: tuple(tensors)}, {group: 4}, tensors, dict.fromkeys(tensors, place),
                   top_k, batch, prompt, staged or {})


def test_a_bf16_module_stages_k_experts_at_batch_1_and_every_touched_one_above():
    t = _group(4)
    expert = 3 * 4096
    assert _working(t, UVA) == Working(2 * expert, 4 * expert, 0)  # one module: no lookahead
    assert _working(t, UVA, batch=2) == Working(4 * expert, 4 * expert, 0)  # min(E, 2 x 2)
    assert _working(t, UVA, prompt=1, staged={"model.layers.0.mlp.experts": 1000}) == Working(
        2 * expert, 4 * expert + 1000, 0)  # a staged layer: every expert, and the ring
    assert _working(t, GPU) == Working()  # transformers' own implementation: nothing staged
    assert _working(t, PREFETCH) == Working()


def test_fp8_experts_add_their_dequantized_copy_except_at_batch_1():
    t = _group(4, fp8=True)
    stored, dequantized = 3 * (2048 + 4), 3 * 2048 * 2
    assert _working(t, UVA) == Working(2 * stored, 4 * (stored + dequantized), 0)  # batch 1: multiplied in place
    assert _working(t, UVA, batch=2) == Working(4 * (stored + dequantized), 4 * (stored + dequantized), 0)
    assert _working(t, GPU, batch=2).decode_bytes == 4 * (stored + dequantized)  # quantized: staged even on the GPU
    assert _working(t, GPU).decode_bytes == 0  # batch 1, every expert in HBM: multiplied in place


def test_the_lookahead_is_the_runtimes():
    pytest.importorskip("torch")
    from runtime.execute import lookahead
    assert LOOKAHEAD == lookahead.LOOKAHEAD


@pytest.mark.parametrize("batch, decode", [(1, 8 * EXPERT), (8, 64 * EXPERT)])
def test_qwen3_30b_a3b_experts_on_uva_show_their_working_memory_and_break_a_tight_budget(tmp_path, capsys, batch,
                                                                                          decode):
    write_header_only(tmp_path / "ckpt", qwen3_moe(layers=2))
    (tmp_path / "p.policy.yaml").write_text(
        "format_version: 1\ncheckpoint: ./ckpt\nbudget_gib: 1.5\nrules:\n  - match: [experts]\n    place: uva\n"
        f"workload: {{batch_size: {batch}, experts_per_token: 8}}\n")
    assert main(["build", str(tmp_path / "p.policy.yaml"), "-o", str(tmp_path / "p.plan.yaml")]) == 0
    s = load_plan(tmp_path / "p.plan.yaml")
    ring = s.prefill.ring_bytes if s.prefill else 0
    assert (s.summary.working_decode_bytes, s.summary.working_prefill_bytes, s.summary.working_buffer_bytes) == (
        decode, 128 * EXPERT + ring, LOOKAHEAD * EXPERT)
    assert s.summary.gpu_footprint_bytes <= 1.5 * 2**30 < s.summary.gpu_footprint_bytes + s.summary.working_peak_bytes
    assert any(n.startswith("warning: over budget as the model runs") for n in s.notes)
    capsys.readouterr()
    assert main(["show", str(tmp_path / "p.plan.yaml")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert (f"experts' working memory, not in the footprint yet: a decode step at batch {batch}" in out
            and "against the budget: OVER BUDGET" in out)
