"""`plan diff`'s view of a plan's GPU buffer sections: what changed in the prefetch schedule and in the
prefill staging, as plain data (`schedule`, `staging`: empty when nothing did) and as review lines."""
from __future__ import annotations

from ..plan import PrefetchSchedule, PrefillStaging
from ..units import human, plural


def change(old, new, fmt=str) -> str:
    """`old -> new`, each shown by `fmt`."""
    return f"{fmt(old)} -> {fmt(new)}"


def some(names: list[str], limit: int = 4) -> str:
    """The first `limit` names, and how many more."""
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def schedule(old: PrefetchSchedule | None, new: PrefetchSchedule | None) -> dict:
    """What changed in the prefetch section (empty when nothing did)."""
    if old == new:
        return {}
    if old is None or new is None:
        p = new or old
        return {"added" if old is None else "removed": {
            "step": p.step, "slots": p.slots, "slot_bytes": p.slot_bytes, "layers": [t.layer for t in p.schedule]}}
    out = {}
    for key in ("step", "slots", "slot_bytes"):
        if getattr(old, key) != getattr(new, key):
            out[key] = {"old": getattr(old, key), "new": getattr(new, key)}
    was = {t.layer: t.slot for t in old.schedule}
    now = {t.layer: t.slot for t in new.schedule}
    out["layers_added"] = [n for n in now if n not in was]
    out["layers_removed"] = [n for n in was if n not in now]
    out["slot_changes"] = [{"layer": n, "old": was[n], "new": s} for n, s in now.items() if n in was and was[n] != s]
    was = {t.layer: old.layouts[t.layout] for t in old.schedule}
    out["layout_changes"] = [t.layer for t in new.schedule if t.layer in was and was[t.layer] != new.layouts[t.layout]]
    return {k: v for k, v in out.items() if v}


def staging(old: PrefillStaging | None, new: PrefillStaging | None) -> dict:
    """What changed in the prefill section (empty when nothing did)."""
    if old == new:
        return {}
    if old is None or new is None:
        p = new or old
        return {"added" if old is None else "removed": {
            "above_tokens": p.above_tokens, "slots": p.slots, "slot_bytes": p.slot_bytes,
            "ring_bytes": p.ring_bytes, "layers": [l.layer for l in p.layers]}}
    out = {key: {"old": getattr(old, key), "new": getattr(new, key)}
           for key in ("above_tokens", "slots", "slot_bytes", "ring_bytes") if getattr(old, key) != getattr(new, key)}
    was, now = {l.layer: l.bytes for l in old.layers}, {l.layer: l.bytes for l in new.layers}
    out["layers_added"] = [n for n in now if n not in was]
    out["layers_removed"] = [n for n in was if n not in now]
    out["bytes_changes"] = [{"layer": n, "old": was[n], "new": b} for n, b in now.items() if n in was and was[n] != b]
    return {k: v for k, v in out.items() if v}


def schedule_lines(p: dict) -> list[str]:
    if not p:
        return []
    for key, verb in (("added", "new: streams"), ("removed", "gone: the old plan streamed")):
        if key in p:
            s = p[key]
            return [f"prefetch: {verb} {plural(len(s['layers']), 'layer')} ({some(s['layers'])}) with step "
                    f"{s['step']}, {plural(s['slots'], 'slot')} x {human(s['slot_bytes'])}"]
    parts = []
    for key, what, fmt in (("step", "step", str), ("slots", "slots", str), ("slot_bytes", "slot size", human)):
        if key in p:
            parts.append(f"{what} {change(p[key]['old'], p[key]['new'], fmt)}")
    if "layers_added" in p:
        parts.append(f"streams {some(p['layers_added'])} too")
    if "layers_removed" in p:
        parts.append(f"no longer streams {some(p['layers_removed'])}")
    if "slot_changes" in p:
        ch = p["slot_changes"]
        parts.append(f"{plural(len(ch), 'layer')} change slot ("
                     + some([f"{c['layer']} {c['old']} -> {c['new']}" for c in ch]) + ")")
    if "layout_changes" in p:
        parts.append(f"{some(p['layout_changes'])} laid out differently in {'its' if len(p['layout_changes']) == 1 else 'their'} slot")
    return ["prefetch: " + "; ".join(parts)]


def staging_lines(p: dict) -> list[str]:
    if not p:
        return []
    for key, verb in (("added", "new: stages"), ("removed", "gone: the old plan staged")):
        if key in p:
            s = p[key]
            return [f"prefill staging: {verb} {plural(len(s['layers']), 'layer')} ({some(s['layers'])}) through "
                    f"{plural(s['slots'], 'slot')} x {human(s['slot_bytes'])}"
                    + (f" and an expert ring of {human(s['ring_bytes'])}" if s["ring_bytes"] else "")
                    + f" above {plural(s['above_tokens'], 'token')}"]
    parts = [f"{what} {change(p[key]['old'], p[key]['new'], fmt)}" for key, what, fmt in
             (("above_tokens", "above", str), ("slots", "slots", str), ("slot_bytes", "slot size", human),
              ("ring_bytes", "expert ring", human)) if key in p]
    if "layers_added" in p:
        parts.append(f"stages {some(p['layers_added'])} too")
    if "layers_removed" in p:
        parts.append(f"no longer stages {some(p['layers_removed'])}")
    if "bytes_changes" in p:
        parts.append("stages other bytes of " + some([c["layer"] for c in p["bytes_changes"]]))
    return ["prefill staging: " + "; ".join(parts)]
