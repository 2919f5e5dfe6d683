"""Does a plan say what it runs? The one check behind `plan show`, `plan validate` and `plan apply`.

A plan repeats itself on purpose: `params:` is what the runtime applies; `layers:`, `summary:`, `prefetch:` and
`prefill:` are what a reviewer reads. A hand edit can make them disagree, and then review shows one thing while
another runs. Every command that reads a plan (`planner.planfile.read_plan`, which the runtime uses too) runs this
check and refuses a plan that fails it, naming the lines that disagree (located only then: a location composes the
file's node tree, a second parse).

What is compared depends on what is at hand. The plan stores each tensor's
placement but not its size, so:

- from the plan alone: the layer table lists the layers that `params:` forms (with `stacks:`), in order;
  each byte count of a layer's row is backed by a tensor of that layer with that placement; the totals add
  up (summary, checkpoint bytes, footprint, predicted link bytes and step time); each expert of a fused
  parameter has one placement, a prefetched group is whole; `prefetch:` streams exactly the
  layers that `params:` prefetches, each from a buffer named like its tensors, through the slots and copy
  triggers of the rule that built it, and each of them runs in every forward (no vision tower, no MTP layer);
  `prefill:` stages exactly the layers whose uva tensors prefill stages (staging.py: not embeddings or MTP
  layers, which the layer table's `runs` names; routed experts only with `ring_bytes`, then in some layer),
  in order, each hooked at its module, with bytes a multiple of 256 within what its row's uva bytes allow,
  its slot the largest, min(2, layers with bytes) slots, stage_buffer_bytes the pool;
- with the checkpoint's headers (sizes, dtypes, shapes: cheap to read), also exactly: `params:` names the
  checkpoint's tensors, each layer's bytes per placement are the sum of its tensors', the buffers and slot sizes
  are those its prefetched tensors need, each staged layer's bytes those of its staged tensors, and the ring its
  routed experts'; a quantized weight and its scales share a placement.
  A tensor-parallel plan (`parallel:`) is compared with one GPU's share of them (parallel.py).

Only routed experts are on cpu. Not checked: the predicted link bytes, GPU time per layer and prefill, which need
the cost model's hardware profile (only the step's totals are compared), and `prefill.above_tokens` (the profile's).
A plan without a `prefill:` section passes whatever it places on uva (the policy may say `uva.stage_prefill:
false`); `plan check` compares it with a rebuild.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from ..decide.schedule import make_schedule, previous_user
from ..decide.staging import RING_BYTES, STAGE_SLOTS, ring_bytes, stageable, staged as staged_in
from ..errors import PolicyError
from ..inputs.checkpoint import TensorInfo
from ..inputs.quantized import apart, partners
from ..inputs.yamlio import dotted
from ..layers.graph import Layer, LayerGraph, build_graph
from ..layers.groups import FusedGroups, experts_map, is_expert
from ..layers.slots import ALIGN
from ..plan import Placement, Plan, Runs
from ..units import human
from .parallel import parallel_problems, share

KINDS = ("gpu", "uva", "prefetch", "cpu")
Where = Callable[[tuple], str]  # key path -> "file:line:column"


def inconsistencies(plan: Plan, where: Where | None = None, tensors: Mapping[str, TensorInfo] | None = None,
                    footprint: int | None = None) -> list[str]:
    """Every disagreement between the plan's parts, one line each, located by `where`.

    `tensors` (the checkpoint's headers) makes the byte checks exact; `footprint` is the file's
    `summary.gpu_footprint_bytes` (not kept in `Summary`)."""
    def at(*path) -> str:
        return f"{where(path)}: {dotted(path)}" if where else dotted(path)

    tensors = share(plan, tensors)  # a tensor-parallel plan's bytes are one GPU's share (parallel.py)
    problems = _totals(plan, at, footprint) + parallel_problems(plan, at, tensors)
    try:
        graph = build_graph(plan.params, plan.stacks)
    except PolicyError as e:
        return problems + [f"{at('stacks')}: {e.problems[0] if e.problems else e}"]
    if tensors is not None:
        odd = _names(plan, tensors, at)
        if odd:  # sizes of unknown tensors: nothing else can be compared exactly
            return problems + odd
    problems += _layers(plan, graph.layers, at, tensors) + _groups(plan, at, graph, tensors)
    problems += _prefetch(plan, graph, at, tensors) + _prefill(plan, graph, at, tensors)
    problems += [f"{at('params')}: {x}; a weight and its scales are one unit" for x in apart(plan.params, tensors or {})]
    return problems


def _totals(plan: Plan, at, footprint: int | None) -> list[str]:
    problems = []
    if len(plan.params) != plan.tensors:
        problems.append(f"{at('checkpoint', 'tensors')} is {plan.tensors} but params lists {len(plan.params)}")
    totals = {k: sum(getattr(l, k) for l in plan.layers) for k in KINDS}
    s = plan.summary
    for k in KINDS:
        if totals[k] != getattr(s, f"{k}_bytes"):
            problems.append(f"{at('summary', f'{k}_bytes')} is {getattr(s, f'{k}_bytes')} but the layers "
                            f"add up to {totals[k]}")
    if plan.parallel is None and sum(totals.values()) != plan.total_bytes:  # else a share: parallel.py
        problems.append(f"{at('checkpoint', 'bytes')} is {plan.total_bytes} but the layers add up to {sum(totals.values())}")
    if footprint is not None and footprint != s.gpu_footprint_bytes:
        problems.append(f"{at('summary', 'gpu_footprint_bytes')} is {footprint} but the pools, gpu_bytes and the "
                        f"working memory's peak (plan.py Summary) add up to {s.gpu_footprint_bytes}")
    h2d = sum(l.h2d for l in plan.layers)
    if h2d != s.predicted_h2d_bytes_per_step:
        problems.append(f"{at('summary', 'predicted_h2d_bytes_per_step')} is {s.predicted_h2d_bytes_per_step} "
                        f"but the layers add up to {h2d}")
    if plan.cost is not None and plan.cost.step_us != s.predicted_step_us:
        problems.append(f"{at('summary', 'predicted_step_us')} is {s.predicted_step_us} but the cost "
                        f"section gives {plan.cost.step_us}")
    for key, name, section in (("prefetch_buffer_bytes", "prefetch", plan.prefetch),
                               ("stage_buffer_bytes", "prefill", plan.prefill)):
        pool, said = section.pool_bytes if section else 0, getattr(s, key)
        if pool != said:
            problems.append(f"{at('summary', key)} is {said} but the {name} section sizes the pool at {pool}")
    return problems


def _names(plan: Plan, tensors: Mapping[str, TensorInfo], at) -> list[str]:
    extra = [n for n in plan.params if n not in tensors]
    missing = [n for n in tensors if n not in plan.params]
    return ([f"{at('params', n)}: the checkpoint has no such tensor" for n in extra]
            + [f"{at('params')}: lacks the checkpoint's tensor {n}" for n in missing])


def _layers(plan: Plan, layers: tuple[Layer, ...], at, tensors) -> list[str]:
    """The layer table against `params:`: same layers in the same order; bytes backed by tensors."""
    rows = plan.layers
    made = [l.name for l in layers]
    listed = [l.name for l in rows]
    if made != listed:
        i = next((i for i, (a, b) in enumerate(zip(made, listed)) if a != b), min(len(made), len(listed)))
        want = made[i] if i < len(made) else "nothing"
        got = listed[i] if i < len(listed) else "nothing"
        path = ("layers", i) if i < len(listed) else ("layers",)
        counts = f" ({len(listed)} layers; params: make {len(made)})" if len(made) != len(listed) else ""
        return [f"{at(*path)}: lists {got} where the tensors of params: (with stacks: "
                f"{list(plan.stacks)}) make {want}{counts}"]
    problems = []
    for i, (row, layer) in enumerate(zip(rows, layers)):
        split = experts_map(layer.params, plan.params.__getitem__, layer.name + ".", layer.expert_tensors)
        if split != row.experts:
            problems.append(f"{at('layers', i)}: {row.name} says experts {row.experts!r} but params: place them "
                            f"{split!r}")
        of = {k: [n for n in layer.params if plan.params[n].value == k] for k in KINDS}
        if tensors is None:
            for k in KINDS:
                if getattr(row, k) and not of[k]:
                    problems.append(f"{at('layers', i, k)}: {row.name} has {getattr(row, k)} bytes on {k} but "
                                    f"params: place none of its tensors on {k}")
            continue
        has = {k: sum(tensors[n].nbytes for n in of[k]) for k in KINDS}
        says = {k: getattr(row, k) for k in KINDS}
        if has != says:
            more = [k for k in KINDS if has[k] > says[k]]
            lines = [f"{at('params', n)}: {k}" for k in more for n in of[k][:3]]
            problems.append(f"{at('layers', i)}: {row.name} has " + _bytes(says) + "; its tensors in params: "
                            "have " + _bytes(has) + (" (" + "; ".join(lines) + ")" if lines else ""))
    return problems


def _bytes(by: Mapping[str, int]) -> str:
    return ", ".join(f"{k} {by[k]:,}" for k in KINDS if k != "cpu" or by[k])  # cpu: only where there is some


def _groups(plan: Plan, at, graph: LayerGraph, tensors) -> list[str]:
    """Fused experts (groups.py): one placement per expert of a fused parameter, a group prefetched whole (its
    parameters are views of one slot) or not at all, and only experts on cpu; a group placed alike is fine."""
    groups = FusedGroups.of_layers(graph.layers, tensors) if tensors is not None else FusedGroups.find(plan.params)
    problems = [f"{at('params', n)}: cpu holds routed experts only, and {n} is none" for n, p in plan.params.items()
                if p is Placement.CPU and n not in groups.group_of] if plan.summary.cpu_bytes else []
    for group, members in groups.members.items():
        if len(set(map(plan.params.__getitem__, members))) == 1:
            continue
        kinds: dict[str, list[str]] = {}
        for m in members:
            kinds.setdefault(plan.params[m].value, []).append(m)
        if "prefetch" in kinds and len(kinds) > 1:
            minority = min(kinds.values(), key=len)
            counts = ", ".join(f"{len(v)} {k}" for k, v in kinds.items())
            problems.append(f"{at('params', minority[0])}: {plan.params[minority[0]].value}, but fused group "
                            f"{group} is prefetched, so all of it must be (its parameters are views of one "
                            f"slot): {counts}")
            continue
        for m in members:
            unit = groups.expert(m)
            if m == unit[0] and len({plan.params[n] for n in unit}) > 1:
                odd = next(n for n in unit if plan.params[n] is not plan.params[m])
                problems.append(f"{at('params', odd)}: {plan.params[odd].value}, but {m} is "
                                f"{plan.params[m].value}: they are one row of a fused parameter at run time")
    return problems


def _prefetch(plan: Plan, graph: LayerGraph, at, tensors) -> list[str]:
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


def _prefill(plan: Plan, graph: LayerGraph, at, tensors) -> list[str]:
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
