"""Block-scaled FP8 experts on cpu on CUDA (marked `gpu`): the host's native kernel computes them beside the GPU,
in eager forwards and in replayed CUDA graphs; the logits are those of the checkpoint dequantized within
test_fp8_experts.py's tolerance (on CUDA the GPU's sums and the host's run in other orders, as for bf16:
tests/execute/test_host_experts_gpu.py), and replayed and eager generation agree token for token."""
from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytestmark = pytest.mark.gpu

from planner.inputs.hardware import H100, dumps_hardware  # noqa: E402
from runtime.execute import experts  # noqa: E402
from runtime.hf import from_pretrained  # noqa: E402
from test_fp8_experts import SPLIT, TOLERANCE, fp8  # noqa: E402, F401
from tiny_models import make_plan, reference  # noqa: E402


def load(tmp_path, checkpoint):
    """The plan of SPLIT, one host thread, on the GPU."""
    (tmp_path / "hw.yaml").write_text(dumps_hardware(dataclasses.replace(H100, cpu_threads=1, stage_above_tokens=8)))
    return from_pretrained(make_plan(tmp_path, checkpoint, SPLIT + "hardware: hw.yaml\n"), progress=False)


def cuda_logits(model, tokens: int, batch: int):
    torch.manual_seed(3)
    with torch.no_grad():
        return model(torch.randint(0, 256, (batch, tokens)).cuda()).logits


@pytest.mark.parametrize("batch, tokens", [(1, 1), (2, 4)])
def test_eager_forwards_take_the_hosts_fp8_outputs(tmp_path, fp8, batch, tokens):
    quantized, ref_dir = fp8
    model, handle = load(tmp_path, quantized)
    try:
        engine = handle.host_experts
        assert all(m.native for m in engine.modules)
        ref = reference(ref_dir, "cuda")
        ref.set_experts_implementation(experts.arithmetic(batch * tokens * model.config.num_experts_per_tok))
        calls = engine.host_calls
        ours = cuda_logits(model, tokens, batch)
        torch.cuda.synchronize()  # the host's jobs are host functions on the GPU's stream
        assert engine.host_calls == calls + 3
        torch.testing.assert_close(ours, cuda_logits(ref, tokens, batch), **TOLERANCE)
    finally:
        handle.remove()


def test_replayed_generation_of_fp8_experts_on_cpu_is_the_eager_ones(tmp_path, fp8):
    model, handle = load(tmp_path, fp8[0])
    try:
        engine = handle.host_experts
        prompts = [[5, 17, 99, 3, 41, 7], [8, 8, 200, 31, 2, 6]]
        calls = engine.host_calls
        got = handle.generate(prompts, 12)
        assert got.mode == "graph" and engine.host_calls - calls >= 3 * 11  # every replayed step's 3 layers
        eager = handle.generate(prompts, 12, eager=True)
        assert eager.mode == "eager" and eager.tokens == got.tokens
    finally:
        handle.remove()
