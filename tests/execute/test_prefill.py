"""Prefill staging (runtime/execute/prefill.py) on the CPU: a forward over many tokens reads each staged layer's uva
tensors from a slot, one over few reads them in place, and both give the plain model's outputs exactly."""
from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from planner.inputs.hardware import H100, dumps_hardware  # noqa: E402
from planner.planfile import load_plan  # noqa: E402
from runtime.hf import from_pretrained  # noqa: E402
from tiny_models import check_ring, make_plan, reference, save_models  # noqa: E402

ABOVE = 8  # tokens: the test profile's crossover; a [2, 9] prompt (18 tokens) is staged, a decode step (2) is not


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return save_models(tmp_path_factory.mktemp("models"), "llama", "moe", "tied")


def plan_with(tmp_path, checkpoint, body: str, above: int = ABOVE):
    hw = tmp_path / "hw.yaml"
    hw.write_text(dumps_hardware(dataclasses.replace(H100, stage_above_tokens=above)))
    return make_plan(tmp_path, checkpoint, f"hardware: {hw}\n{body}")


@pytest.mark.parametrize("kind", ["llama", "moe"])
def test_many_tokens_read_slots_few_read_in_place_both_exact(tmp_path, checkpoints, kind):
    plan = plan_with(tmp_path, checkpoints[kind], "backend: uva\nuva: {offload_gib: 100}")
    staging = load_plan(plan).prefill
    assert staging is not None and staging.above_tokens == ABOVE and staging.slots == 2
    assert [l.layer for l in staging.layers] == [f"model.layers.{i}" for i in range(4)]
    model, handle = from_pretrained(plan, progress=False)
    ref = reference(checkpoints[kind])
    torch.manual_seed(3)
    prompt = torch.randint(0, 256, (2, 9))
    try:
        with torch.no_grad():
            assert torch.equal(model(prompt).logits, ref(prompt).logits)
            assert handle.stats().prefill_staged_layers == len(staging.layers)
            assert torch.equal(model(prompt[:, :1]).logits, ref(prompt[:, :1]).logits)
            assert handle.stats().prefill_staged_layers == len(staging.layers)  # 2 tokens: in place
            out = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert out.tolist() == ref.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0).tolist()
    finally:
        handle.remove(restore=False)


def test_staged_parameters_are_slot_views_only_while_their_layer_runs(tmp_path, checkpoints):
    plan = plan_with(tmp_path, checkpoints["llama"], "backend: uva\nuva: {offload_gib: 100}")
    model, handle = from_pretrained(plan, progress=False)
    slots = [(s.data_ptr(), s.data_ptr() + s.numel()) for s in handle.prefill.slots]
    arena = (handle.arena.host_view(0, 1).data_ptr(), handle.arena.host_view(0, 1).data_ptr() + handle.arena.nbytes)
    inside: list[tuple[int, bool, bool]] = []  # (tokens, weight in a slot, weight in the arena)
    proj = model.model.layers[1].mlp.down_proj

    def look(m, args, out):
        p = m.weight.data_ptr()
        inside.append((args[0].numel() // args[0].shape[-1], any(a <= p < b for a, b in slots),
                       arena[0] <= p < arena[1]))
    hook = proj.register_forward_hook(look)
    try:
        with torch.no_grad():
            model(torch.randint(0, 256, (2, 9)))
            model(torch.randint(0, 256, (2, 1)))
        assert inside == [(18, True, False), (2, False, True)]
        p = proj.weight.data_ptr()  # outside a forward: the pinned tensor
        assert arena[0] <= p < arena[1]
        # the parameter stays registered under its own name, the pinned tensor, while its class is swapped
        assert model.state_dict()["model.layers.1.mlp.down_proj.weight"].data_ptr() == p
        assert dict(model.named_parameters())["model.layers.1.mlp.down_proj.weight"] is proj._parameters["weight"]
        assert type(proj) is not torch.nn.Linear and isinstance(proj, torch.nn.Linear)
    finally:
        hook.remove()
        handle.remove(restore=True)
    assert type(proj) is torch.nn.Linear and not hasattr(proj, "_offplan_staged")  # its own class again
    assert torch.equal(model.model.layers[1].mlp.down_proj.weight, reference(checkpoints["llama"]).model.layers[1]
                       .mlp.down_proj.weight)


def test_slots_alternate_so_a_wrong_rotation_would_show(tmp_path, checkpoints):
    """Two slots, five staged layers: layer i uses slot i % 2, and the outputs are exact, so a copy that
    overwrote a slot still in use, or a layer reading the other slot, would change them."""
    plan = plan_with(tmp_path, checkpoints["llama"], "backend: uva\nuva: {offload_gib: 100}")
    model, handle = from_pretrained(plan, progress=False)
    ref = reference(checkpoints["llama"])
    try:
        views = [m._offplan_staged["weight"][1].data_ptr() for m in
                 (model.model.layers[i].self_attn.q_proj for i in range(4))]
        assert views[0] == views[2] and views[1] == views[3] and views[0] != views[1]
        for seed in range(3):
            torch.manual_seed(seed)
            x = torch.randint(0, 256, (1, 12 + seed))
            with torch.no_grad():
                assert torch.equal(model(x).logits, ref(x).logits)
    finally:
        handle.remove(restore=False)


def test_uva_and_prefetch_in_one_layer(tmp_path, checkpoints):
    """Attention on uva (staged), the MLP prefetched: two engines hook the same layers."""
    body = ("rules:\n  - {match: [self_attn], place: uva}\n"
            "prefetch: {group_size: 2, num_in_group: 1, step: 2, params: [mlp]}")
    plan = plan_with(tmp_path, checkpoints["llama"], body)
    model, handle = from_pretrained(plan, progress=False)
    ref = reference(checkpoints["llama"])
    try:
        assert handle.engine is not None and handle.prefill is not None
        x = torch.randint(0, 256, (2, 9))
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(model(x).logits, ref(x).logits)
        assert handle.stats().prefill_staged_layers == 2 * len(handle.plan.prefill.layers)
    finally:
        handle.remove(restore=False)


def test_stage_prefill_false_reads_in_place(tmp_path, checkpoints):
    plan = plan_with(tmp_path, checkpoints["llama"], "backend: uva\nuva: {offload_gib: 100, stage_prefill: false}")
    assert load_plan(plan).prefill is None
    model, handle = from_pretrained(plan, progress=False)
    try:
        assert handle.prefill is None
        assert not any(type(m).__name__.startswith("Staged") for m in model.modules())
    finally:
        handle.remove(restore=False)


def test_tied_embedding_on_uva_is_not_staged(tmp_path, checkpoints):
    """An embedding lookup reads rows: staging would copy the whole table. The tied head reads it all, but
    belongs to the embedding's layer, which is never staged."""
    plan = plan_with(tmp_path, checkpoints["tied"], "rules:\n  - {match: [embed_tokens, self_attn], place: uva}")
    staging = load_plan(plan).prefill
    assert [l.layer for l in staging.layers] == [f"model.layers.{i}" for i in range(3)]
    model, handle = from_pretrained(plan, progress=False)
    ref = reference(checkpoints["tied"])
    try:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
        x = torch.randint(0, 256, (2, 9))
        with torch.no_grad():
            assert torch.equal(model(x).logits, ref(x).logits)
    finally:
        handle.remove(restore=False)


def test_compiled_staging_has_no_graph_break_and_is_exact(tmp_path, checkpoints):
    """Dynamo inlines the staged parameters' class properties and the hooks: one graph, staged per shape."""
    import torch._inductor.config as inductor_config
    plan = plan_with(tmp_path, checkpoints["llama"], "backend: uva\nuva: {offload_gib: 100}")
    model, handle = from_pretrained(plan, progress=False)
    prefill, step = torch.randint(0, 256, (2, 9)), torch.randint(0, 256, (2, 1))
    try:
        with torch.no_grad():
            eager = {x.shape[1]: model(x).logits for x in (prefill, step)}
            explained = torch._dynamo.explain(model)(prefill)
            assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
            torch._dynamo.reset()
            staged = handle.stats().prefill_staged_layers
            with inductor_config.patch(emulate_precision_casts=True):
                compiled = torch.compile(model, dynamic=False)
                for x in (prefill, step, prefill):
                    assert torch.equal(compiled(x).logits, eager[x.shape[1]]), x.shape
            assert handle.stats().prefill_staged_layers - staged == 2 * len(handle.plan.prefill.layers)
    finally:
        torch._dynamo.reset()
        handle.remove(restore=False)


SPLIT_STAGED = ("uva: {stage_experts: true}\nrules:\n  - {match: [self_attn], place: uva}\n"
                "  - {match: ['re:experts\\.[02]\\.'], place: uva}\n")  # experts 1 and 3 of each layer stay on the GPU


@pytest.mark.parametrize("body", ["backend: uva\nuva: {offload_gib: 100, stage_experts: true}", SPLIT_STAGED])
def test_staged_experts_stream_through_the_ring_exactly(tmp_path, checkpoints, body):
    """With `ring_bytes` a staged layer's experts in pinned memory stream through the expert ring: the experts
    forward gathers the rows in HBM (the plan's GPU experts) and takes the others from the ring, only above the
    threshold; outputs equal the plain model's. On the CPU the gather leaves the host rows zero, so a row the
    ring did not deliver, or delivered to the wrong expert, changes the logits."""
    plan = plan_with(tmp_path, checkpoints["moe"], body)
    staging = load_plan(plan).prefill
    assert staging.experts and [l.layer for l in staging.layers] == [f"model.layers.{i}" for i in range(4)]
    model, handle = from_pretrained(plan, progress=False)
    ring = handle.prefill.ring
    assert len(ring.chunks) > ring.positions > 1  # the chunks wrap around the ring: each buffer reused
    assert ring.ring_bytes <= staging.ring_bytes
    filled = check_ring(handle)  # every row of each fill compared with the parameter
    ref = reference(checkpoints["moe"])
    torch.manual_seed(4)
    prompt = torch.randint(0, 256, (2, 9))
    try:
        with torch.no_grad():
            assert torch.equal(model(prompt).logits, ref(prompt).logits)
            assert ring.buffer is None and ring.consumed == len(ring.chunks)  # all consumed, the ring released
            assert torch.equal(model(prompt[:, :1]).logits, ref(prompt[:, :1]).logits)
            out = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert out.tolist() == ref.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0).tolist()
        # the two prefills fill every unit, in order; the 2-token forward and the decode steps read in place
        assert filled == [0, 1, 2, 3] * 2
    finally:
        handle.remove(restore=False)


def test_the_first_staged_copy_starts_with_the_forward(tmp_path, checkpoints):
    """The input embedding's hook starts the first staged layer's copy above the threshold (it then overlaps
    whatever runs before that layer), and nothing at or below it."""
    plan = plan_with(tmp_path, checkpoints["llama"], "rules:\n  - {match: ['model.layers.2'], place: uva}")
    model, handle = from_pretrained(plan, progress=False)
    ahead = []
    hook = model.get_input_embeddings().register_forward_hook(lambda *_: ahead.append(handle.prefill.ahead))
    ref = reference(checkpoints["llama"])
    prompt = torch.randint(0, 256, (2, 9))
    try:
        with torch.no_grad():
            for x in (prompt, prompt[:, :4]):
                assert torch.equal(model(x).logits, ref(x).logits)
        assert ahead == [0, None]  # the only staged layer, layer 2: started by the embedding; then nothing
        assert handle.stats().prefill_staged_layers == 1
    finally:
        hook.remove()
        handle.remove(restore=False)
