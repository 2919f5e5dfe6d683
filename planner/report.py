"""What `plan show` and `plan diff` print: plain tables for people, dicts for `--json`."""
from __future__ import annotations

from .plan import Plan
from .policy import GIB

KINDS = ("gpu", "uva", "prefetch")


def human(n: int) -> str:
    if n >= GIB:
        return f"{n / GIB:.2f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    if n >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{n} B"


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    def line(r):
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def show_data(plan: Plan) -> dict:
    s = plan.summary
    slot = {t.layer: t.slot for t in plan.prefetch.schedule} if plan.prefetch else {}
    return {
        "checkpoint": plan.checkpoint_path,
        "backend": plan.backend,
        "tensors": plan.tensors,
        "layers": [{"name": l.name, "gpu": l.gpu, "uva": l.uva, "prefetch": l.prefetch,
                    "slot": slot.get(l.name), "h2d_bytes_per_step": l.h2d, "gpu_us": l.us,
                    "why": l.why} for l in plan.layers],
        "summary": {"gpu_bytes": s.gpu_bytes, "uva_bytes": s.uva_bytes, "prefetch_bytes": s.prefetch_bytes,
                    "prefetch_buffer_bytes": s.prefetch_buffer_bytes,
                    "gpu_footprint_bytes": s.gpu_footprint_bytes, "budget_bytes": plan.budget_bytes,
                    "predicted_h2d_bytes_per_step": s.predicted_h2d_bytes_per_step,
                    "predicted_step_us": s.predicted_step_us},
        "cost": None if plan.cost is None else {
            "hardware": plan.cost.hardware, "batch_size": plan.cost.batch_size,
            "cpu_us": plan.cost.cpu_us, "gpu_us": plan.cost.gpu_us, "link_us": plan.cost.link_us},
        "prefetch": None if plan.prefetch is None else {
            "step": plan.prefetch.step, "slots": plan.prefetch.slots, "slot_bytes": plan.prefetch.slot_bytes,
            "layers": len(plan.prefetch.schedule)},
        "notes": list(plan.notes),
    }


def show_text(plan: Plan) -> str:
    d = show_data(plan)
    why = any(l["why"] for l in d["layers"])
    rows = [[l["name"], *(human(l[k]) if l[k] else "-" for k in KINDS),
             "-" if l["slot"] is None else str(l["slot"]),
             human(l["h2d_bytes_per_step"]) if l["h2d_bytes_per_step"] else "-", f"{l['gpu_us']}",
             *([l["why"] or ""] if why else [])] for l in d["layers"]]
    s = plan.summary
    rows.append(["total", human(s.gpu_bytes), human(s.uva_bytes), human(s.prefetch_bytes), "",
                 human(s.predicted_h2d_bytes_per_step), str(plan.cost.gpu_us if plan.cost else ""),
                 *([""] if why else [])])
    out = [f"plan for {plan.checkpoint_path}: {plan.tensors} tensors, {human(plan.total_bytes)}, "
           f"backend {plan.backend}", "",
           table(["layer", "gpu", "uva", "prefetch", "slot", "h2d/step", "gpu us", *(["why"] if why else [])],
                 rows), ""]
    if plan.prefetch:
        p = plan.prefetch
        out.append(f"prefetch: {len(p.schedule)} layers, step {p.step}, {p.slots} slots x "
                   f"{human(p.slot_bytes)} = {human(p.pool_bytes)} of GPU buffers")
    budget = plan.budget_bytes
    verdict = "no budget set" if budget is None else (
        f"budget {human(budget)}: " + ("fits" if s.gpu_footprint_bytes <= budget else "OVER BUDGET")
        + f", {human(abs(budget - s.gpu_footprint_bytes))} "
        + ("to spare" if s.gpu_footprint_bytes <= budget else "too much"))
    out.append(f"GPU footprint: {human(s.gpu_bytes)} resident + {human(s.prefetch_buffer_bytes)} "
               f"prefetch buffers = {human(s.gpu_footprint_bytes)} ({verdict})")
    out.append(f"host (pinned): {human(s.uva_bytes)} uva + {human(s.prefetch_bytes)} prefetch")
    if plan.cost:
        c = plan.cost
        bound = max((c.cpu_us, "kernel launches (CPU)"), (c.gpu_us, "GPU reads"), (c.link_us, "the host link"))[1]
        out.append(f"predicted at batch {c.batch_size} on {c.hardware}: {human(s.predicted_h2d_bytes_per_step)} "
                   f"over the link per step; step {c.step_us / 1e3:.2f} ms = max(cpu {c.cpu_us / 1e3:.2f}, "
                   f"gpu {c.gpu_us / 1e3:.2f}, link {c.link_us / 1e3:.2f} ms), bound by {bound}")
    out += [f"note: {n}" for n in plan.notes]
    return "\n".join(out)


def diff_data(old: Plan, new: Plan, sizes: dict[str, int] | None = None) -> dict:
    """What moved where. With `sizes` (tensor bytes, from the checkpoint's headers) each move
    also gets its bytes; without, the per-layer byte deltas still say how much moved."""
    moved: dict[str, dict[str, list[str]]] = {}
    for name, place in new.params.items():
        before = old.params.get(name)
        if before is not None and before is not place:
            moved.setdefault(f"{before.value}->{place.value}", {}).setdefault("params", []).append(name)
    added = [n for n in new.params if n not in old.params]
    removed = [n for n in old.params if n not in new.params]
    old_layers = {l.name: l for l in old.layers}
    new_layers = {l.name: l for l in new.layers}
    layers = []
    for name in [*new_layers, *(n for n in old_layers if n not in new_layers)]:
        a, b = old_layers.get(name), new_layers.get(name)
        delta = {k: (getattr(b, k) if b else 0) - (getattr(a, k) if a else 0) for k in KINDS}
        if any(delta.values()):
            layers.append({"name": name, **delta})
    so, sn = old.summary, new.summary
    summary = {k: getattr(sn, k) - getattr(so, k) for k in
               ("gpu_bytes", "uva_bytes", "prefetch_bytes", "prefetch_buffer_bytes", "gpu_footprint_bytes")}
    inputs_changed = {
        "checkpoint": old.checkpoint_fingerprint != new.checkpoint_fingerprint,
        "policy": old.policy_fingerprint != new.policy_fingerprint,
        "backend": old.backend != new.backend,
    }
    same = not moved and not added and not removed and not layers and not any(summary.values()) \
        and old.prefetch == new.prefetch and not any(inputs_changed.values())
    moved_bytes = None if sizes is None else {
        k: sum(sizes.get(n, 0) for n in v["params"]) for k, v in sorted(moved.items())}
    return {"same": same, "moved": {k: v["params"] for k, v in sorted(moved.items())},
            "moved_bytes": moved_bytes,
            "added": added, "removed": removed, "layers": layers, "summary": summary,
            "checkpoint_changed": inputs_changed["checkpoint"],
            "policy_changed": inputs_changed["policy"],
            "backend_changed": inputs_changed["backend"],
            "schedule_changed": old.prefetch != new.prefetch}


def _signed(n: int) -> str:
    return ("+" if n > 0 else "-" if n < 0 else "") + human(abs(n)) if n else "0"


def diff_text(d: dict, limit: int = 10) -> str:
    if d["same"]:
        return "no changes: the plans place every tensor the same way"
    out = []
    s = d["summary"]
    out.append("totals: " + ", ".join(f"{k.removesuffix('_bytes')} {_signed(v)}" for k, v in s.items() if v)
               if any(s.values()) else "totals: unchanged")
    if d["checkpoint_changed"]:
        out.append("the checkpoint fingerprint differs between the plans")
    if d["policy_changed"]:
        out.append("the policy fingerprint differs between the plans")
    if d["backend_changed"]:
        out.append("the backend differs between the plans")
    for move, names in d["moved"].items():
        nbytes = f", {human(d['moved_bytes'][move])}" if d.get("moved_bytes") else ""
        out.append(f"{move}: {len(names)} tensors{nbytes}")
        out += [f"  {n}" for n in names[:limit]]
        if len(names) > limit:
            out.append(f"  ... and {len(names) - limit} more")
    for key in ("added", "removed"):
        if d[key]:
            out.append(f"{key}: {len(d[key])} tensors")
            out += [f"  {n}" for n in d[key][:limit]]
    if d["layers"]:
        out += ["", table(["layer", "gpu", "uva", "prefetch"],
                          [[l["name"], *(_signed(l[k]) for k in KINDS)] for l in d["layers"]])]
    if d["schedule_changed"]:
        out.append("the prefetch schedule changed")
    return "\n".join(out)
