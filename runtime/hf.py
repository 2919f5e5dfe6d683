"""transformers glue: build a model on the meta device from the checkpoint's config, load it per a plan."""
from __future__ import annotations

from pathlib import Path

import torch

from planner.errors import OffplanError

from .execute.handle import OffloadHandle
from .load_steps import load, open_plan
from .place.loader import check_holds_weights

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def build_meta_model(checkpoint_dir: str | Path, dtype: torch.dtype | None = None):
    """The model `config.json` describes, every parameter on the meta device (no memory).

    Built by the Auto class that makes the class config.json names
    (`architectures`, as `save_pretrained` writes it: `Qwen2VLForConditionalGeneration`
    comes from AutoModelForImageTextToText, `LlamaForCausalLM` from
    AutoModelForCausalLM); without such a name, by the first of those two that
    knows the config (a VLM's image-text model before a text-only one). A class
    that neither builds (a classifier head) is not built: the first that knows
    the config is, and the name mapping reports what differs. One error says
    why none fits.
    """
    config_path = Path(checkpoint_dir) / "config.json"
    if not config_path.is_file():
        raise OffplanError(f"{config_path}: no config.json beside the checkpoint; transformers needs it "
                           "to build the model (runtime.load works with any model you build yourself)")
    import transformers
    try:
        config = transformers.AutoConfig.from_pretrained(checkpoint_dir)
    except (OSError, ValueError, KeyError) as e:
        raise OffplanError(f"{config_path}: transformers cannot build a config from it: {e}") from None
    if dtype is None:
        dtype = _DTYPES.get(str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)).
                            removeprefix("torch."), torch.bfloat16)
    autos = {"AutoModelForImageTextToText": transformers.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
             "AutoModelForCausalLM": transformers.MODEL_FOR_CAUSAL_LM_MAPPING}  # transformers' public mappings
    builds = {name: mapping[type(config)].__name__ for name, mapping in autos.items() if type(config) in mapping}
    if not builds:
        raise OffplanError(f"{config_path}: transformers has no image-text-to-text or causal LM model for "
                           f"model_type {config.model_type!r} ({type(config).__name__}); build the model "
                           "yourself and call runtime.load(model, plan)")
    named = list(getattr(config, "architectures", None) or ())
    auto = next((a for a, cls in builds.items() if cls in named), next(iter(builds)))
    try:
        with torch.device("meta"):
            model = getattr(transformers, auto).from_config(config, dtype=dtype)
    except (ValueError, KeyError) as e:
        raise OffplanError(f"{config_path}: transformers cannot build {builds[auto]} from it: {e}") from None
    return model.eval()


def from_pretrained(plan: str | Path, *, device: str | torch.device | None = None, uva: bool = True,
                    progress: bool | None = None, dtype: torch.dtype | None = None
                    ) -> tuple[torch.nn.Module, OffloadHandle]:
    """Build the plan's model from its checkpoint's config.json and load it per the plan.

    Returns (model, handle). Example:
        model, handle = runtime.hf.from_pretrained("plans/examples/tiny-moe.plan.yaml")
    """
    opened, ckpt = open_plan(plan, None)  # the plan is read (and checked) once
    check_holds_weights(ckpt)  # before config.json, which a header-only checkpoint lacks
    model = build_meta_model(ckpt.root, dtype)
    handle = load(model, opened, checkpoint=ckpt, device=device, uva=uva, progress=progress)
    return model, handle
