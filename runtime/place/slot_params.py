"""Slot parameters: a module's parameter that reads a GPU slot while its layer's forward is staged.

At prefill (prefill.py) a staged layer's uva tensors are copied into a GPU
slot, and each staged parameter reads its slot view instead of the pinned
tensor: the owning module's class is swapped for a subclass whose class
property for that name returns the slot view while its layer's forward is
staged (`LayerState.staged`), the registered parameter otherwise (the forward
hook clears the flag). That is how `torch.nn.utils.parametrize` computes a
parameter on access, without its machinery (a parametrize access costs about
10 us of CPU, 9 per decoder layer per decode step: a tax on eager decode);
Dynamo inlines class properties of modules. The parameter stays registered
under its own name (`named_parameters()` and `state_dict()` unchanged; a
persistent buffer held with the weights, the same way) and `param.data` is
never touched. The stager restores each module's class at `remove()`.
"""
from __future__ import annotations

import functools


class LayerState:
    """Whether the layer's forward now running is staged: the staged properties read it, the hooks set it."""

    def __init__(self):
        self.staged = False


def _staged_property(name: str, buffer: bool) -> property:
    if buffer:  # a persistent buffer held with the weights (DeepSeek-V3's router `e_score_correction_bias`)
        def get(self):
            state, view = self._offplan_staged[name]
            return view if state.staged else self._buffers[name]
    else:
        def get(self):
            state, view = self._offplan_staged[name]
            return view if state.staged else self._parameters[name]
    return property(get)


@functools.cache
def staged_class(cls: type, names: frozenset[tuple[str, bool]]) -> type:
    """`cls` with a property per staged (parameter or buffer name, is a buffer) (module doc); one class per
    (class, names)."""
    return type(f"Staged{cls.__name__}", (cls,), {n: _staged_property(n, b) for n, b in sorted(names)})
