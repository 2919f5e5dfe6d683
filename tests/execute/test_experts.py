"""offplan's experts implementation (runtime/execute/experts.py) on the CPU: experts split per expert between the
GPU and pinned memory, outputs bitwise those of transformers' batched_mm (decode) and grouped_mm (large batches)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import runtime  # noqa: E402
from runtime.execute import experts, gather  # noqa: E402
from runtime.hf import from_pretrained  # noqa: E402
from tiny_models import make_plan, qwen3_moe_config, reference, save_model  # noqa: E402

SPLIT = "rules:\n  - {match: ['re:experts\\.[02]\\.'], place: uva}\n"  # experts 0 and 2 of every layer in pinned memory


def configs():
    from transformers import MixtralConfig, Qwen2MoeConfig
    small = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=128, tie_word_embeddings=False)
    return {
        "qwen3-moe": qwen3_moe_config(num_hidden_layers=3),
        "mixtral": MixtralConfig(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, **small),
        "qwen2-moe": Qwen2MoeConfig(intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                    num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                                    **small),
    }


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {name: save_model(config, root / name) for name, config in configs().items()}


def logits(model, tokens: int, seed: int = 3):
    torch.manual_seed(seed)
    with torch.no_grad():
        return model(torch.randint(0, 256, (2, tokens))).logits


@pytest.mark.parametrize("name", ["qwen3-moe", "mixtral", "qwen2-moe"])
def test_split_experts_equal_transformers_bitwise(tmp_path, models, name):
    """Decode-sized forwards reproduce batched_mm, larger ones grouped_mm (experts.arithmetic)."""
    plan = make_plan(tmp_path, models[name], SPLIT)
    model, handle = from_pretrained(plan, progress=False)
    assert model.config._experts_implementation == "offplan"
    refs = {}
    for impl in ("batched_mm", "grouped_mm"):
        refs[impl] = reference(models[name])
        refs[impl].set_experts_implementation(impl)
    k = model.config.num_experts_per_tok
    used = set()
    for tokens in (1, 4, experts.BATCHED_PAIRS + 3):  # 2 sequences: 2k, 8k and more pairs
        impl = experts.arithmetic(2 * tokens * k)
        used.add(impl)
        assert torch.equal(logits(model, tokens), logits(refs[impl], tokens)), (tokens, impl)
    assert used == {"batched_mm", "grouped_mm"}
    stats = handle.stats()
    assert stats.uva_bytes > 0 and stats.gpu_bytes > stats.uva_bytes  # resident experts count as GPU
    handle.remove()
    assert model.config._experts_implementation != "offplan"  # what it was before the load
    assert not [n for n, _ in model.named_buffers() if "offplan_" in n]


RESIDENT_LAYER_0 = "rules:\n  - {match: ['re:layers\\.[12]\\.mlp\\.experts\\.[02]\\.'], place: uva}\n"


def test_a_resident_layer_computes_as_the_offloaded_ones(tmp_path, models):
    """Layer 0 keeps every expert on the GPU; it too runs the arithmetic experts.arithmetic picks."""
    model, handle = from_pretrained(make_plan(tmp_path, models["qwen3-moe"], RESIDENT_LAYER_0), progress=False)
    k = model.config.num_experts_per_tok
    for tokens in (1, experts.BATCHED_PAIRS + 3):
        ref = reference(models["qwen3-moe"])
        ref.set_experts_implementation(experts.arithmetic(2 * tokens * k))
        assert torch.equal(logits(model, tokens), logits(ref, tokens)), tokens
    handle.remove(restore=False)


def test_every_expert_in_pinned_memory(tmp_path, models):
    """Outputs as batched_mm's; and no fused parameter holds rows in HBM when the plan keeps none of its experts
    there (the plan's footprint counts none; docs/memory-peak/)."""
    plan = make_plan(tmp_path, models["qwen3-moe"], "rules:\n  - {match: [experts], place: uva}\n")
    model, handle = from_pretrained(plan, progress=False)
    rows = {n: b.shape for n, b in model.named_buffers() if "offplan_rows_" in n}
    assert rows and all(shape[0] == 0 for shape in rows.values()), rows
    ref = reference(models["qwen3-moe"])
    ref.set_experts_implementation("batched_mm")
    assert torch.equal(logits(model, 1, seed=5)[:1], logits(ref, 1, seed=5)[:1])  # 2 tokens x top-2: batched
    handle.remove(restore=False)


@pytest.mark.parametrize("name", ["qwen3-moe", "mixtral", "qwen2-moe"])
@pytest.mark.parametrize("body", ["", "prefetch: {group_size: 3, num_in_group: 1, step: 1}"])
def test_nothing_in_pinned_memory_runs_grouped_mm_without_its_masks(tmp_path, models, name, body):
    """All on the GPU, or prefetched: transformers' grouped_mm (the default) gives way to offplan's, which is its
    arithmetic less the masks for expert parallelism: bitwise its logits at prefill and decode sizes."""
    model, handle = from_pretrained(make_plan(tmp_path, models[name], body), progress=False)
    assert model.config._experts_implementation == "offplan_grouped_mm"
    ref = reference(models[name])
    assert ref.config._experts_implementation == "grouped_mm"
    for tokens in (1, 5, 40):
        assert torch.equal(logits(model, tokens), logits(ref, tokens)), tokens
    handle.remove()
    assert model.config._experts_implementation == "grouped_mm"


def test_float32_experts_keep_transformers_grouped_mm_and_compile(tmp_path):
    """torch's grouped_mm takes bf16 only under torch.compile, where transformers' grouped_mm falls back to its own
    kernel: a float32 model keeps transformers' implementation, and traces."""
    model_dir = save_model(qwen3_moe_config(num_hidden_layers=2), tmp_path / "fp32", dtype=torch.float32)
    model, handle = from_pretrained(make_plan(tmp_path, model_dir, ""), progress=False)
    assert next(model.parameters()).dtype == torch.float32
    assert model.config._experts_implementation == "grouped_mm"
    ids = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model)(ids).logits, model(ids).logits)
    torch._dynamo.reset()
    handle.remove()


def test_nothing_in_pinned_memory_keeps_another_implementation(tmp_path, models):
    """A model given another experts implementation keeps it: offplan only stands in for grouped_mm."""
    model = reference(models["qwen3-moe"])
    model.set_experts_implementation("batched_mm")
    handle = runtime.apply(model, make_plan(tmp_path, models["qwen3-moe"], ""))
    assert model.config._experts_implementation == "batched_mm"
    handle.remove()


def test_gather_rows_takes_resident_rows_from_hbm_and_the_rest_in_place():
    full = torch.arange(5 * 3, dtype=torch.float32).view(5, 3)  # the whole parameter, as pinned memory holds it
    resident = torch.full((2, 3), -1.0)  # experts 1 and 3 resident, marked so their source shows
    resident[1] = -3.0
    slot = torch.tensor([-1, 0, -1, 1, -1], dtype=torch.int32)
    order = torch.tensor([3, 0, 1, 4])
    valid = torch.tensor([1, 1, 1, 0], dtype=torch.int32)
    rows = gather.gather_rows(full, resident, slot, order, valid)
    assert torch.equal(rows[:3], torch.stack([resident[1], full[0], resident[0]]))  # padding (rows[3]): anything


EVERY_EXPERT = "rules:\n  - {match: [experts], place: uva}\n"


def _decode_logits(model, steps: int = 6, seed: int = 4) -> list[torch.Tensor]:
    """One sequence, one token a forward (where the lookahead runs): each step's logits."""
    torch.manual_seed(seed)
    ids = torch.randint(0, 256, (1, 7))
    found = []
    with torch.no_grad():
        step = model(ids)
        for _ in range(steps):
            token = step.logits[:, -1:].argmax(-1)
            step = model(token, past_key_values=step.past_key_values)
            found.append(step.logits)
    return found


@pytest.mark.parametrize("body", [EVERY_EXPERT, SPLIT])
def test_lookahead_decode_equals_transformers_and_reads_its_buffer(tmp_path, models, body, monkeypatch):
    """With experts in pinned memory in every layer, one-token forwards guess the next layer's experts and read
    them ahead (runtime/execute/lookahead.py): outputs stay bitwise batched_mm's, and the gathers do take rows from the
    buffer (spoiling it changes the outputs)."""
    model, handle = from_pretrained(make_plan(tmp_path, models["qwen3-moe"], body), progress=False)
    ref = reference(models["qwen3-moe"])
    ref.set_experts_implementation("batched_mm")
    look = handle.lookahead
    assert look is not None and [m._offplan_ahead.reads for m in look.modules] == [False, True, True]
    assert handle.stats().gpu_buffer_bytes == look.buffer_bytes > 0
    for got, want in zip(_decode_logits(model), _decode_logits(ref)):
        assert torch.equal(got, want)
    spoil_reads_ahead(monkeypatch)
    assert any(not torch.equal(got, want) for got, want in zip(_decode_logits(model), _decode_logits(ref)))
    handle.remove(restore=False)
    assert not any(hasattr(m, "_offplan_ahead") for m in model.modules())


def test_the_guess_is_the_next_routers_top_experts_with_its_bias(tmp_path, models):
    """The lookahead's guess (a product and a sum, no GEMM) picks what the next router's own linear would rank
    first, bias included, in rank order; outputs never show it, so it is checked here."""
    model, handle = from_pretrained(make_plan(tmp_path, models["qwen3-moe"], EVERY_EXPERT), progress=False)
    look = handle.lookahead
    router = look.routers[1]
    gen = torch.Generator().manual_seed(3)
    router.register_buffer("bias", torch.randn(router.weight.shape[0], generator=gen).to(router.weight.dtype))
    for seed in range(8):
        x = torch.randn(3, router.weight.shape[1], generator=torch.Generator().manual_seed(seed))
        x = x.to(router.weight.dtype)
        look.guess(0, x)
        want = torch.nn.functional.linear(x[-1:].float(), router.weight.float(), router.bias.float())
        assert look.ids[1].tolist() == want.topk(look.count, dim=-1).indices.view(-1).tolist(), seed
    handle.remove(restore=False)


def spoil_reads_ahead(monkeypatch) -> None:
    """Make every row the lookahead reads ahead wrong (one more), so that outputs show whether they are used."""
    from runtime.execute import lookahead
    read = lookahead.read_ahead

    def spoiled(look, target, full, slots):
        read(look, target, full, slots)
        for rows in look.rows.values():
            rows.add_(1)
    monkeypatch.setattr(lookahead, "read_ahead", spoiled)


def test_gather_rows_takes_guessed_experts_from_the_lookahead_buffer():
    from runtime.execute import ops
    from runtime.execute.lookahead import Source

    class Look:  # the lookahead's answer for one stored tensor (lookahead.Lookahead.source)
        def source(self, index, name, full):
            assert (index, name) == (2, "down_proj")
            return Source(torch.tensor([4, 1]), torch.full((2, 3), -5.0), torch.zeros(8, dtype=torch.int32), 0, 1)
    look = Look()
    key = ops.register(look)
    full = torch.arange(5 * 3, dtype=torch.float32).view(5, 3)
    resident = torch.full((1, 3), -1.0)
    slot = torch.tensor([-1, 0, -1, -1, -1], dtype=torch.int32)  # expert 1 resident: HBM before the buffer
    order = torch.tensor([4, 1, 0])
    rows = gather.gather_rows(full, resident, slot, order, torch.ones(3, dtype=torch.int32), key, "down_proj", 2)
    assert torch.equal(rows, torch.stack([torch.full((3,), -5.0), resident[0], full[0]]))


def test_plan_apply_refuses_to_compile_a_grouped_gemm_of_float32_experts(tmp_path, capsys):
    """Above BATCHED_PAIRS pairs offloaded experts run torch's grouped GEMM, which torch.compile takes in bf16 only:
    `plan apply --compile` says so before compiling, and names the batch that compiles (top-2: 8)."""
    from offplan.cli import main
    model_dir = save_model(qwen3_moe_config(num_hidden_layers=2), tmp_path / "fp32", dtype=torch.float32)
    plan = make_plan(tmp_path, model_dir, "rules:\n  - {match: [experts], place: uva}")
    assert main(["apply", str(plan), "--device", "cpu", "--compile", "--batch", "12", "--max-new-tokens", "2"]) == 1
    err = capsys.readouterr().err
    assert ("--compile: at batch 12 the decode step's offloaded experts run a grouped GEMM, which torch.compile takes "
            "in bf16 only, and this model is float32: leave --compile out, or run at batch 8 or less") in err
    assert "Traceback" not in err
