"""Buffers no checkpoint holds, computed at load (runtime/place/buffers.py), and the model's module for a plan's path
(runtime/place/modules.py): on tiny meta models, without a checkpoint."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from planner.errors import ModelMismatchError  # noqa: E402
from runtime.place.buffers import materialize_buffers  # noqa: E402
from runtime.place.modules import module_paths  # noqa: E402
from runtime.place.names import Piece, Target  # noqa: E402
from tiny_models import gemma2_config, llava_config  # noqa: E402


def meta_model(config):
    from tiny_models import auto_class
    with torch.device("meta"):
        return auto_class(config).from_config(config, dtype=torch.bfloat16)


def test_each_buffer_is_computed_by_its_own_sub_models_init_and_parameters_stay_meta():
    model = meta_model(llava_config())
    materialize_buffers(model, torch.device("cpu"))
    tower = model.model.vision_tower  # a CLIPVisionModel inside LLaVA: CLIP's init knows its embeddings
    assert torch.equal(tower.embeddings.position_ids, torch.arange(17)[None])
    rotary = model.model.language_model.rotary_emb
    assert rotary.inv_freq.device.type == "cpu" and rotary.inv_freq.dtype == torch.float32
    assert torch.equal(rotary.inv_freq, 1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    assert all(p.is_meta for p in model.parameters())  # the loaded weights replace them next


def test_a_module_with_weights_gets_its_buffer_and_keeps_meta_weights():
    model = meta_model(gemma2_config())
    materialize_buffers(model, torch.device("cpu"))
    embed = model.model.embed_tokens
    assert embed.embed_scale.item() == 8.0 and embed.weight.is_meta  # sqrt(hidden_size 64)


def test_what_cannot_be_computed_is_one_error_naming_each_buffer():
    class Plain(torch.nn.Module):  # no PreTrainedModel above it: nothing knows how to compute `table`
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.empty(4, device="meta"), persistent=False)
            self.register_buffer("kept", torch.empty(4, device="meta"))  # persistent: a checkpoint tensor

    with pytest.raises(ModelMismatchError) as err:
        materialize_buffers(torch.nn.Sequential(Plain(), Plain()), torch.device("cpu"))
    assert err.value.problems == [
        f"{i}.table (Plain): no transformers PreTrainedModel above this module computes it" for i in range(2)]
    assert "build the model with them materialized" in str(err.value)

    model = meta_model(gemma2_config())
    model.model.embed_tokens.weight = torch.nn.Parameter(torch.zeros(256, 64, dtype=torch.bfloat16))  # by hand
    with pytest.raises(ModelMismatchError) as err:
        materialize_buffers(model, torch.device("cpu"))
    assert err.value.problems == [
        "model.embed_tokens.embed_scale (Gemma2TextScaledWordEmbedding): the module's parameter "
        "model.embed_tokens.weight is materialized, and its initializer would overwrite it"]
    assert torch.count_nonzero(model.model.embed_tokens.weight) == 0  # untouched


def test_plan_module_paths_map_as_their_tensors_do():
    model = meta_model(llava_config())

    def target(*aliases, source):
        return Target(aliases[0], aliases, (1,), torch.bfloat16, [Piece(source)])
    targets = [
        target("model.language_model.layers.1.mlp.up_proj.weight",
               source="language_model.model.layers.1.mlp.up_proj.weight"),
        target("model.language_model.embed_tokens.weight", "lm_head.weight",  # tied: the longest common tail
               source="language_model.model.embed_tokens.weight"),
        target("model.vision_tower.encoder.layers.0.mlp.fc1.weight",
               source="vision_tower.encoder.layers.0.mlp.fc1.weight"),
    ]
    paths = ["language_model.model.layers.1", "language_model.model.embed_tokens", "vision_tower.encoder.layers.0",
             "model.language_model.norm", "visual.blocks.0"]
    found, problems = module_paths(model, targets, paths)
    assert found == {"language_model.model.layers.1": "model.language_model.layers.1",
                     "language_model.model.embed_tokens": "model.language_model.embed_tokens",
                     "vision_tower.encoder.layers.0": "model.vision_tower.encoder.layers.0",
                     "model.language_model.norm": "model.language_model.norm"}  # no tensor given: the path itself
    assert problems == ["visual.blocks.0: the plan hooks this module, which the model does not have, and none of "
                        "its tensors maps to a module of the model"]
