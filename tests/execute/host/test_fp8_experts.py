"""Block-scaled FP8 experts on cpu (runtime/execute/host/): the host's native kernel reads the FP8 rows and their
scales where the arena holds them, converts them as it reads, and the logits are those of the checkpoint dequantized
(tests/quantized_models.py `reference_dir`) within test_host_experts.py's tolerance; MXFP4 experts on cpu, and FP8
ones without the native kernel, are refused at load, naming the tensor and the fix."""
from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from planner.errors import OffplanError, PolicyError  # noqa: E402
from planner.inputs.hardware import H100, dumps_hardware  # noqa: E402
from quantized_models import reference_dir, write_fp8, write_mxfp4  # noqa: E402
from runtime.execute import experts  # noqa: E402
from runtime.execute.host import native  # noqa: E402
from runtime.hf import from_pretrained  # noqa: E402
from tiny_models import (HOST_LOUD as LOUD, HOST_SPLIT as SPLIT, HOST_TOLERANCE as TOLERANCE,  # noqa: E402
                         gpt_oss_config, make_plan, qwen3_moe_config, reference, save_model, transformers_greedy)


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    """(the FP8 checkpoint, it dequantized in bf16): hidden 192, two 128-column blocks, the second partial. Seed 1:
    with seed 0 a step of the greedy test below has its top two logits one bf16 unit apart, which the host's sums
    (in another order than torch's) flip, for the bf16 host on the dequantized checkpoint as for the FP8 one."""
    root = tmp_path_factory.mktemp("fp8")
    config = qwen3_moe_config(num_hidden_layers=3, hidden_size=192, moe_intermediate_size=128, head_dim=32, **LOUD)
    quantized = write_fp8(save_model(config, root / "bf16", seed=1), root / "fp8")
    return quantized, reference_dir(quantized, root / "ref")


def load(tmp_path, checkpoint, body: str = SPLIT):
    """The plan of `body`, one host thread, loaded on the CPU."""
    (tmp_path / "hw.yaml").write_text(dumps_hardware(dataclasses.replace(H100, cpu_threads=1, stage_above_tokens=8)))
    return from_pretrained(make_plan(tmp_path, checkpoint, body + "hardware: hw.yaml\n"), progress=False, device="cpu")


def logits(model, tokens: int, batch: int, seed: int = 3):
    torch.manual_seed(seed)
    with torch.no_grad():
        return model(torch.randint(0, 256, (batch, tokens))).logits


@pytest.mark.parametrize("batch, tokens", [(1, 1), (2, 1), (2, 4)])
def test_the_host_computes_fp8_experts_and_the_logits_are_the_dequantized_models(tmp_path, fp8, batch, tokens,
                                                                                 monkeypatch):
    quantized, ref_dir = fp8
    assert native.library() is not None, native.why_not  # `pip install -e .` builds it
    model, handle = load(tmp_path, quantized)
    engine = handle.host_experts
    assert [m.on_cpu.nonzero().flatten().tolist() for m in engine.modules] == [[0, 1]] * 3
    for m in engine.modules:  # native.cpp reads the stored FP8 rows and their scales: no worker
        assert m.native and m.block == (128, 128) and m.dtype == torch.bfloat16
        assert (m.weights["gate_up_proj"].dtype, m.scales["gate_up_proj"].shape) == (torch.float8_e4m3fn, (4, 2, 2))
    assert engine.native is not None and engine._worker is None
    ref = reference(ref_dir)
    ref.set_experts_implementation(experts.arithmetic(batch * tokens * model.config.num_experts_per_tok))
    calls = engine.host_calls
    ours, theirs = logits(model, tokens, batch), logits(ref, tokens, batch)
    assert engine.host_calls == calls + 3  # each layer's experts on cpu, by the host
    torch.testing.assert_close(ours, theirs, **TOLERANCE)
    monkeypatch.setattr(engine, "_hand_over", lambda index, tokens: engine._views["y"].zero_())  # the host's
    assert not torch.allclose(logits(model, tokens, batch), theirs, **TOLERANCE)  # outputs are used


def test_greedy_generation_of_fp8_experts_on_cpu_matches_transformers(tmp_path, fp8):
    quantized, ref_dir = fp8
    model, handle = load(tmp_path, quantized)
    prompts = [[5, 17, 99, 3], [8, 8, 200, 31]]
    calls = handle.host_experts.host_calls
    assert handle.generate(prompts, 8).tokens == transformers_greedy(ref_dir, prompts, 8, model)
    done = handle.host_experts.host_calls - calls
    assert done >= 3 * 8 and done % 3 == 0  # the prefill and 7 steps at least, each of 3 layers
    handle.remove()
    assert not hasattr(model.get_submodule("model.layers.0.mlp.experts"), "_offplan_host")


def test_the_load_probes_the_hosts_pace_over_fp8_experts_by_their_stored_bytes(tmp_path, fp8):
    from runtime.execute.host import pace
    model, handle = load(tmp_path, fp8[0])
    engine = handle.host_experts
    calls = engine.host_calls
    got = pace.probe(engine, 75.0, 100.0, experts=2, min_bytes=0)
    expert = 3 * 128 * 192 + (2 * 2 + 2 * 1) * 4  # gate, up and down in FP8, and their 128 x 128 blocks' scales
    assert got.nbytes == 2 * expert and got.planned_us == pytest.approx(2 * expert / 75e3 + 100.0)
    assert got.measured_us > 0 and engine.host_calls == calls  # the probe's calls are not the model's
    handle.remove()


def test_fp8_experts_on_cpu_without_the_native_kernel_are_refused_naming_them(tmp_path, fp8, monkeypatch):
    monkeypatch.setattr(native, "library", lambda: None)  # as where native.cpp is not built
    monkeypatch.setattr(native, "why_not", "the host kernel is not built (here: a test)")
    with pytest.raises(OffplanError) as e:
        load(tmp_path, fp8[0])
    lines = str(e.value).splitlines()
    assert lines[0] == "the plan puts quantized experts on cpu that the host cannot compute:"
    assert lines[1:] == [f"  - model.layers.{i}.mlp.experts.{p}: FP8 experts, which only the host's native kernel "
                         "(native.cpp) computes, and the host kernel is not built (here: a test); place them on uva "
                         "(rebuild the plan), or build the host kernel (`pip install -e .`, with a C++ compiler)"
                         for i in range(3) for p in ("down_proj", "gate_up_proj")]


def test_mxfp4_experts_on_cpu_are_refused_naming_them(tmp_path_factory, tmp_path, monkeypatch):
    """`plan build` refuses them (tests/decide/test_cpu_experts.py); a plan that an older build let through is
    refused at load, before anything is allocated."""
    from planner.decide import placement_errors
    root = tmp_path_factory.mktemp("mxfp4")
    quantized = write_mxfp4(save_model(gpt_oss_config(num_hidden_layers=2), root / "bf16"), root / "mxfp4")
    rule = "rules:\n  - {match: ['re:layers\\.1\\.mlp\\.experts\\.'], place: cpu}\n"
    with pytest.raises(PolicyError, match="quantized: the host computes bf16, fp16, fp32 and block-scaled FP8"):
        load(tmp_path, quantized, rule)
    monkeypatch.setattr(placement_errors, "host_computes", lambda *args: True)  # as an older build let it through
    with pytest.raises(OffplanError) as e:
        load(tmp_path, quantized, rule)
    lines = str(e.value).splitlines()
    assert lines[0] == "the plan puts quantized experts on cpu that the host cannot compute:"
    assert lines[1:] == [f"  - model.layers.1.mlp.experts.{p}_blocks: MXFP4 experts: the host kernel computes bf16 "
                         "and block-scaled FP8 experts only; place them on uva (rebuild the plan)"
                         for p in ("down_proj", "gate_up_proj")]
