"""The plan's `prefetch:` and `prefill:` sections against its `params:` (consistency.py's module doc says what is
compared, with and without the checkpoint's headers at hand)."""
from __future__ import annotations

import dataclasses

from ..decide.schedule import make_schedule, previous_user
from ..decide.staging import RING_BYTES, STAGE_SLOTS, ring_bytes, stageable, staged as staged_in
from ..inputs.quantized import partners
from ..layers.graph import LayerGraph
from ..layers.groups import is_expert
from ..layers.slots import ALIGN
from ..plan import Placement, Plan, Runs
from ..units import human


def prefetch_problems(plan: Plan, graph: LayerGraph, at, tensors) -> list[str]:
    """The schedule against the prefetched tensors of `params:`, then the rule that builds it."""
    streamed = [l for l in graph.layers if any(plan.params[n] is Placement.PREFETCH for n in l.params)]
    names = [l.name for l in streamed]
    problems = []
    runs = {l.name: l.runs for l in streamed} | {r.name: r.runs for r in plan.layers}  # the rows know MTP layers
    for l in (l for l in streamed if runs[l.name] is not Runs.STEP):  # placement.py step 6
        first = next(n for n in l.params if plan.params[n] is Placement.PREFETCH)
        problems.append(f"{at('params', first)}: prefetch, but {l.name} runs only for "
                        f"{'prompts with images' if runs[l.name] is Runs.IMAGES else 'multi-token prediction'}"
                        ", and a prefetched layer must run in every forward (a plan of an older offplan? rebuild it)")
    p = plan.prefetch
    if p is None:
        if names:
            problems.append(f"{at('prefetch')}: is null but params: prefetch tensors of {_some(names)}")
        return problems
    listed = [t.layer for t in p.schedule]
    if listed != names:
        problems.append(f"{at('prefetch', 'schedule')}: lists {_some(listed)} but the layers with prefetched "
                        f"tensors in params: are {_some(names)}")
        return problems
    largest = max((l.bytes for l in p.layouts), default=0)
    if largest != p.slot_bytes:
        problems.append(f"{at('prefetch', 'slot_bytes')} is {p.slot_bytes} but the largest layout is {largest}")
    slots = max(1, min(p.step, len(names)))
    if p.slots != slots:
        problems.append(f"{at('prefetch', 'slots')} is {p.slots} but step {p.step} over {len(names)} layers "
                        f"gives {slots}")
    for k, t in enumerate(p.schedule):
        prev = previous_user(k, slots, len(names))
        if (t.slot, t.after) != (k % slots, names[prev]):
            problems.append(f"{at('prefetch', 'schedule', k)}: {t.layer} must use slot {k % slots} after "
                            f"{names[prev]}, not slot {t.slot} after {t.after}")
        if t.module != streamed[k].module:
            problems.append(f"{at('prefetch', 'schedule', k)}: {t.layer} runs in module {streamed[k].module}, "
                            f"not {t.module}")
        if not 0 <= t.layout < len(p.layouts):
            problems.append(f"{at('prefetch', 'schedule', k)}: layout {t.layout} does not exist "
                            f"({len(p.layouts)} layouts)")
    if problems:
        return problems
    if tensors is None:
        for k, (t, l) in enumerate(zip(p.schedule, streamed)):
            want = {l.local(n) for n in l.params if plan.params[n] is Placement.PREFETCH}
            have = {b.name for b in p.layouts[t.layout].buffers}
            if want != have:
                lost, extra = sorted(want - have), sorted(have - want)
                problems.append(f"{at('prefetch', 'schedule', k)}: layout {t.layout} of {t.layer} "
                                + (f"lacks {_some(lost)}, which params: prefetch" if lost else "")
                                + ("; it " if lost and extra else "")
                                + (f"has {_some(extra)}, which params: does not prefetch" if extra else ""))
        return problems
    want = make_schedule(graph, plan.params, tensors, p.step)
    wrong_layouts = set()
    for t, w in zip(p.schedule, want.schedule):
        got, need = p.layouts[t.layout], want.layouts[w.layout]
        if got != need and t.layout not in wrong_layouts:
            wrong_layouts.add(t.layout)
            wrong = [f"{b.name} at {b.offset} ({b.bytes} bytes)" for b in need.buffers if b not in got.buffers]
            problems.append(f"{at('prefetch', 'layouts', t.layout)}: the layout of {t.layer} is not the one its "
                            f"prefetched tensors need ({human(need.bytes)}"
                            + (f"; it lacks or misplaces {_some(wrong)}" if wrong else "") + ")")
    return problems


def prefill_problems(plan: Plan, graph: LayerGraph, at, tensors) -> list[str]:
    """The staging section against the uva tensors of `params:` (staging.py)."""
    p = plan.prefill
    if p is None:
        return []  # `uva.stage_prefill: false` plans none; `plan check` compares with a rebuild
    runs = {r.name: r.runs for r in plan.layers}  # MTP layers are known from config.json, which the plan records here
    names = stageable((dataclasses.replace(l, runs=runs.get(l.name, l.runs)) for l in graph.layers),
                      partners(tensors or {}), p.experts)
    staged = [(l, ns, size) for l in graph.layers for ns, size in [staged_in(l, names, plan.params, tensors)] if ns]
    listed, want = [s.layer for s in p.layers], [l.name for l, _, _ in staged]
    if listed != want:
        return [f"{at('prefill', 'layers')}: lists {_some(listed)} but the layers of params: with uva tensors that "
                f"prefill stages (not embeddings{'' if p.experts else ', routed experts'} or MTP layers) are {_some(want)}"]
    if p.experts and not any(is_expert(n) for _, ns, _ in staged for n in ns):
        return [f"{at('prefill', 'ring_bytes')} is set but no staged layer holds a routed expert on uva"]
    problems, rows = [], {r.name: r for r in plan.layers}
    for k, (s, (l, ns, need)) in enumerate(zip(p.layers, staged)):
        if s.module != l.module:
            problems.append(f"{at('prefill', 'layers', k)}: {s.layer} runs in module {l.module}, not {s.module}")
        if need is not None:
            if s.bytes != need:
                problems.append(f"{at('prefill', 'layers', k, 'bytes')} is {s.bytes} but the staged tensors of "
                                f"{s.layer} take {need} (each rounded up to {ALIGN} bytes)")
            continue
        row = rows.get(l.name)
        only = all(plan.params[n] is not Placement.UVA or n in names for n in l.params)
        if row is None:
            continue  # the layer table's own check names it
        # each rounded up to ALIGN: all of the row's uva bytes unless some are not staged or are routed (the ring)
        low, high = row.uva if only and not any(map(is_expert, ns)) else 0, row.uva + (ALIGN - 1) * len(l.params)
        if s.bytes % ALIGN or not low <= s.bytes <= high:
            problems.append(f"{at('prefill', 'layers', k, 'bytes')} is {s.bytes} but the {len(ns)} staged tensors "
                            f"of {s.layer} ({row.uva} bytes on uva in its row) take a multiple of {ALIGN} from "
                            f"{low} to {high}")
    if tensors and p.ring_bytes != (ring := ring_bytes(sum(tensors[n].nbytes for n in ns if is_expert(n))
                                                       for _, ns, _ in staged)):
        problems.append(f"{at('prefill', 'ring_bytes')} is {p.ring_bytes} but the staged layers' routed experts on "
                        f"uva or cpu give {ring} (the largest layer's, at most {RING_BYTES})")
    largest = max(s.bytes for s in p.layers)
    if p.slot_bytes != largest:
        problems.append(f"{at('prefill', 'slot_bytes')} is {p.slot_bytes} but the largest staged layer is {largest}")
    if p.slots != min(STAGE_SLOTS, n := sum(1 for s in p.layers if s.bytes)):
        problems.append(f"{at('prefill', 'slots')} is {p.slots} but {n} staged layers with bytes in a slot give "
                        f"{min(STAGE_SLOTS, n)} (at most {STAGE_SLOTS})")
    return problems


def _some(names: list[str], limit: int = 5) -> str:
    if not names:
        return "none"
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")
