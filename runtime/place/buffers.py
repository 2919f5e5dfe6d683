"""Buffers no checkpoint holds (rotary tables, embedding scales, position ids), computed on the device.

Why: transformers registers such buffers as non-persistent, so they are in no
checkpoint and no state_dict; on a model built on the meta device they have a
shape and no value. transformers computes them, as every other initial value,
in a `PreTrainedModel`'s `_init_weights(module)`, the override point each model
class documents for its own modules; `from_pretrained` gives each buffer an
empty tensor on its device and runs that over the model. We do the same, module
by module:

1. each module's initializer is the `_init_weights` of its nearest
   `PreTrainedModel` (itself or an ancestor): a composite model's sub-models
   know their own modules (LLaVA's CLIP tower computes its `position_ids`, which
   the top-level LLaVA model's init does not know), as transformers' own
   `initialize_weights` dispatches;
2. a module with a non-persistent buffer on the meta device gets an empty
   tensor on the device for each such buffer, then its initializer runs on it;
3. every other buffer not on the device is moved there.

This runs before the loaded tensors are assigned (load_steps.py step 6), while
the module's parameters are still on the meta device: what the initializer
writes into them (Gemma's scaled embedding is an `nn.Embedding`: its init draws
the weight, then sets `embed_scale`) is computed on meta and lost, so it can
neither overwrite a loaded weight nor leave a tensor on the wrong device, and
costs nothing. The assignment that follows replaces every parameter.

Limits: a module that holds materialized parameters and a meta buffer (a model
half built by hand) is refused: its initializer would overwrite its weights. A
meta buffer with no `PreTrainedModel` above it is refused too; the error names
both. Persistent buffers are checkpoint tensors: they are loaded like parameters.
Like transformers, it trusts the initializer to compute what it owns.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from planner.errors import ModelMismatchError


def materialize_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Compute every non-persistent meta buffer of `model` on `device`, move the others there (module doc)."""
    persistent = set(model.state_dict(keep_vars=True))
    problems = []
    for path, module, init in _with_initializer(model):
        meta = [name for name, buf in module.named_buffers(recurse=False)
                if buf is not None and buf.is_meta and _join(path, name) not in persistent]
        if meta:
            where = f"{', '.join(_join(path, n) for n in meta)} ({type(module).__name__})"
            if init is None:
                problems.append(f"{where}: no transformers PreTrainedModel above this module computes it")
                continue
            loaded = [n for n, p in module.named_parameters(recurse=False) if not p.is_meta]
            if loaded:
                problems.append(f"{where}: the module's parameter {_join(path, loaded[0])} is materialized, and "
                                "its initializer would overwrite it")
                continue
            for name in meta:
                buf = getattr(module, name)
                module.register_buffer(name, torch.empty_like(buf, device=device), persistent=False)
            init(module)
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf is not None and not buf.is_meta and buf.device != device:
                keep = _join(path, name) in persistent
                module.register_buffer(name, buf.to(device), persistent=keep)
    if problems:
        raise ModelMismatchError(
            "buffers on the meta device that no checkpoint holds, and that offplan cannot compute; build the "
            "model with them materialized (for example on the CPU, then runtime.apply)", problems)


def _with_initializer(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, object]]:
    """(path, module, the `_init_weights` of its nearest PreTrainedModel or None) for every module once."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        PreTrainedModel = None
    seen: set[int] = set()
    todo: list[tuple[str, torch.nn.Module, object]] = [("", model, None)]
    while todo:
        path, module, init = todo.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        if PreTrainedModel is not None and isinstance(module, PreTrainedModel):
            init = module._init_weights  # the documented override point of each model class
        yield path, module, init
        todo.extend((_join(path, name), child, init) for name, child in reversed(list(module.named_children())))


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name
