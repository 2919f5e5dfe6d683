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

from collections.abc import Callable, Mapping

from ..errors import PolicyError
from ..inputs.checkpoint import TensorInfo
from ..inputs.quantized import apart
from ..inputs.yamlio import dotted
from ..layers.graph import Layer, LayerGraph, build_graph
from ..layers.expert_map import experts_map
from ..layers.groups import FusedGroups
from ..plan import Placement, Plan
from .parallel import parallel_problems, share
from .sections import prefetch_problems, prefill_problems

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
    problems += prefetch_problems(plan, graph, at, tensors) + prefill_problems(plan, graph, at, tensors)
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
        split = experts_map(layer, plan.params.__getitem__)
        if split != row.experts:
            problems.append(f"{at('layers', i)}: {row.name} says experts: {_split(row.experts)}, but params: place "
                            f"them {_split(split)}")
        of = _by_kind(layer.params, plan.params)
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


def _split(experts: str | None) -> str:
    """A layer row's `experts` (expert_map.py), as a message quotes it."""
    return "no split expert group" if experts is None else repr(experts)


def _by_kind(names: tuple[str, ...], params: Mapping[str, Placement]) -> dict[str, list[str]]:
    """`names` by their placements' values (KINDS), in one pass: a layer of Kimi-K2 holds 2,322 tensors."""
    of: dict[str, list[str]] = {k: [] for k in KINDS}
    add = {Placement(k): of[k].append for k in KINDS}
    for n in names:
        add[params[n]](n)
    return of


def _bytes(by: Mapping[str, int]) -> str:
    return ", ".join(f"{k} {by[k]:,}" for k in KINDS if k != "cpu" or by[k])  # cpu: only where there is some


def _groups(plan: Plan, at, graph: LayerGraph, tensors) -> list[str]:
    """Fused experts (groups.py): one placement per expert of a fused parameter, a group prefetched whole (its
    parameters are views of one slot) or not at all, and only experts on cpu; a group placed alike is fine."""
    groups = FusedGroups.of_layers(graph.layers, tensors) if tensors is not None else FusedGroups.find(plan.params)
    problems = [f"{at('params', n)}: cpu holds routed experts only, and {n} is none" for n, p in plan.params.items()
                if p is Placement.CPU and n not in groups.group_of] if plan.summary.cpu_bytes else []
    for group, members in groups.members.items():
        places = set(map(plan.params.__getitem__, members))
        if len(places) == 1:
            continue
        if Placement.PREFETCH in places:
            kinds: dict[Placement, list[str]] = {}
            for m in members:
                kinds.setdefault(plan.params[m], []).append(m)
            minority = min(kinds.values(), key=len)
            counts = ", ".join(f"{len(v)} {k.value}" for k, v in kinds.items())
            problems.append(f"{at('params', minority[0])}: {plan.params[minority[0]].value}, but fused group "
                            f"{group} is prefetched, so all of it must be (its parameters are views of one "
                            f"slot): {counts}")
            continue
        split = {unit[0]: unit for unit in groups.units(group, per_expert=True)
                 if len(set(map(plan.params.__getitem__, unit))) > 1}
        for m in filter(split.__contains__, members):  # in the members' order
            odd = next(n for n in split[m] if plan.params[n] is not plan.params[m])
            problems.append(f"{at('params', odd)}: {plan.params[odd].value}, but {m} is "
                            f"{plan.params[m].value}: they are one row of a fused parameter at run time")
    return problems
