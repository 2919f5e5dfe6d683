"""What `plan show` and `plan diff` say of a plan's `parallel:` section (tensor parallelism, layers/shards.py).

A tensor-parallel plan's figures are one GPU's share, so `show` says so
before any of them: how many GPUs, how many kinds of tensor each holds a
share of, whose outputs the GPUs sum or gather, and the collectives a decode
step waits for. `--tensors` marks each split tensor with the dimension each
GPU holds 1/N of (`split_of`). `diff` reports a change of GPU count, of the
split (templates added, removed or split along another dimension), of the
modules summed or gathered, of the collectives per step and of the per-GPU
budgets (`changes`, empty when nothing changed, and `lines`).
"""
from __future__ import annotations

from collections.abc import Mapping

from ..layers.shards import template
from ..plan import Parallel
from ..units import human, ms, plural
from .diff_buffers import change, some

ONE = Parallel(1, (), (), ())  # a plan without `parallel:`: one GPU, nothing split


def data(par: Parallel | None) -> dict | None:
    """The section as plain data (`plan show --json`); None for one GPU."""
    return None if par is None else {
        "layout": par.layout, "gpus": par.gpus, "budgets": None if par.budgets is None else list(par.budgets),
        "split": par.dims, "reduce": list(par.reduce), "gather": list(par.gather),
        "collectives_per_step": par.collectives_per_step, "collectives_us": par.collectives_us}


def headline(par: Parallel) -> str:
    """`tensor parallel over 2 GPUs: each GPU holds 1/2 of 8 kinds of tensor (split), sums ...`."""
    does = [f"each GPU holds 1/{par.gpus} of {plural(len(par.split), 'kind')} of tensor (split)"]
    if par.reduce:
        does.append(f"sums the outputs of {plural(len(par.reduce), 'kind')} of module")
    if par.gather:
        does.append(f"gathers {' and '.join(par.gather)}'s")
    listed = ", ".join(does[:-1]) + " and " + does[-1] if len(does) > 1 else does[0]
    return (f"tensor parallel over {par.gpus} GPUs: {listed}; {plural(par.collectives_per_step, 'collective')} per "
            f"decode step, predicted {ms(par.collectives_us)} (in the GPU time); every figure below is one GPU's "
            "share")


def split_of(members: tuple[str, ...], unit: str, dims: Mapping[str, int]) -> int | dict[str, int] | None:
    """The dim each GPU holds a share of, for a unit of `show --tensors`: a tensor's (None: whole), or for a
    fused expert group its split parameters' (`{"gate_proj.weight": 0, "down_proj.weight": 1}`; None: none)."""
    if len(members) == 1 and members[0] == unit:
        return dims.get(template(members[0]))
    prefix = len(template(unit.partition(" [")[0])) + 1
    out = {}
    for m in members:
        tpl = template(m)
        if tpl in dims:
            out.setdefault(tpl[prefix:].removeprefix("*."), dims[tpl])
    return out or None


def split_text(split: int | dict[str, int] | None) -> str:
    """`dim 0`, `-` (whole), or `dim 0 (gate_proj, up_proj), dim 1 (down_proj)` for a fused group."""
    if split is None:
        return "-"
    if isinstance(split, int):
        return f"dim {split}"
    by: dict[int, list[str]] = {}
    for param, dim in split.items():
        by.setdefault(dim, []).append(param.removesuffix(".weight"))
    return ", ".join(f"dim {d} ({', '.join(ps)})" for d, ps in sorted(by.items()))


def changes(old: Parallel | None, new: Parallel | None) -> dict:
    """What changed in the section (empty when nothing did); a plan without one counts as one GPU."""
    if old == new:
        return {}
    o, n = old or ONE, new or ONE
    out: dict = {k: {"old": getattr(o, k), "new": getattr(n, k)}
                 for k in ("gpus", "layout") if getattr(o, k) != getattr(n, k)}
    was, now = o.dims, n.dims
    out["split"] = {k: v for k, v in {
        "added": {t: d for t, d in now.items() if t not in was},
        "removed": {t: d for t, d in was.items() if t not in now},
        "changed": {t: {"old": was[t], "new": d} for t, d in now.items() if t in was and was[t] != d}}.items() if v}
    for key in ("reduce", "gather"):
        before, after = getattr(o, key), getattr(n, key)
        out[key] = {k: v for k, v in (("added", [m for m in after if m not in before]),
                                      ("removed", [m for m in before if m not in after])) if v}
    if (o.collectives_per_step, o.collectives_us) != (n.collectives_per_step, n.collectives_us):
        out["collectives"] = {"old": {"per_step": o.collectives_per_step, "us": o.collectives_us},
                              "new": {"per_step": n.collectives_per_step, "us": n.collectives_us}}
    if o.budgets != n.budgets:
        out["budgets"] = {"old": o.budgets and list(o.budgets), "new": n.budgets and list(n.budgets)}
    return {k: v for k, v in out.items() if v}


def lines(p: dict) -> list[str]:
    """`plan diff`'s lines for `changes`."""
    out = []
    if "gpus" in p:
        old, new = p["gpus"]["old"], p["gpus"]["new"]
        whose = "the new plan's" if old == 1 else "the old plan's" if new == 1 else "each plan's"
        out.append(f"GPUs: {change(old, new)} (tensor parallel: {whose} figures are one GPU's share)")
    if "layout" in p:
        out.append(f"parallel layout: {change(p['layout']['old'], p['layout']['new'])}")
    s = p.get("split", {})
    parts = [f"{how} {plural(len(s[key]), 'kind')} of tensor ({some(list(s[key]))})"
             for key, how in (("added", "now splits"), ("removed", "no longer splits")) if key in s]
    if "changed" in s:
        parts.append("splits another dim of " + some([f"{t} ({change(c['old'], c['new'])})"
                                                      for t, c in s["changed"].items()]))
    out += [f"split: {'; '.join(parts)}"] if parts else []
    for key, verb in (("reduce", "sums the outputs of"), ("gather", "gathers the outputs of")):
        d = p.get(key, {})
        both = [f"{how} {verb} {some(d[k])}" for k, how in (("added", "now"), ("removed", "no longer")) if k in d]
        out += [f"{key}: {'; '.join(both)}"] if both else []
    if "collectives" in p:
        c = p["collectives"]
        count = (change(c["old"]["per_step"], c["new"]["per_step"]) if c["old"]["per_step"] != c["new"]["per_step"]
                 else f"{c['new']['per_step']} (unchanged)")
        out.append(f"collectives per step: {count}, predicted {change(c['old']['us'], c['new']['us'], ms)}")
    if "budgets" in p:
        each = lambda bs: "none" if bs is None else ", ".join(map(human, bs))  # noqa: E731
        out.append(f"per-GPU budgets: {change(p['budgets']['old'], p['budgets']['new'], each)}")
    return out
