"""The natural order of tensor names within a layer (graph.py): numbers compared as numbers, so `experts.10` comes
after `experts.9`, as vLLM's per-parameter walk reads them; and the template (alike.py) of a layer's local names.

A stack's layers name their tensors alike, so the order is worked out once per list of local names, and a layer
whose names are the last layer's local names under its own name is told so without cutting them again.
"""
from __future__ import annotations

from itertools import repeat
from operator import getitem

from .alike import Template


def natural_key(name: str) -> str:
    """Sort key that orders `layers.10` after `layers.9`: numeric segments zero-padded.

    A string key (not a tuple) because comparing strings is what makes sorting
    90k names fast; segments of up to 12 digits compare numerically.
    """
    return ".".join([p.rjust(12, "0") if p.isdigit() else p for p in name.split(".")])


def natural_order(node: str, params: list[str], keys: dict[str, str], orders: dict[tuple, tuple], last: list
                  ) -> tuple[tuple[str, ...], Template]:
    """`params` of one layer in natural order of their local names (keys cached across layers), and the
    template of those local names (alike.py: one object per distinct list, shared by the layers alike).
    The order depends on the local names alone, so layers alike are sorted once (`orders`).

    `last` holds the local names last cut from a layer, their entry of `orders` and whether none holds a newline:
    then a layer whose name holds none and whose names, joined by newlines, are its name and a dot before each of
    those, joined alike, has those local names (the newlines are the joins', so the pieces match one for one). Its
    names are compared in two joins and one compare in C, not cut and hashed again (a stack's next layer: 1,548
    names on DeepSeek-V3)."""
    cut = len(node) + 1
    if last and last[2] and len(last[0]) == len(params) and "\n" not in node:
        head = node + "."
        if "\n".join(params) == head + ("\n" + head).join(last[0]):
            got = last[1]
            return tuple(map(params.__getitem__, got[0])), got[1]
    local = tuple(map(getitem, params, repeat(slice(cut, None))))  # in C: a layer of DeepSeek-V3 holds 1,548
    got = orders.get(local)
    if got is None:
        for name in set(local).difference(keys):
            keys[name] = natural_key(name)
        order = tuple(i for _, _, i in sorted(zip(map(keys.__getitem__, local), local, range(len(local)))))
        own = tuple(map(local.__getitem__, order))
        template = next((t for _, t in orders.values() if t.names == own), None) or Template(own)
        got = orders[local] = (order, template)  # layers whose names come in another order: the same template
    last[:] = local, got, "\n" not in "".join(local)
    return tuple(map(params.__getitem__, got[0])), got[1]
