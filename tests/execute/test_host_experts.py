"""Experts on cpu (runtime/execute/host/) on the CPU, where the placement is the natural one: the host
computes its experts' pairs, the rest run as before, and the logits are transformers' within the rounding of one
GEMV summed in another order."""
from __future__ import annotations

import dataclasses
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from planner.errors import OffplanError  # noqa: E402
from planner.inputs.hardware import H100, dumps_hardware  # noqa: E402
from runtime.execute import experts  # noqa: E402
from runtime.execute.host import kernel as host_kernel  # noqa: E402
from runtime.execute.host import native  # noqa: E402
from runtime.hf import from_pretrained  # noqa: E402
from test_experts import spoil_reads_ahead  # noqa: E402
from tiny_models import (HOST_LOUD as LOUD, HOST_SPLIT as SPLIT, HOST_TOLERANCE as TOLERANCE,  # noqa: E402
                         gpt_oss_config, make_plan, qwen3_moe_config, reference, save_model, transformers_greedy)


def hardware(tmp_path, threads: int = 1, above: int = 8):
    (tmp_path / "hw.yaml").write_text(dumps_hardware(dataclasses.replace(H100, cpu_threads=threads,
                                                                        stage_above_tokens=above)))
    return "hardware: hw.yaml\n"


@pytest.fixture(params=["native", "worker"])
def path(request, monkeypatch):
    """Who computes the gated experts: native.cpp (the default where it is built), or the engine's Python worker
    (where it is not: Inductor's kernel)."""
    if request.param == "native":
        assert native.library() is not None, native.why_not  # `pip install -e .` builds it
    else:
        monkeypatch.setattr(native, "library", lambda: None)
    return request.param


def uses(engine, path: str) -> None:
    """The engine's modules are computed by `path` (the fixture's), and only its machinery runs."""
    if path == "native":
        assert all(m.native for m in engine.modules) and engine.native is not None and engine._worker is None
    else:
        assert all(m.gated and not m.native for m in engine.modules) and engine.native is None
        assert engine.kernel.compiled, engine.kernel.why_eager


def fail(engine, path: str, monkeypatch, calls: int = 3) -> str:
    """Make the host's calls fail after `calls` more (the worker's), or all of them (native.cpp's jobs, captured
    or eager, told their module has one expert); returns the error's name. `monkeypatch.undo()` ends it."""
    if path == "worker":
        monkeypatch.setattr(engine, "_compute", failing_after(calls, engine._compute))
        return "ZeroDivisionError"
    for job in engine.native.all():
        monkeypatch.setattr(job, "experts", 1)
    make = engine._job

    def one_expert(index, tokens):
        job = make(index, tokens)
        monkeypatch.setattr(job, "experts", 1)
        return job
    monkeypatch.setattr(engine, "_job", one_expert)
    monkeypatch.setattr(engine.native, "_eager", {})
    return "IndexError"


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return save_model(qwen3_moe_config(num_hidden_layers=3, **LOUD), tmp_path_factory.mktemp("qwen") / "m")


def lockstep(model, ref, prompts: list[list[int]], tokens: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Both models stepped over the prompts, then fed `tokens` one step at a time, each with a static cache of the
    generator's length: the last position's logits at every step, (ours, theirs) [steps, B, V] float."""
    from transformers import StaticCache

    from runtime.execute.generation import CACHE_QUANTUM
    caches = [StaticCache(config=m.config, max_cache_len=CACHE_QUANTUM) for m in (model, ref)]
    ids = torch.tensor(prompts, device=model.device)
    pos = torch.arange(ids.shape[1], device=model.device)
    ours, theirs = [], []
    with torch.no_grad():
        for t in range(len(tokens[0])):
            for m, c, got in zip((model, ref), caches, (ours, theirs)):
                got.append(m(ids, past_key_values=c, cache_position=pos).logits[:, -1].float())
            ids = torch.tensor([[seq[t]] for seq in tokens], device=model.device)
            pos = pos[-1:] + 1
    return torch.stack(ours), torch.stack(theirs)


def logits(model, tokens: int, batch: int = 2, seed: int = 3):
    torch.manual_seed(seed)
    with torch.no_grad():
        return model(torch.randint(0, 256, (batch, tokens)).to(model.device)).logits


@pytest.mark.parametrize("batch, tokens", [(1, 1), (2, 1), (2, 4)])
def test_the_host_computes_its_experts_and_the_logits_are_transformers(tmp_path, qwen, batch, tokens, monkeypatch,
                                                                       path):
    model, handle = from_pretrained(make_plan(tmp_path, qwen, SPLIT + hardware(tmp_path)), progress=False, device="cpu")
    engine = handle.host_experts
    assert [m.on_cpu.nonzero().flatten().tolist() for m in engine.modules] == [[0, 1]] * 3
    uses(engine, path)
    ref = reference(qwen)
    ref.set_experts_implementation(experts.arithmetic(batch * tokens * model.config.num_experts_per_tok))
    calls = engine.host_calls
    for op in ("host_begin", "host_end"):  # outside torch.compile the forward calls the engine itself, no op
        monkeypatch.setattr(experts.ops, op, None)
    ours, theirs = logits(model, tokens, batch), logits(ref, tokens, batch)
    assert engine.host_calls == calls + 3 and engine.kernel.misses == 0, engine.kernel.last_miss  # all compiled
    torch.testing.assert_close(ours, theirs, **TOLERANCE)
    monkeypatch.setattr(engine, "_hand_over", lambda index, tokens: engine._views["y"].zero_())  # the host's
    assert not torch.allclose(logits(model, tokens, batch), theirs, **TOLERANCE)  # reads none of those experts
    stats = handle.stats()
    assert stats.uva_bytes > 0


def test_above_the_plans_prefill_threshold_the_experts_are_read_as_uva_ones_bitwise(tmp_path, qwen):
    model, handle = from_pretrained(make_plan(tmp_path, qwen, SPLIT + hardware(tmp_path, above=8)), progress=False, device="cpu")
    assert handle.host_experts.max_tokens == 8
    ref = reference(qwen)
    ref.set_experts_implementation("grouped_mm")
    calls = handle.host_experts.host_calls
    assert torch.equal(logits(model, 12), logits(ref, 12))
    assert handle.host_experts.host_calls == calls


def test_greedy_generation_matches_transformers(tmp_path, qwen):
    model, handle = from_pretrained(make_plan(tmp_path, qwen, SPLIT + hardware(tmp_path)), progress=False, device="cpu")
    prompts = [[5, 17, 99, 3], [8, 8, 200, 31]]
    calls = handle.host_experts.host_calls
    assert handle.generate(prompts, 8).tokens == transformers_greedy(qwen, prompts, 8, model)
    done = handle.host_experts.host_calls - calls
    assert done >= 3 * 8 and done % 3 == 0  # the prefill and 7 steps at least, each of 3 layers


def test_the_lookahead_guesses_only_experts_the_link_reads_and_its_buffer_is_used(tmp_path, qwen, monkeypatch):
    """In a module with experts on cpu, one-token forwards still read the next module's guessed experts ahead
    (runtime/execute/lookahead.py), but guess only among those its gathers read over the link: here expert 2 (0 and
    1 on cpu, 3 resident). The logits stay transformers', and spoiling the buffer changes them: its rows are used."""
    model, handle = from_pretrained(make_plan(tmp_path, qwen, SPLIT + hardware(tmp_path)), progress=False, device="cpu")
    look = handle.lookahead
    assert look is not None and len(look.modules) == 3 and [m._offplan_ahead.reads for m in look.modules] == [
        False, True, True]
    assert all(torch.equal(u, torch.tensor([True, True, False, True])) for u in look.unread)
    ref = reference(qwen)
    ref.set_experts_implementation("batched_mm")
    prompts, tokens = [[5, 17, 99, 3]], [[7, 200, 31, 64, 9, 128]]
    calls = handle.host_experts.host_calls
    ours, theirs = lockstep(model, ref, prompts, tokens)
    torch.testing.assert_close(ours, theirs, **TOLERANCE)
    assert handle.host_experts.host_calls == calls + 3 * 6  # the host computed in every layer of every step
    assert look.ids[:, 0].tolist() == [2, 2]  # the first guess of each parity: the only expert the link reads
    spoil_reads_ahead(monkeypatch)
    assert not torch.allclose(lockstep(model, ref, prompts, tokens)[0], theirs, **TOLERANCE)


def failing_after(calls: int, compute):
    """The engine's `_compute`, raising after `calls` calls."""
    done = []

    def run(*args):
        done.append(1)
        return compute(*args) if len(done) <= calls else 1 / 0
    return run


def test_a_failure_on_the_host_is_raised_and_the_host_goes_on(tmp_path, qwen, monkeypatch, path):
    model, handle = from_pretrained(make_plan(tmp_path, qwen, SPLIT + hardware(tmp_path)), progress=False, device="cpu")
    prompts = [[5, 17, 99, 3]]
    want = handle.generate(prompts, 4).tokens
    error = fail(handle.host_experts, path, monkeypatch)
    with pytest.raises(RuntimeError, match=f"computing experts on the host CPU failed: {error}"):
        handle.generate(prompts, 4)
    monkeypatch.undo()
    assert handle.generate(prompts, 4).tokens == want
    handle.remove()
    assert handle.host_experts is None


def test_an_engine_dropped_without_remove_is_collected_and_its_threads_stop(tmp_path, qwen, path):
    import gc
    import weakref
    model, handle = from_pretrained(make_plan(tmp_path, qwen, SPLIT + hardware(tmp_path)), progress=False, device="cpu")
    handle.generate([[5, 17, 99, 3]], 2)
    engine = weakref.ref(handle.host_experts)
    worker = handle.host_experts._worker
    pool = handle.host_experts.native.pool._free if path == "native" else None  # the pool's finalizer: joins its threads
    assert (worker is None) == (path == "native") and (worker is None or worker.is_alive())
    del model, handle
    gc.collect()
    if worker is not None:
        worker.join(timeout=10)
        assert not worker.is_alive()
    assert engine() is None and (pool is None or not pool.alive)


def test_transposed_experts_with_biases_and_every_expert_of_a_layer_on_cpu(tmp_path_factory, tmp_path):
    """gpt-oss stores its experts fused and transposed ([E, H, 2I]) with biases, and gates interleaved."""
    ckpt = save_model(gpt_oss_config(num_hidden_layers=2, **LOUD), tmp_path_factory.mktemp("oss") / "m")
    body = "rules:\n  - {match: ['re:layers\\.1\\.mlp\\.experts\\.'], place: cpu}\n" + hardware(tmp_path)
    model, handle = from_pretrained(make_plan(tmp_path, ckpt, body), progress=False, device="cpu")
    assert [(m.on_cpu.all().item(), m.gated) for m in handle.host_experts.modules] == [(True, False)]  # eager
    ref = reference(ckpt)
    ref.set_experts_implementation("batched_mm")
    calls = handle.host_experts.host_calls
    torch.testing.assert_close(logits(model, 1), logits(ref, 1), **TOLERANCE)
    assert handle.host_experts.host_calls == calls + 1  # layer 1's experts, by the host
    handle.remove()
    assert not hasattr(model.get_submodule("model.layers.1.mlp.experts"), "_offplan_host")


def test_more_threads_than_the_process_may_use_is_refused_before_loading(tmp_path, qwen):
    cores = len(os.sched_getaffinity(0))
    plan = make_plan(tmp_path, qwen, SPLIT + hardware(tmp_path, threads=cores + 1))
    with pytest.raises(OffplanError, match=f"with {cores + 1} host threads \\(cost.cpu_threads\\), but this process "
                                           f"may run on {cores} cores: rebuild it with a hardware profile measured at "
                                           f"those \\(`plan calibrate --cpu-threads {cores}`\\)"):
        from_pretrained(plan, progress=False, device="cpu")


def test_the_compiled_kernel_rounds_as_the_eager_loop():
    torch.manual_seed(0)
    gate_up, down = torch.randn(4, 2 * 48, 80, dtype=torch.bfloat16), torch.randn(4, 80, 48, dtype=torch.bfloat16)
    x = torch.randn(3, 80, dtype=torch.bfloat16)
    tokens, ids = torch.tensor([0, 0, 1, 2, 2]), torch.tensor([3, 0, 3, 2, 1])
    kernel = host_kernel.Kernel(1)
    kernel.start([(gate_up, down, 2)])
    kernel.ready()
    assert kernel.compiled, kernel.why_eager
    got = kernel.gated(x, tokens, gate_up, down, ids)
    assert kernel.misses == 0 and got.dtype == torch.bfloat16 and got.shape == (5, 80)
    want = host_kernel.gated_eager(x, tokens, gate_up, down, ids)
    assert (got.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()  # a unit or so
    assert not host_kernel.Kernel(1, compile=False).compiled


def test_the_eager_projection_is_a_gemv_per_pair():
    torch.manual_seed(0)
    for transposed in (False, True):
        w = torch.randn(4, 96, 80, dtype=torch.bfloat16)
        x = torch.randn(5, 96 if transposed else 80, dtype=torch.bfloat16)
        ids = torch.tensor([3, 0, 3, 2, 1])
        got = host_kernel.project(x, w, ids, transposed)
        want = torch.stack([(w[e].float().t() if transposed else w[e].float()) @ x[p].float()
                            for p, e in enumerate(ids.tolist())]).to(torch.bfloat16)
        torch.testing.assert_close(got, want, rtol=0.008, atol=1e-2)  # one bf16 rounding of an fp32 sum


def test_plan_apply_says_when_the_host_kernel_is_not_built(tmp_path, qwen, monkeypatch, capsys):
    from offplan.cli import main
    plan = make_plan(tmp_path, qwen, SPLIT + hardware(tmp_path))
    apply = ["apply", str(plan), "--device", "cpu", "--max-new-tokens", "2"]
    assert main(apply) == 0
    assert "the plan computes experts on cpu" not in capsys.readouterr().out
    monkeypatch.setattr(native, "library", lambda: None)
    monkeypatch.setattr(native, "why_not", "the host kernel is not built (here: a test)")
    assert main(apply) == 0
    assert ("note: the plan computes experts on cpu, but the host kernel is not built (here: a test): the engine's "
            "Python worker computes them, much slower than the plan predicts") in capsys.readouterr().out
