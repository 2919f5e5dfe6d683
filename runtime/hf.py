"""transformers glue: build a model on the meta device from the checkpoint's config, load it per a plan."""
from __future__ import annotations

from pathlib import Path

import torch

from planner.errors import OffplanError

from .handle import OffloadHandle
from .load_steps import load, open_plan
from .loader import check_holds_weights

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def build_meta_model(checkpoint_dir: str | Path, dtype: torch.dtype | None = None):
    """An AutoModelForCausalLM from `config.json`, every parameter on the meta device (no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config_path = Path(checkpoint_dir) / "config.json"
    if not config_path.is_file():
        raise OffplanError(f"{config_path}: no config.json beside the checkpoint; transformers needs it "
                           "to build the model (runtime.load works with any model you build yourself)")
    try:
        config = AutoConfig.from_pretrained(checkpoint_dir)
    except (OSError, ValueError, KeyError) as e:
        raise OffplanError(f"{config_path}: transformers cannot build a config from it: {e}") from None
    if dtype is None:
        dtype = _DTYPES.get(str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)).
                            removeprefix("torch."), torch.bfloat16)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except (ValueError, KeyError) as e:
        raise OffplanError(f"{config_path}: transformers has no causal LM for this config: {e}") from None
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
