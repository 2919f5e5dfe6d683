"""A long forward's experts staged a chunk at a time (runtime/execute/grouped.py) on CUDA (marked `gpu`): outputs
bitwise those of the whole forward, through the Triton gathers and the one-launch FP8 gather-and-dequantize, with
experts split between HBM and pinned memory, all pinned, and all FP8 in HBM; decode steps replayed from a CUDA
graph (never chunked) give the tokens of eager ones (chunked); and where a chunk's rows per expert fall on the other
side of 128 from the whole forward's, torch's grouped GEMM (which picks its kernel by the rows per group and the
output width, sm90) still gives each expert's products bitwise."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from planner.decide import working  # noqa: E402
from runtime.execute import experts, grouped  # noqa: E402
from runtime.hf import from_pretrained  # noqa: E402
from test_experts_chunks import CONFIG, PLANS, TOKENS, checkpoints, counted  # noqa: E402,F401
from tiny_models import make_plan  # noqa: E402

pytestmark = pytest.mark.gpu


def logits(model, seed: int = 7):
    torch.manual_seed(seed)
    with torch.no_grad():
        return model(torch.randint(0, 256, (2, TOKENS)).cuda()).logits


@pytest.mark.parametrize("kind, plan", [("bf16", "split"), ("bf16", "uva"), ("fp8", "split"), ("fp8", "uva"),
                                        ("fp8", "gpu")])
def test_chunked_forwards_equal_the_whole_one_bitwise_on_cuda(tmp_path, checkpoints, kind, plan, monkeypatch):
    model, handle = from_pretrained(make_plan(tmp_path, checkpoints[kind], PLANS[plan]), progress=False,
                                    device="cuda")
    try:
        whole = logits(model)
        module = model.get_submodule("model.layers.0.mlp.experts")
        monkeypatch.setattr(working, "CHUNK_BYTES", 3 * grouped.expert_bytes(module, experts.fused_params(module)))
        seen = counted(monkeypatch)
        assert torch.equal(logits(model), whole)
        assert seen == [3] * CONFIG["num_hidden_layers"], seen
        # 12 sequences (24 pairs a step: grouped_mm's arithmetic): the replayed steps stage their slots at once (a
        # capture cannot read the chunks' row ranges), the eager ones a chunk at a time; the same tokens
        ids = torch.randint(0, 256, (12, 4))
        replayed, eager = handle.generate(ids, 4), handle.generate(ids, 4, eager=True)
        assert replayed.mode == "graph" and replayed.tokens == eager.tokens
    finally:
        handle.remove(restore=False)


def test_a_chunk_of_cold_experts_computes_as_the_whole_forward_on_cuda():
    """8 experts of 256 -> 512 -> 256 (widths above 128), 2 hot with 600 rows each and 6 cold with 10: the whole
    forward has 157 rows a group, a chunk of 2 cold ones 10 (another kernel, where torch picks by rows a group)."""
    torch.manual_seed(0)
    e, h, i = 8, 256, 512
    module = SimpleNamespace(has_gate=False, has_bias=False, is_transposed=False, act_fn=torch.nn.functional.silu)
    up = torch.randn(e, i, h, dtype=torch.bfloat16, device="cuda") / 16
    down = torch.randn(e, h, i, dtype=torch.bfloat16, device="cuda") / 16
    pos = torch.cat([torch.full((n,), s) for s, n in enumerate([600, 600] + [10] * 6)]).cuda()
    pos = pos[torch.randperm(pos.numel(), device="cuda")]
    x = torch.randn(pos.numel(), h, dtype=torch.bfloat16, device="cuda")
    weights = torch.ones(pos.numel(), dtype=torch.float32, device="cuda")
    order, valid = torch.arange(e, device="cuda"), torch.ones(e, dtype=torch.int32, device="cuda")
    rows = {"up_proj": up, "down_proj": down}
    whole = grouped.grouped_pairs(module, x, rows, pos, e, weights, 1)
    for chunk in (1, 2, 3):
        stage = lambda o, v: {p: t.index_select(0, o) for p, t in rows.items()}  # noqa: E731
        got = grouped.chunked_pairs(module, x, stage, order, valid, pos, e, chunk, weights, 1)
        assert torch.equal(got, whole), chunk
