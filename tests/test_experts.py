"""offplan's experts implementation (runtime/experts.py) on the CPU: experts split per expert between the GPU and
pinned memory, outputs bitwise those of transformers' batched_mm (decode) and grouped_mm (large batches)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from runtime import experts  # noqa: E402
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
    plan = make_plan(tmp_path, models["qwen3-moe"], "rules:\n  - {match: [experts], place: uva}\n")
    model, handle = from_pretrained(plan, progress=False)
    ref = reference(models["qwen3-moe"])
    ref.set_experts_implementation("batched_mm")
    assert torch.equal(logits(model, 1, seed=5)[:1], logits(ref, 1, seed=5)[:1])  # 2 tokens x top-2: batched
    handle.remove(restore=False)


def test_nothing_in_pinned_memory_keeps_the_models_implementation(tmp_path, models):
    plan = make_plan(tmp_path, models["qwen3-moe"], "prefetch: {group_size: 3, num_in_group: 1, step: 1}")
    model, handle = from_pretrained(plan, progress=False)
    assert model.config._experts_implementation != "offplan"
    handle.remove(restore=False)


def test_gather_rows_takes_resident_rows_from_hbm_and_the_rest_in_place():
    full = torch.arange(5 * 3, dtype=torch.float32).view(5, 3)  # the whole parameter, as pinned memory holds it
    resident = torch.full((2, 3), -1.0)  # experts 1 and 3 resident, marked so their source shows
    resident[1] = -3.0
    slot = torch.tensor([-1, 0, -1, 1, -1], dtype=torch.int32)
    order = torch.tensor([3, 0, 1, 4])
    valid = torch.tensor([1, 1, 1, 0], dtype=torch.int32)
    rows = experts.gather_rows(full, resident, slot, order, valid)
    assert torch.equal(rows[:3], torch.stack([resident[1], full[0], resident[0]]))  # padding (rows[3]): anything
