"""A long forward's experts staged a chunk at a time (runtime/execute/grouped.py) on CUDA (marked `gpu`): outputs
bitwise those of the whole forward, through the Triton gathers and the one-launch FP8 gather-and-dequantize, with
experts split between HBM and pinned memory, all pinned, and all FP8 in HBM; and decode steps replayed from a CUDA
graph (never chunked) give the tokens of eager ones (chunked)."""
from __future__ import annotations

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
