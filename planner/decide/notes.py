"""What a plan says it does: its notes, computed from the final placements.

Reviewers read a plan's notes, so each one states a fact of the placements the
plan holds, not of what the policy asked for:

- what the backend offloaded (bytes and layers), or why it offloaded nothing;
- what the rules placed off the GPU, and warnings for rules that place nothing and for settings the plan ignores
  (the policy's warnings, without their file:line:column);
- mixed's choice, the cost model's assumptions (routing: uniform, or the profile
  and how skewed it is), tied embeddings;
- warnings for plans that save little or no GPU memory (`saving_warnings`);
- for a tensor-parallel plan, first, that its figures are one GPU's share and
  which link and bandwidth each GPU reads over, and, with per-GPU budgets
  that differ, that the plan fits the smallest (`parallel_notes`).

A warning is a note that starts with `warning: `; `plan build` also prints it
on stderr, and `plan show` prints it as a warning.

Example: a policy whose only rule places the embedding on uva, with no amount
or budget, gets
    rules place 64.0 KiB on uva (1 tensor)
    backend auto offloads nothing beyond the rules: no offload amount or budget is set
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import is_, is_not, itemgetter

from ..inputs.checkpoint import TensorInfo
from ..inputs.policy import Policy
from ..inputs.routing import RoutingProfile, skew
from ..layers.graph import LayerGraph
from ..plan import Backend, Placement, PrefetchSchedule, PrefillStaging, Runs, Summary
from ..units import human, percent, plural

GPU, UVA, PREFETCH, CPU = Placement.GPU, Placement.UVA, Placement.PREFETCH, Placement.CPU
WARNING = "warning: "
_LOCATION = re.compile(r"^.*?:\d+:\d+: ")
_NBYTES = itemgetter(3)  # of a TensorInfo


def is_warning(note: str) -> bool:
    return note.startswith(WARNING)


def unlocated(warning: str) -> str:
    """A policy's warning without its leading `file:line:column: `: a plan's notes do not depend on where the
    policy was named from."""
    return _LOCATION.sub("", warning, count=1)


def saving(s: Summary) -> tuple[int, int]:
    """(the bytes a plan moves off the GPU, what that saves of GPU memory: those less the prefetch and staging pools
    and the experts' working memory at its peak), from its summary: `plan show` and the warnings below say the same."""
    offloaded = s.uva_bytes + s.prefetch_bytes + s.cpu_bytes
    return offloaded, offloaded - s.prefetch_buffer_bytes - s.stage_buffer_bytes - s.working_peak_bytes


@dataclass(frozen=True)
class Outcome:
    """What `placement.decide` did: everything the notes are computed from."""

    policy: Policy
    backend: Backend  # what ran: none, uva, prefetch or mixed
    reason: str | None  # why `backend: auto` chose it; None when the policy names the backend
    skipped: Backend | None  # the backend that did not run because the plan fits the budget without it
    place: Mapping[str, Placement]  # final, every tensor
    fixed: frozenset[str]  # the tensors that rules placed
    tensors: Mapping[str, TensorInfo]
    graph: LayerGraph
    schedule: PrefetchSchedule | None
    mixed: tuple[str, ...] = ()  # mixed's choice and the strategies' predictions
    experts_without_top_k: bool = False
    routing: RoutingProfile | None = None  # the policy's routing profile (`workload.routing`)
    uniform_routing: bool = False  # MoE layers run in decode, top-k known, no profile: routing assumed uniform
    checkpoint_fingerprint: str | None = None  # the plan's checkpoint, against the profile's
    staging: PrefillStaging | None = None  # the prefill staging section (staging.py)
    not_experts: Mapping[str, str] = field(default_factory=dict)  # tensor -> why its rows are not experts
    on: Mapping[Placement, int] | None = None  # bytes on each placement, as decide summed them; None: summed here
    wheres: Mapping[str, tuple] | None = None  # layer name -> its tensors' placements, as decide read them
    shadowed: tuple[int, ...] = ()  # the rules with a place whose every match an earlier rule placed
    summary: Summary | None = None  # the plan's sums: what offloading saves (`saving`)


def notes(o: Outcome) -> tuple[str, ...]:
    """The plan's notes, in order: rules, backend, mixed, cost-model caveats, warnings."""
    by_rules = {UVA: 0, PREFETCH: 0, CPU: 0}
    ruled = 0
    for n in o.fixed:  # few: what rules placed
        if o.place[n] is not GPU:
            by_rules[o.place[n]] += o.tensors[n].nbytes
            ruled += 1
    on = o.on or {p: sum(map(_NBYTES, map(o.tensors.__getitem__, compress(o.place, map(is_, o.place.values(),
                                                                                       repeat(p))))))
                  for p in (UVA, PREFETCH, CPU)}
    by_backend = {p: on[p] - by_rules[p] for p in (UVA, PREFETCH)}
    out = []
    if ruled:
        out.append(f"rules place {_amounts(by_rules)} ({plural(ruled, 'tensor')})")
    if by_rules[CPU]:
        out.append(f"{human(by_rules[CPU])} of routed experts on cpu: the host CPU computes them beside the GPU, as "
                   "the hardware profile's cpu figures predict (cpu_threads host threads; the runtime refuses the "
                   "plan where fewer cores are free)" + (
                       f"; over {o.policy.gpus} GPUs each process computes its share with its share of the host's "
                       "threads and reads (plan show's \"host CPU per GPU\")" if o.policy.gpus > 1 else ""))
    out += [f"{WARNING}rules[{i}] places nothing: an earlier rule places every tensor it matches (the first rule "
            "that matches a tensor wins); move it up, or remove it" for i in o.shadowed]  # (no file:line: a plan's
    # notes do not depend on where the policy was named from)
    out += [WARNING + unlocated(w) for w in o.policy.warnings]  # settings the plan ignores, for its reviewers
    out.append(_backend_note(o, by_backend, any(by_rules.values())))
    out += o.mixed
    out += _rarely_run(o)
    out += _routing(o)
    out += _not_experts(o.not_experts)
    if o.experts_without_top_k:
        out.append("the checkpoint has MoE experts but no experts-per-token (config.json or "
                   "workload.experts_per_token): the cost model assumes each step reads every expert")
    if o.graph.tied_embeddings:
        out.append("tied embeddings: the checkpoint has no lm_head tensor; the head reuses the embedding")
    out += saving_warnings(o.summary, o.schedule, o.staging) if o.summary else []
    return tuple(out)


def parallel_notes(gpus: int, model_type: str | None, h2d_gbps: float, budgets: tuple[int, ...] | None) -> list[str]:
    """What a reviewer must know before reading any figure of a plan for `gpus` GPUs (tensor parallelism):
    every figure is one GPU's share, and each GPU streams over its own link at `h2d_gbps` (the hardware's
    `parallel_h2d_copy_gbps`). `budgets`: the policy's per-GPU budgets in bytes when they differ."""
    out = [f"tensor parallel over {gpus} GPUs (transformers' plan for model_type {model_type}): every figure is one "
           f"GPU's share; each GPU reads its share over its own host link (H2D predicted at {h2d_gbps:.3g} GB/s each)"]
    if budgets is not None:
        each = ", ".join(f"GPU {i} {human(b)}" for i, b in enumerate(budgets))
        out.append(f"the GPUs' budgets differ ({each}): the plan fits the smallest, {human(min(budgets))}, on every "
                   "GPU, since each GPU applies the same share; the larger budgets' spare memory goes unused")
    return out


def _rarely_run(o: Outcome) -> list[str]:
    """What the cost model leaves out of a decode step (graph.py `Runs`), and where it went."""
    rare = o.graph.rarely_run()
    if not rare:
        return []
    parts, moved = [], 0
    for runs, what in ((Runs.IMAGES, "run only with images"), (Runs.MTP, "predict extra tokens (MTP)")):
        layers = [l for l in rare if l.runs is runs]
        if layers:
            size = sum(o.tensors[n].nbytes for l in layers for n in l.params)
            parts.append(f"{plural(len(layers), 'layer')} that {what} ({human(size)})")
        moved += sum(o.tensors[n].nbytes for l in layers for n in l.params
                     if o.place[n] is not GPU and n not in o.fixed)
    where = f"; {human(moved)} of them offloaded, first" if moved and o.policy.budget_bytes is not None else ""
    return [f"not in a decode step, so the cost model counts them in none: {' and '.join(parts)}{where}"]


def _routing(o: Outcome) -> list[str]:
    """Where the cost model's expert routing comes from: a profile (and how skewed it is), or uniform."""
    p = o.routing
    if p is None:
        return ["routing assumed uniform: no workload.routing profile (record one with `plan profile`)"
                ] if o.uniform_routing else []
    name = o.policy.workload.routing_text or (p.path.name if p.path else "(not from a file)")
    out = [f"routing from the profile {name} (workload.routing): {plural(p.decode_tokens, 'decode token')} of "
           f"{plural(p.sequences, 'prompt')} ({p.prompts}); {skew(p).text()}"]
    if o.checkpoint_fingerprint is not None and p.checkpoint_fingerprint != o.checkpoint_fingerprint:
        out.append(f"{WARNING}the routing profile {name} was recorded on another checkpoint ({p.checkpoint_path}, "
                   f"{p.checkpoint_fingerprint[:19]}...): its layers and experts match this one's, but it predicts "
                   "this one's routing only if the two route alike (record one: `plan profile`)")
    return out


def _not_experts(why: Mapping[str, str]) -> list[str]:
    """Tensors of experts modules, stored for every expert at once, that the cost model reads whole because
    their first dimension does not count the experts (prefused.py); layer numbers folded to N."""
    if not why:
        return []
    fold = re.compile(r"(?<=\.)\d+(?=\.)")
    templates: dict[tuple[str, str], int] = {}
    for n, reason in why.items():
        key = (fold.sub("N", n), fold.sub("N", reason))
        templates[key] = templates.get(key, 0) + 1
    listed = "; ".join(f"{name} ({plural(count, 'tensor')}): {reason}" for (name, reason), count in
                       list(templates.items())[:3])
    more = f"; and {plural(len(templates) - 3, 'more name')}" if len(templates) > 3 else ""
    return [f"read whole by the cost model, though in an experts module: tensors with no expert number whose "
            f"rows are not the experts: {listed}{more}"]


def _amounts(by: Mapping[Placement, int]) -> str:
    parts = []
    if by[UVA]:
        parts.append(f"{human(by[UVA])} on uva")
    if by[PREFETCH]:
        parts.append(f"{human(by[PREFETCH])} on prefetch")
    if by.get(CPU):
        parts.append(f"{human(by[CPU])} on cpu")
    return " and ".join(parts)


def _backend_note(o: Outcome, by_backend: Mapping[Placement, int], rules_offload: bool) -> str:
    pol = o.policy
    if o.skipped is not None:
        if not rules_offload:
            total = sum(map(_NBYTES, o.tensors.values()))
            return (f"the whole checkpoint ({human(total)}) fits budget_gib {pol.budget_gib}: nothing is "
                    "offloaded (offloading would only cost speed)")
        return (f"the plan fits budget_gib {pol.budget_gib} with the rules' placements alone: backend "
                f"{o.skipped.value} offloads nothing more (offloading would only cost speed)")
    if o.backend is Backend.NONE:
        hint = ""
        if pol.uva.params:
            hint = " (uva.params only narrows what uva.offload_gib or budget_gib offloads)"
        if rules_offload:
            return f"backend auto offloads nothing beyond the rules: no offload amount or budget is set{hint}"
        return ("nothing is offloaded: backend auto has no offload amount or budget (set uva.offload_gib, "
                f"prefetch.group_size or budget_gib){hint}")
    origin = "named by the policy" if o.reason is None else f"auto: {o.reason}"
    # the layers holding an offloaded tensor that no rule placed (picked in C: most of a layer stays)
    where = (lambda l: map(o.place.__getitem__, l.params)) if o.wheres is None else (lambda l: o.wheres[l.name])
    layers = sum(1 for l in o.graph.layers if not o.fixed.issuperset(compress(l.params, map(is_not, where(l),
                                                                                             repeat(GPU)))))
    return f"backend {o.backend.value} ({origin}): {_amounts(by_backend)} from {plural(layers, 'layer')}"


def saving_warnings(summary: Summary, schedule: PrefetchSchedule | None,
                    staging: PrefillStaging | None = None) -> list[str]:
    """Warnings for a plan whose prefetch or prefill staging buffers, or the experts' working memory, eat what
    offloading saves.

    Offloading saves what `saving` says (uva saves what it moves less the staging slots; prefetch what it moves less
    its slots; experts off the GPU, less the rows each forward gathers of them: working.py). A plan that offloads
    nothing gets neither. Two warnings:
    - the plan as a whole saves less than half of what it offloads, for
      example because it has as many slots as prefetched layers, or streams a
      single tensor (a prefetched `lm_head` alone: its slot is as large as it),
      or stages one or two uva layers (each has a staging slot of its own);
    - one prefetched layer alone sizes every slot, at more than 1.5x the next
      largest (a prefetched `lm_head` among the decoder layers): each slot
      grows by the difference, for one layer's sake.
    """
    working_bytes = summary.working_peak_bytes
    if schedule is None and staging is None and not working_bytes:
        return []
    offloaded_bytes, saved = saving(summary)
    out = []
    if offloaded_bytes and 2 * saved < offloaded_bytes:  # nothing offloaded: nothing to save (resident FP8
        # experts still have working memory, their rows dequantized in each forward: show lists it)
        amount = (f"{human(saved)} ({percent(saved, offloaded_bytes)} of the {human(offloaded_bytes)} offloaded)"
                  if saved > 0 else f"nothing of the {human(offloaded_bytes)} offloaded" if saved == 0 else
                  f"none: it takes {human(-saved)} more than keeping every weight on the GPU would")
        why = []
        if schedule is not None:
            slots, layers = schedule.slots, len(schedule.schedule)
            why.append(f"the prefetch buffers take {human(schedule.pool_bytes)} ({plural(slots, 'slot')} x "
                       f"{human(schedule.slot_bytes)})")
            if slots >= layers:
                why[-1] += (f": there are as many slots as prefetched layers ({layers}), so each prefetched layer "
                            "has a slot of its own; " + ("lower prefetch.step or prefetch more layers"
                                                         if schedule.step > 1 else "prefetch more layers"))
        if staging is not None and staging.pool_bytes:
            why.append(f"the prefill staging buffers take {human(staging.pool_bytes)} ({plural(staging.slots, 'slot')}"
                       f" x {human(staging.slot_bytes)} for {plural(len(staging.layers), 'uva layer')}); offload "
                       "more layers to uva, or set `uva: {stage_prefill: false}` to read them in place at prefill")
        if working_bytes:
            why.append(f"the experts' working memory takes {human(working_bytes)} at its peak (the rows of the "
                       "touched experts off the GPU, gathered in each forward): offload more of them, or none")
        out.append(f"{WARNING}the plan saves little GPU memory: {amount}; {'; '.join(why)}")
    if schedule is None:
        return out
    slots = schedule.slots
    sizes = sorted(((schedule.layouts[t.layout].bytes, t.layer) for t in schedule.schedule), reverse=True)
    if len(sizes) > slots and sizes[0][0] > 1.5 * sizes[1][0]:
        (big, name), (next_big, _) = sizes[0], sizes[1]
        slots_take = "the slot takes" if slots == 1 else f"the {slots} slots take"
        out.append(f"{WARNING}prefetching {name} sizes every slot: it needs {human(big)} where the other "
                   f"prefetched layers need at most {human(next_big)}, so {slots_take} "
                   f"{human(slots * (big - next_big))} more for its sake; place it on uva or keep it on the GPU")
    return out
