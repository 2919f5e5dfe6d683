"""Every model family offplan is tested on, under every backend, equals transformers exactly (CPU).

Each family is a tiny random model saved by `save_pretrained` in 40 KB shards,
planned like `plan build` does, loaded with `runtime.hf.from_pretrained`, and
compared with transformers' own `from_pretrained` of the same directory: the
logits of a forward and the tokens of greedy generation, bit for bit. The VLMs
run a text prompt, then a prompt with an image (pixel values built here, no
processor), then the text prompt again: the vision tower runs in some forwards
only, which the plan's prefetch rotation must survive.

The table is the extension point: `FAMILIES` builds each config; `INPUTS` says
which prompts a family runs (text only by default); `SAVE` and `REFERENCE`
override how a row's checkpoint is written and what it is compared with (a
quantized row saves its own format and compares with its own reference).
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from planner.errors import OffplanError  # noqa: E402
from planner.inputs.checkpoint import open_checkpoint  # noqa: E402
from planner.plan import Placement  # noqa: E402
from planner.planfile import load_plan  # noqa: E402
from runtime.hf import build_meta_model, from_pretrained  # noqa: E402
from tiny_models import (deepseek_v3_config, gemma2_config, gemma3_text_config, glm4_moe_config,  # noqa: E402
                         gpt_oss_config, llama4_text_config, llama_config, llava_config, make_plan, mixtral_config,
                         qwen2_vl_config, qwen3_moe_config, qwen3_next_config, reference_family, save_family)

FAMILIES = {
    "llama": llama_config,
    "qwen3-moe": qwen3_moe_config,
    "mixtral": mixtral_config,
    "deepseek-v3": deepseek_v3_config,
    "glm4-moe": glm4_moe_config,
    "qwen3-next": qwen3_next_config,
    "gpt-oss": gpt_oss_config,
    "llama4-text": llama4_text_config,
    "gemma2": gemma2_config,
    "gemma3": gemma3_text_config,
    "qwen2-vl": qwen2_vl_config,
    "llava": llava_config,
}
SAVE = {}  # name -> save(config, directory): another checkpoint format (default: bf16 save_pretrained)
REFERENCE = {}  # name -> load(directory): what the row is compared with (default: transformers' from_pretrained)

BACKENDS = {  # policy body, given the checkpoint's bytes; the placement the plan must use
    "uva": (lambda total: "backend: uva\nuva: {offload_gib: 100}", Placement.UVA),
    "prefetch": (lambda total: "prefetch: {group_size: 2, num_in_group: 1, step: 1}", Placement.PREFETCH),
    "mixed": (lambda total: f"backend: mixed\nbudget_gib: {total * 0.6 / 2**30!r}", None),  # 60% of the weights
}
NEW_TOKENS = 4


def text_prompt(config) -> dict:
    """Two sequences of 9 ordinary tokens (below the VLMs' special ids)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 200, (2, 9), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def qwen2_vl_image(config) -> dict:
    """One 16x16-pixel image of 4x4 patches over 2 frames: a 1x4x4 patch grid, merged 2x2 into 4 image tokens
    between the vision start and end tokens, then 5 text tokens."""
    v = config.vision_config
    g = torch.Generator().manual_seed(2)
    grid = torch.tensor([[1, 4, 4]])
    patches = int(grid.prod())
    pixels = torch.randn(patches, 3 * v.temporal_patch_size * v.patch_size ** 2, generator=g)
    ids = ([config.vision_start_token_id] + [config.image_token_id] * (patches // v.spatial_merge_size ** 2)
           + [config.vision_end_token_id] + torch.randint(0, 200, (5,), generator=g).tolist())
    ids = torch.tensor([ids])
    kinds = (ids == config.image_token_id).int()  # the processor's mm_token_type_ids: 1 for image tokens, for M-RoPE
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels,
            "image_grid_thw": grid, "mm_token_type_ids": kinds}


def llava_image(config) -> dict:
    """One image of the CLIP tower's size: one image token per patch (the class token is dropped)."""
    v = config.vision_config
    g = torch.Generator().manual_seed(2)
    pixels = torch.randn(1, 3, v.image_size, v.image_size, generator=g).to(torch.bfloat16)
    text = torch.randint(0, 200, (5,), generator=g).tolist()
    ids = torch.tensor([[config.image_token_index] * (v.image_size // v.patch_size) ** 2 + text])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels}


PROMPTS = {"text": text_prompt, "qwen2-vl image": qwen2_vl_image, "llava image": llava_image}
INPUTS = {  # name -> the prompts it runs, in order (default: text)
    "qwen2-vl": ("text", "qwen2-vl image", "text"),
    "llava": ("text", "llava image", "text"),
}


@dataclass
class Outputs:
    logits: torch.Tensor
    tokens: torch.Tensor


def run(model, prompt: dict) -> Outputs:
    with torch.no_grad():
        logits = model(**prompt).logits
        tokens = model.generate(**prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    return Outputs(logits, tokens)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: a second thread only adds synchronization (on 2 busy CPUs, 20 s became 70)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """name -> (checkpoint directory, its bytes, expected outputs per prompt), each built once per module."""
    root = tmp_path_factory.mktemp("families")
    built: dict[str, tuple] = {}

    def get(name: str):
        if name not in built:
            directory = root / name
            SAVE.get(name, save_family)(FAMILIES[name](), directory)
            reference = REFERENCE.get(name, reference_family)(directory)
            expected = {p: run(reference, PROMPTS[p](reference.config)) for p in set(INPUTS.get(name, ("text",)))}
            total = sum(t.nbytes for t in open_checkpoint(directory).tensors.values())
            built[name] = (directory, total, expected)
        return built[name]
    return get


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_matches_transformers(tmp_path, family, name, backend):
    directory, total, expected = family(name)
    body, placement = BACKENDS[backend]
    path = make_plan(tmp_path, directory, body(total))
    plan = load_plan(path)
    used = set(plan.params.values())
    assert (placement in used) if placement else (used != {Placement.GPU}), f"{name} {backend}: offloads nothing"
    if plan.prefetch is not None:  # a vision tower does not run with a text prompt: never in the slot rotation
        assert not any(r.runs.value != "step" for r in plan.layers if r.prefetch), plan.prefetch.schedule
    model, handle = from_pretrained(path, progress=False, device="cpu")  # a CPU test, on any machine
    try:
        for prompt in INPUTS.get(name, ("text",)):
            got, want = run(model, PROMPTS[prompt](model.config)), expected[prompt]
            assert torch.equal(got.logits, want.logits), f"{name} {backend} {prompt}: logits differ"
            assert torch.equal(got.tokens, want.tokens), f"{name} {backend} {prompt}: greedy tokens differ"
    finally:
        handle.remove()


def test_vlm_stacks_are_the_vision_tower_and_the_text_stack(family):
    """Qwen2-VL's merger MLP (a Sequential: items 0 and 2) is a module, not a stack of 2 layers; the vision
    stacks run only with images."""
    for name, stacks in {"qwen2-vl": ("visual.blocks", "model.layers"),
                         "llava": ("vision_tower.encoder.layers", "language_model.model.layers")}.items():
        directory, total, _ = family(name)
        plan = load_plan(make_plan(directory.parent, directory, "", name=f"{name}-stacks"))
        assert plan.stacks == stacks
        runs = {r.name: r.runs.value for r in plan.layers}
        vision = {n for n in runs if n.startswith(("visual.", "vision_tower.", "multi_modal_projector."))}
        assert vision and {n for n, r in runs.items() if r == "images"} == vision
        if name == "qwen2-vl":
            assert {"visual.merger.mlp.0", "visual.merger.mlp.2"} <= vision  # two modules, each a row of its own


def test_build_meta_model_builds_the_class_config_json_names(family, tmp_path):
    directory, _, _ = family("qwen2-vl")
    model = build_meta_model(directory)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration" and next(model.parameters()).is_meta
    from transformers import ViTConfig
    ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
              ).save_pretrained(tmp_path)  # an image classifier: neither Auto class builds it
    with pytest.raises(OffplanError, match=r"config.json: transformers has no image-text-to-text or causal LM model "
                                           r"for model_type 'vit' \(ViTConfig\); build the model yourself"):
        build_meta_model(tmp_path)
