"""`plan diff OLD NEW`: what a change of plan changes, for review.

Moves are grouped by layer and, within a layer, by unit: a fused expert group
(groups.py) is one unit per pair of placements (old, new) its tensors have,
named by its experts where that splits it. Each layer
gets one row: what moved where (with bytes when the checkpoint headers are at
hand) and the change of its bytes per placement (always exact: from the
plans' layer tables). Above the table: what changed in the predicted step
time and prefill (time to first token), the GPU footprint, the backend, the
policy (path, content, budget, hardware profile, batch, prompt tokens, eager or
graph replay, routing profile), the prefetch schedule (step, slots, slot size,
layers streamed, slot changes) and the prefill staging (threshold, slots, slot
size, layers staged), the GPUs of a tensor-parallel plan (count, split, modules
summed or gathered, collectives per step, per-GPU budgets: parallel_review.py),
and which notes came and went. Bytes moved are each plan's own: one GPU's
share of a split tensor in a tensor-parallel plan (the new plan's share for a
tensor both plans hold).

Plans at different paths compare equal when they place everything alike and
name the same files (paths are resolved, not compared as written).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

from ..layers.graph import build_graph
from ..layers.shards import template
from ..plan import Plan
from ..units import human, ms, plural, signed
from . import parallel_review
from .diff_buffers import change, schedule, schedule_lines, some, staging, staging_lines
from .show import KINDS, kinds, table, units_of


def _resolved(plan: Plan, where: Path) -> Plan:
    d = where.parent
    routing = plan.routing and dataclasses.replace(plan.routing, path=(d / plan.routing.path).resolve().as_posix())
    return dataclasses.replace(plan, checkpoint_path=(d / plan.checkpoint_path).resolve().as_posix(),
                               policy_path=(d / plan.policy_path).resolve().as_posix(), routing=routing)


def diff_data(old: Plan, new: Plan, sizes: Mapping[str, int] | None = None,
              paths: tuple[Path, Path] | None = None) -> dict:
    """Everything that differs, as plain data (`plan diff --json`). `sizes` (tensor bytes from the
    checkpoints' headers) adds bytes to each move; `paths` (the two plan files) resolve the paths
    the plans hold, so that plans in different directories compare by the files they name."""
    a, b = (_resolved(old, paths[0]), _resolved(new, paths[1])) if paths else (old, new)
    sizes = _shares(sizes, old, new)
    moved: dict[str, list[str]] = {}
    for name, place in new.params.items():
        before = old.params.get(name)
        if before is not None and before is not place:
            moved.setdefault(f"{before.value}->{place.value}", []).append(name)
    added = [n for n in new.params if n not in old.params]
    removed = [n for n in old.params if n not in new.params]
    old_layers = {l.name: l for l in old.layers}
    new_layers = {l.name: l for l in new.layers}
    layers = []
    shown = kinds(old, new)
    for name in [*new_layers, *(n for n in old_layers if n not in new_layers)]:
        x, y = old_layers.get(name), new_layers.get(name)
        delta = {k: (getattr(y, k) if y else 0) - (getattr(x, k) if x else 0) for k in shown}
        if any(delta.values()):
            layers.append({"name": name, **delta})
    so, sn = old.summary, new.summary
    summary = {k: getattr(sn, k) - getattr(so, k) for k in
               (*(f"{k}_bytes" for k in shown), "prefetch_buffer_bytes", "stage_buffer_bytes",
                "gpu_footprint_bytes")}
    return {
        "same": dataclasses.replace(a, built=None) == dataclasses.replace(b, built=None),  # the stamp: provenance
        "moved": {k: v for k, v in sorted(moved.items())},
        "moved_bytes": None if sizes is None else {
            k: sum(sizes.get(n, 0) for n in v) for k, v in sorted(moved.items())},
        "added": added, "removed": removed, "layers": layers, "summary": summary,
        "units": _units(old, new, sizes),
        "gpu_footprint_bytes": {"old": so.gpu_footprint_bytes, "new": sn.gpu_footprint_bytes},
        "predicted_step_us": {"old": so.predicted_step_us, "new": sn.predicted_step_us},
        "predicted_prefill_us": {"old": _prefill_us(old), "new": _prefill_us(new)},
        "backend": {"old": old.backend.value, "new": new.backend.value},
        "policy": {"old": old.policy_path, "new": new.policy_path,
                   "path_changed": a.policy_path != b.policy_path, "resolved": [a.policy_path, b.policy_path]},
        "checkpoint": {"old": old.checkpoint_path, "new": new.checkpoint_path,
                       "path_changed": a.checkpoint_path != b.checkpoint_path,
                       "resolved": [a.checkpoint_path, b.checkpoint_path]},
        "routing": {"old": old.routing and old.routing.path, "new": new.routing and new.routing.path,
                    "changed": a.routing != b.routing,
                    "path_changed": (a.routing and a.routing.path) != (b.routing and b.routing.path),
                    "resolved": [a.routing and a.routing.path, b.routing and b.routing.path]},
        "budget_bytes": {"old": old.budget_bytes, "new": new.budget_bytes},
        "stacks": {"old": list(old.stacks), "new": list(new.stacks)},
        "cost": {"old": _cost(old), "new": _cost(new)},
        "prefetch": schedule(old.prefetch, new.prefetch),
        "prefill": staging(old.prefill, new.prefill),
        "parallel": parallel_review.changes(old.parallel, new.parallel),
        "notes": {"removed": [n for n in old.notes if n not in new.notes],
                  "added": [n for n in new.notes if n not in old.notes]},
        "checkpoint_changed": old.checkpoint_fingerprint != new.checkpoint_fingerprint,
        "policy_changed": old.policy_fingerprint != new.policy_fingerprint,
        "backend_changed": old.backend != new.backend,
        "schedule_changed": old.prefetch != new.prefetch,
        "staging_changed": old.prefill != new.prefill,
        "parallel_changed": old.parallel != new.parallel,
    }


def _shares(sizes: Mapping[str, int] | None, old: Plan, new: Plan) -> Mapping[str, int] | None:
    """Tensor bytes as the plans count them: a split tensor's one GPU's share, the new plan's where both hold it."""
    if sizes is None or (old.parallel is None and new.parallel is None):
        return sizes
    out = dict(sizes)
    for plan in (old, new):
        dims, gpus = (plan.parallel.dims, plan.parallel.gpus) if plan.parallel else ({}, 1)
        out.update((n, sizes[n] // gpus if template(n) in dims else sizes[n]) for n in plan.params if n in sizes)
    return out


def _cost(plan: Plan) -> dict | None:
    return None if plan.cost is None else {"hardware": plan.cost.hardware, "batch_size": plan.cost.batch_size,
                                           "cuda_graphs": plan.cost.cuda_graphs,
                                           "prompt_tokens": plan.cost.prompt_tokens or None,
                                           "top_k": plan.cost.top_k or None}


def _prefill_us(plan: Plan) -> int | None:
    """The predicted prefill, or None for a plan without one (no cost, or written before prefill predictions)."""
    return plan.cost.prefill_us if plan.cost and plan.cost.prompt_tokens else None


def _units(old: Plan, new: Plan, sizes: Mapping[str, int] | None) -> list[dict]:
    """Per layer (new execution order, then layers that went away), per move, the units that moved.
    Tensors new to the checkpoint move from "-", tensors gone from it move to "-"."""
    rows = []
    seen = set()
    for plan in (new, old):
        for layer in build_graph(plan.params, plan.stacks).layers:
            if layer.name in seen:
                continue
            seen.add(layer.name)
            moves: dict[tuple[str, str], list[tuple[str, tuple[str, ...]]]] = {}
            for unit, members in units_of(layer, old.params, new.params):
                first = members[0]
                before = old.params[first].value if first in old.params else "-"
                after = new.params[first].value if first in new.params else "-"
                if before != after:
                    moves.setdefault((before, after), []).append((unit[len(layer.name) + 1:] or unit, members))
            for (before, after), units in moves.items():
                names = [m for _, ms_ in units for m in ms_]
                rows.append({"layer": layer.name, "from": before, "to": after,
                             "units": [u for u, _ in units], "sizes": [len(m) for _, m in units],
                             "tensors": len(names),
                             "bytes": None if sizes is None else sum(sizes.get(n, 0) for n in names)})
    return rows


def diff_text(d: dict) -> list:
    """The review: the headline changes, then one table row per layer that changed."""
    if d["same"]:
        return ["no changes: the plans place every tensor the same way"]
    out: list = []
    if d["backend_changed"]:
        out.append(f"backend: {change(d['backend']['old'], d['backend']['new'])}")
    pol, ckpt = d["policy"], d["checkpoint"]
    if pol["path_changed"]:
        out.append(f"policy: {change(*_named(pol))}"
                   + (" (a different file; its content differs)" if d["policy_changed"] else " (same content)"))
    elif d["policy_changed"]:
        out.append(f"policy: {pol['new']} changed since the old plan was built")
    headers = ("its headers differ (another fingerprint)"
               + (f": {plural(len(d['added']), 'tensor')} added, {plural(len(d['removed']), 'tensor')} removed"
                  if d["added"] or d["removed"] else "")) if d["checkpoint_changed"] else "the same headers"
    if ckpt["path_changed"]:
        out.append(f"checkpoint: {change(*_named(ckpt))} ({headers})")
    elif d["checkpoint_changed"]:
        out.append(f"checkpoint: {headers}")
    rt = d["routing"]
    if rt["changed"]:
        out.append(f"routing profile: {change(*_named(rt), lambda p: 'none (uniform)' if p is None else p)}"
                   if rt["path_changed"] else f"routing profile: {rt['new']} changed since the old plan was built")
    bud = d["budget_bytes"]
    if bud["old"] != bud["new"]:
        out.append(f"budget: {change(bud['old'], bud['new'], lambda b: 'none' if b is None else human(b))}")
    if d["stacks"]["old"] != d["stacks"]["new"]:
        out.append(f"stacks: {change(d['stacks']['old'], d['stacks']['new'])}")
    out += parallel_review.lines(d["parallel"])
    cost = d["cost"]
    if cost["old"] != cost["new"] and cost["old"] and cost["new"]:
        for key, what in (("hardware", "hardware profile"), ("batch_size", "batch size"),
                          ("prompt_tokens", "prompt tokens"), ("top_k", "routed experts per token")):
            if cost["old"][key] != cost["new"][key]:
                shown = change(cost["old"][key], cost["new"][key], lambda v: "none" if v is None else v)
                out.append(f"{what}: {shown}")
        if cost["old"]["cuda_graphs"] != cost["new"]["cuda_graphs"]:
            mode = lambda graphs: "CUDA graph replay" if graphs else "eager"  # noqa: E731
            out.append(f"predicted for: {change(cost['old']['cuda_graphs'], cost['new']['cuda_graphs'], mode)}")
    fp, step = d["gpu_footprint_bytes"], d["predicted_step_us"]
    dfp = fp["new"] - fp["old"]
    out.append(f"GPU footprint: {change(fp['old'], fp['new'], human)} ({signed(dfp)})" if dfp
               else f"GPU footprint: {human(fp['new'])} (unchanged)")
    dt = step["new"] - step["old"]
    pct = f", {dt / step['old']:+.1%}" if step["old"] else ""
    out.append(f"predicted step: {change(step['old'], step['new'], ms)} ({'+' if dt > 0 else '-'}{ms(abs(dt))}{pct})"
               if dt else f"predicted step: {ms(step['new'])} (unchanged)")
    out += _prefill_lines(d["predicted_prefill_us"])
    out += schedule_lines(d["prefetch"])
    out += staging_lines(d["prefill"])
    moved = [u for u in d["units"] if u["from"] != "-" and u["to"] != "-"]
    if moved:
        out.append(f"moved: {_moved(moved, plural(len({u['layer'] for u in moved}), 'layer'))}")
        ways = {}
        for u in moved:
            ways.setdefault(f"{u['from']} -> {u['to']}", []).append(u)
        if len(ways) > 1:
            out += [f"  {way}: {_moved(us)}" for way, us in ways.items()]
    if d["units"] or d["layers"]:
        out += ["", _table(d)]
    if d["notes"]["removed"] or d["notes"]["added"]:
        out += ["", "notes:"] + [f"  - {n}" for n in d["notes"]["removed"]] + [f"  + {n}" for n in d["notes"]["added"]]
    return out


def _named(entry: dict) -> tuple[str, str]:
    """A file both plans name, as each names it, or where both name it alike (relative to each plan), resolved."""
    return (entry["old"], entry["new"]) if entry["old"] != entry["new"] else tuple(entry["resolved"])


def _moved(units: list[dict], where: str = "") -> str:
    """`2 units (48 tensors) in 2 layers, 192.0 KiB`: a unit is a fused expert group, or a tensor."""
    tensors = sum(u["tensors"] for u in units)
    count = sum(len(u["units"]) for u in units)
    text = plural(tensors, "tensor") if count == tensors else f"{plural(count, 'unit')} ({plural(tensors, 'tensor')})"
    return (text + (f" in {where}" if where else "")
            + (f", {human(sum(u['bytes'] for u in units))}" if units[0]["bytes"] is not None else ""))


def _prefill_lines(pre: dict) -> list[str]:
    if pre["old"] is None or pre["new"] is None:
        return [] if pre["old"] == pre["new"] else [
            f"predicted prefill: {change(pre['old'], pre['new'], lambda t: 'none' if t is None else ms(t))}"]
    dt = pre["new"] - pre["old"]
    pct = f", {dt / pre['old']:+.1%}" if pre["old"] else ""
    return [f"predicted prefill: {change(pre['old'], pre['new'], ms)} ({'+' if dt > 0 else '-'}{ms(abs(dt))}{pct})"
            if dt else f"predicted prefill: {ms(pre['new'])} (unchanged)"]


def _table(d: dict):
    deltas = {l["name"]: l for l in d["layers"]}
    moves: dict[str, list[str]] = {}
    for u in d["units"]:
        what = some([f"{n} (fused, {s} tensors)" if s > 1 else n for n, s in zip(u["units"], u["sizes"])], 3)
        nbytes = f" {human(u['bytes'])}" if u["bytes"] is not None else ""
        moves.setdefault(u["layer"], []).append(f"{u['from']} -> {u['to']}{nbytes}: {what}")
    names = list(dict.fromkeys([*moves, *deltas]))
    shown = [k for k in KINDS if any(k in l for l in d["layers"])] or list(KINDS[:3])  # cpu where a plan has it
    rows = [[n, "\n".join(moves.get(n, ["(tensor sizes changed)"])),
             *(signed(deltas[n][k]) if n in deltas else "0" for k in shown)] for n in names]
    return table(["layer", "moved", *shown], rows, align="ll" + "r" * len(shown))
