"""What placement says when it cannot do what a policy asks: the budget is too small, a backend has nothing
to offload, a rule or pattern splits fused experts, a `role: expert` rule names what holds no expert per row,
a rule prefetches a layer that does not run in every forward. Each message names the key to change, with the
exact values (see placement.py, steps 2, 6 and 9)."""
from __future__ import annotations

from collections.abc import Mapping

from ..errors import PolicyError
from ..inputs.policy import Policy
from ..inputs.checkpoint import TensorInfo
from ..inputs.quantized import host_computes
from ..layers.graph import LayerGraph
from ..layers.groups import FusedGroups, split_units
from ..plan import Backend, Placement, Runs
from ..units import GIB, human

GPU, PREFETCH, CPU = Placement.GPU, Placement.PREFETCH, Placement.CPU


def gib(n: float) -> str:
    """Bytes for a message: GiB to two places, or MiB/KiB/B below 1 GiB."""
    return human(int(n))


def smallest_budget_gib(nbytes: int) -> str:
    """The shortest decimal `budget_gib` whose bytes (`int(budget_gib * 2**30)`, as
    `Policy.budget_bytes` computes them) are exactly `nbytes`: the real minimum.

    >>> smallest_budget_gib(128 * 1024)   # 128 KiB
    '0.000122071'
    """
    for places in range(40):
        scale = 10**places
        units = -(-nbytes * scale // GIB)  # ceil(nbytes / GIB, `places` decimals)
        text = str(units) if places == 0 else f"{units // scale}.{units % scale:0{places}d}"
        if int(float(text) * GIB) == nbytes:
            return text
    return repr(nbytes / GIB)  # exact: a power-of-two division (not reached for sizes below 2**53)


def check_groups(groups: FusedGroups, won: list[set[str]], selected: dict, policy: Policy) -> None:
    """Rules and `params` patterns select experts whole, and prefetch whole groups (see groups.py):
    `won[i]` is what rule i places, `selected` what `uva.params` and `prefetch.params` select (selection.py:
    their layers' masks, where they show that no group is selected in part, spare looking at each group)."""
    problems = []
    for i, (rule, mine) in enumerate(zip(policy.rules, won)):
        if rule.place is not None:
            problems += split_units(groups, mine, f"rules[{i}] (place: {rule.place.value})", rule.place is PREFETCH)
    for key in ("uva", "prefetch"):
        if selected[key] is not None and not selected[key].splits_no_group(groups):
            problems += split_units(groups, selected[key], f"{key}.params", key == "prefetch")
    if problems:
        raise PolicyError(f"{policy.path}: the policy splits fused experts", problems)


def check_roles(groups: FusedGroups, as_experts: list[set[str]], policy: Policy) -> None:
    """`role: expert` rules select nothing whose rows are not experts: `as_experts[i]` is what rule i
    calls experts; a tensor of an experts module stored for every expert at once whose first dimension
    does not count them (prefused.py) cannot be costed by its experts' rows."""
    problems = []
    for i, mine in enumerate(as_experts):
        for n in sorted(mine & groups.not_experts.keys()):
            problems.append(f"rules[{i}] (role: expert) selects {n}, a tensor of an experts module that holds no "
                            f"expert per row: {groups.not_experts[n]}; so the cost model cannot tell which of it a "
                            "step reads and reads it whole: leave it out of the rule's match")
    if problems:
        raise PolicyError(f"{policy.path}: role: expert on tensors that are not stacked experts", problems)


def check_cpu(groups: FusedGroups, won: list[set[str]], policy: Policy, tensors: Mapping[str, TensorInfo],
              partner: Mapping[str, str]) -> None:
    """`place: cpu` holds routed experts only, each whole, that the host computes (quantized.py `host_computes`):
    the host CPU computes an expert's contribution to the tokens routed to it (its gate, up and down), which the
    GPU sums with the others'; any other tensor would have the CPU run a part of the model's every step, part of
    an expert the rest of it on the GPU's side, and a quantized one nothing (the runtime refuses such plans at
    load). One line per rule, naming up to three tensors."""
    problems = []
    on_cpu = set().union(*(mine for rule, mine in zip(policy.rules, won) if rule.place is CPU))
    for i, (rule, mine) in enumerate(zip(policy.rules, won)):
        if rule.place is not CPU:
            continue
        at = f"{policy.where(f'rules[{i}].match[0]')}: rules[{i}] (place: cpu)"
        wrong = sorted(n for n in mine if not groups.routed(n))
        if wrong:
            problems.append(f"{at} selects {_few(wrong)}, which "
                            f"{'is not a routed expert' if len(wrong) == 1 else 'are not routed experts'}: "
                            "cpu holds routed experts only (the CPU computes the tokens routed to them); narrow "
                            "the rule's match to the experts (e.g. `experts`)")
            continue
        stored = sorted(n for n in mine if not host_computes(n, tensors, partner))
        if stored:
            problems.append(f"{at} selects {_few(stored)}, quantized: the host computes bf16, fp16, "
                            "fp32 and block-scaled FP8 (E4M3) experts only (the runtime would refuse the plan); place "
                            "them on uva")
            continue
        left = sorted({m for n in mine for m in _expert(groups, n)} - on_cpu)
        if left:
            problems.append(f"{at} puts part of an expert on cpu, leaving out {_few(left)}: "
                            "the host computes an expert whole (its gate, up and down projections), so select all "
                            "of its tensors (e.g. `re:experts\\.0\\.` for expert 0, or `experts`)")
    if problems:
        raise PolicyError(f"{policy.path}: place: cpu on tensors that are not whole routed experts", problems)


def _expert(groups: FusedGroups, name: str) -> list[str]:
    """Every tensor of `name`'s expert in its experts module: of each fused parameter, the tensors of that
    expert; a tensor holding every expert (pre-fused): each such tensor of the module."""
    group = groups.group_of.get(name)
    if group is None:
        return [name]
    if name in groups.index_of:
        return list(groups.by_expert(group)[groups.index_of[name]])
    return [m for m in groups.members[group] if m in groups.rows_of]


def _few(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


_WHEN = {Runs.IMAGES: "runs only for prompts with images", Runs.MTP: "runs in no forward of plain decoding"}


def check_streamed_runs(graph: LayerGraph, won: list[set[str]], policy: Policy) -> None:
    """Rules prefetch only layers that run in every forward (placement.py step 6): the slots rotate in one
    order, which a forward that skips a layer breaks (a text prompt skips the vision tower). A layer that runs
    in no decode step belongs on uva: it costs a step nothing there, and prefill staging copies it ahead of use
    when it runs. (vLLM likewise streams only decoder layers: `make_layers` is its offloader's one call site.)
    One line per rule and layer."""
    problems = []
    for i, (rule, mine) in enumerate(zip(policy.rules, won)):
        if rule.place is not PREFETCH or not mine:
            continue
        for layer in graph.rarely_run():
            hit = [n for n in layer.params if n in mine]
            if hit:
                problems.append(f"{policy.where(f'rules[{i}].match[0]')}: rules[{i}] prefetches {hit[0]}, but "
                                f"{layer.name} {_WHEN[layer.runs]}; place it on uva (prefill staging copies it "
                                "ahead of use when it runs)")
    if problems:
        raise PolicyError(f"{policy.path}: prefetch streams layers in the order every forward runs them, and "
                          "these do not run in every forward", problems)


def layer_list(layers, limit: int = 6) -> str:
    names = [l.name for l in layers]
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def nothing_left(policy: Policy, key: str, layers, selected, head: str = "") -> str:
    """Why backend `key` finds no tensor to move in `layers`; the message names the key to change.

    `head` says how `layers` were picked (the group rule); without it they are the whole stacks.
    """
    names = [n for l in layers for n in l.params]
    where = "those layers" if head else "the layer stacks"
    if not names:
        why = "the checkpoint has no layer stacks (name them with `stacks:`)"
    elif selected is None:
        why = f"rules place every tensor of {where} (e.g. {names[0]}); change the rules"
    elif mine := [n for n in names if n in selected]:
        why = (f"{key}.params selects only tensors that rules already place (e.g. {mine[0]}); "
               f"change {key}.params or the rules")
    elif head:
        why = f"{key}.params selects none of their tensors (it selects e.g. {min(selected)}); change {key}.params"
    else:
        why = (f"{key}.params selects only tensors outside the layer stacks (e.g. {min(selected)}), which "
               f"the backend never moves; place those with a rule (`{{match: [...], place: {key}}}`)")
    return f"{policy.path}: backend {key} has nothing to offload: {head}{why}"


def over_budget(policy: Policy, backend: Backend, need: int, place, tensors, graph, stage_pool: int = 0,
                working: int = 0, won: list[set[str]] = ()) -> str:
    """The budget error: the smallest budget that fits, what is pinned (outside the stacks, and by rules: `won`,
    each rule's tensors), the key to change; `stage_pool` (the prefill staging buffers) and `working` (the experts'
    working memory), both part of `need`, are named with the keys that lower them."""
    pinned: dict[str, int] = {}
    stack_names = {l.name for l in graph.stack_layers()}
    for l in graph.layers:
        b = sum(tensors[n].nbytes for n in l.params if place[n] is GPU and l.name not in stack_names)
        if b:
            pinned[l.name] = b
    top = sorted(pinned.items(), key=lambda kv: -kv[1])[:5]
    pinned_text = ", ".join(f"{n} {gib(b)}" for n, b in top) or "nothing"
    each = f" on each of its {policy.gpus} GPUs (one GPU's share)" if policy.gpus > 1 else ""
    head = (f"{policy.path}: the plan needs {gib(need)} ({need:,} bytes) of GPU memory{each} but budget_gib "
            f"{policy.budget_gib} is {policy.budget_bytes:,} bytes; the smallest budget that fits this policy "
            f"is budget_gib: {smallest_budget_gib(need)} ({gib(need)}).")
    if backend is Backend.UVA and policy.uva.offload_gib > 0:
        fix = (f"uva.offload_gib: {policy.uva.offload_gib} offloads too little: raise it, or remove it "
               "and let budget_gib decide how much to offload.")
    elif backend is Backend.PREFETCH and policy.prefetch.group_size > 0:
        fix = (f"prefetch.group_size {policy.prefetch.group_size} / num_in_group "
               f"{policy.prefetch.num_in_group} offloads too few layers: raise num_in_group, or remove "
               "group_size and let budget_gib decide.")
    elif any(rule.place is GPU and mine for rule, mine in zip(policy.rules, won)):
        fix = ("No choice of offloaded layers fits beside what the rules pin: narrow the place: gpu rules, move "
               "more to host memory with a rule, or raise budget_gib.")
    else:
        example = top[0][0].rsplit(".", 1)[-1] if top else "embed_tokens"
        fix = ("No choice of offloaded layers fits. Move more to host memory with a rule "
               f"(for example `rules: [{{match: [{example}], place: uva}}]`), or raise budget_gib.")
    staging = (f"\n  {gib(stage_pool)} of it are the prefill staging buffers: `uva: {{stage_prefill: false}}` "
               "drops them (uva tensors are then read in place at prefill too, slower past a few hundred "
               "tokens)." if stage_pool else "")
    work = policy.workload
    running = (f"\n  {gib(working)} of it are the experts' working memory as the model runs (their touched rows at a "
               f"decode step of batch {work.batch_size} or a prefill of {work.batch_size} x {work.prompt_tokens} "
               "tokens): a smaller "
               "workload.batch_size or workload.prompt_tokens lowers it." if working else "")
    by_rules = [f"rules[{i}] {gib(b)}" for i, (rule, mine) in enumerate(zip(policy.rules, won)) if rule.place is GPU
                and (b := sum(tensors[n].nbytes for n in mine))]
    ruled = f"\n  Pinned to the GPU by rules (place: gpu): {', '.join(by_rules)}." if by_rules else ""
    return f"{head}\n  Pinned to the GPU outside the layer stacks: {pinned_text}.{ruled}\n  {fix}{staging}{running}"
