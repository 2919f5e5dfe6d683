"""torch.compile of offloaded models on the CPU: no graph breaks from offplan, outputs equal to eager."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch._inductor.config as inductor_config  # noqa: E402

from runtime.hf import from_pretrained  # noqa: E402
from tiny_models import make_plan, save_models  # noqa: E402

POLICIES = {
    "prefetch": "prefetch: {group_size: 2, num_in_group: 1, step: 2}",
    "uva": "uva: {offload_gib: 0.0002}",
    # eager costs: launch-bound, mixed puts the experts on uva (graph replay's streams whole layers instead)
    "mixed": "backend: mixed\nbudget_gib: 0.0003\nprefetch: {step: 2}\nworkload: {cuda_graphs: false}",
}
CASES = [("llama", "prefetch"), ("llama", "uva"), ("moe", "prefetch"), ("moe", "mixed")]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return save_models(tmp_path_factory.mktemp("models"), "llama", "moe")


def ids():
    torch.manual_seed(1)
    return torch.randint(0, 256, (2, 9))


def traced_whole(model, x: torch.Tensor) -> torch.Tensor:
    """`model`'s eager logits over `x`, once Dynamo has traced it with no graph break and aot_eager (the traced
    graph run as it is) has given the same logits bitwise."""
    eager = model(x).logits
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    torch._dynamo.reset()
    assert torch.equal(torch.compile(model, backend="aot_eager")(x).logits, eager)
    torch._dynamo.reset()
    return eager


@pytest.mark.parametrize("kind, policy", CASES)
def test_no_graph_breaks_and_outputs_equal_eager(tmp_path, checkpoints, kind, policy):
    plan = make_plan(tmp_path, checkpoints[kind], POLICIES[policy])
    model, handle = from_pretrained(plan, progress=False)
    try:
        x = ids()
        with torch.no_grad():
            eager = traced_whole(model, x)
            # Inductor fuses differently from eager; with its precision emulation on, a compiled
            # model rounds like eager does, so any difference left would be offplan's. Except for
            # batched_mm's arithmetic (one GEMV per pair), which offplan's experts implementation runs for
            # experts in pinned memory: Inductor lowers it with another rounding, for transformers' own
            # batched_mm too (all on the CPU, nothing offloaded: 0.0039 max difference, one bf16 step).
            offplan_experts = model.config._experts_implementation == "offplan"
            with inductor_config.patch(emulate_precision_casts=True):
                compiled = torch.compile(model)
                for _ in range(2):  # the second pass runs the copies the first pass's last layers started
                    if offplan_experts:
                        torch.testing.assert_close(compiled(x).logits, eager, rtol=0, atol=8e-3)
                    else:
                        assert torch.equal(compiled(x).logits, eager)
            assert offplan_experts == (kind == "moe" and policy == "mixed")
        s = handle.stats()
        assert s.uva_bytes + s.prefetch_bytes > 0
        assert (s.prefetch_copies > 0) == (s.prefetch_bytes > 0)
    finally:
        torch._dynamo.reset()
        handle.remove(restore=False)


def test_prefetch_ops_are_single_graph_nodes(tmp_path, checkpoints):
    plan = make_plan(tmp_path, checkpoints["llama"], POLICIES["prefetch"])
    model, handle = from_pretrained(plan, progress=False)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    with torch.no_grad():
        torch.compile(model, backend=backend)(ids())
    targets = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    # one wait per prefetched layer, one start per layer that frees a slot
    assert targets.count("offplan.prefetch_wait.default") == 2
    assert targets.count("offplan.prefetch_start.default") == 2
    torch._dynamo.reset()
    handle.remove(restore=False)


def test_experts_on_cpu_compile_without_graph_breaks_and_the_host_computes_them(tmp_path, checkpoints):
    """The hand-over to the host (host/engine.py) is two custom ops: Dynamo traces through them, aot_eager runs
    them as they are (bitwise eager), and Inductor's model calls the host at every experts module (its own
    kernels round otherwise, within test_host_experts.py's tolerance)."""
    from test_host_experts import SPLIT, TOLERANCE, hardware
    plan = make_plan(tmp_path, checkpoints["moe"], SPLIT + hardware(tmp_path))
    model, handle = from_pretrained(plan, progress=False)
    engine = handle.host_experts
    layers = model.config.num_hidden_layers
    try:
        x = ids()[:, :1]  # a decode step's tokens: the host takes them (the plan's threshold is 8)
        with torch.no_grad():
            eager = traced_whole(model, x)
            compiled = torch.compile(model)
            compiled(x)
            calls = engine.host_calls
            torch.testing.assert_close(compiled(x).logits, eager, **TOLERANCE)
            assert engine.host_calls == calls + layers
    finally:
        torch._dynamo.reset()
        handle.remove(restore=False)
