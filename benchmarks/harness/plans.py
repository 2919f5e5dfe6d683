"""The policies the benchmarks compare, their plans, the cost model's predictions for a plan, and the bytes a
prefill must move over the link (prefill.py's floor)."""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from planner.decide.build import build
from planner.decide.cost import CostModel
from planner.files import write_atomic
from planner.inputs.checkpoint import open_checkpoint
from planner.inputs.config import read_config
from planner.inputs.hardware import Hardware
from planner.inputs.policy import load_policy
from planner.layers.graph import build_graph
from planner.layers.groups import FusedGroups, expert_number
from planner.plan import LayerKind, Placement, Plan
from planner.planfile import dumps, load_plan

FRACTIONS = {0.25: (4, 1), 0.5: (2, 1), 0.75: (4, 3)}


def offloaded_layers(count: int, fraction: float) -> list[int]:
    g, n = FRACTIONS[fraction]
    return [i for i in range(count) if i % g >= g - n]


def policy_text(strategy: str, fraction: float, layers: list[int], hw: Path | None, budget_gib: float | None,
                graphs: bool = True) -> str:
    """A decode benchmark's policy. `graphs`: the mode a mixed plan decides for (its workload's `cuda_graphs`),
    which should be the mode the run measures: a placement decided for replayed steps may not be the fastest eager."""
    head = "format_version: 1\ncheckpoint: ckpt\n" + (f"hardware: {hw.name}\n" if hw else "")
    if strategy == "gpu":
        return head
    if strategy in ("uva", "uva-64b"):
        alternation = "|".join(map(str, layers))
        return head + f"rules:\n  - match: ['re:^model\\.layers\\.({alternation})\\.']\n    place: uva\n"
    if strategy == "prefetch":
        g, n = FRACTIONS[fraction]
        return head + f"prefetch: {{group_size: {g}, num_in_group: {n}, step: 2}}\n"
    if strategy in ("mixed", "mixed-experts-host"):  # the latter's budget: everything but the experts
        return head + (f"backend: mixed\nbudget_gib: {budget_gib!r}\nprefetch: {{step: 2}}\n"
                       f"workload: {{cuda_graphs: {str(graphs).lower()}}}\n")
    raise ValueError(strategy)


def make_plan(work: Path, name: str, text: str) -> Path:
    policy = work / f"{name}.policy.yaml"
    policy.write_text(text)
    out = work / f"{name}.plan.yaml"
    write_atomic(out, dumps(build(load_policy(policy), work)))
    return out


def experts_working_bytes(work: Path, head: str, workload: str = "") -> int:
    """The experts' working memory at its peak (planner/decide/working.py) with every routed expert on uva under
    `workload` (a `workload:` line, or none): what a budget that holds a share of the weights adds, since the
    plan's footprint counts it. `head`: the policy's format_version, checkpoint and hardware lines."""
    path = make_plan(work, "experts-working", f"{head}rules:\n  - {{match: [experts], place: uva}}\n{workload}")
    return load_plan(path).summary.working_peak_bytes


@functools.lru_cache(maxsize=None)
def plan_facts(plan_path: Path):
    """The plan, its checkpoint's layer graph, tensors, expert groups and top-k: read once per plan."""
    plan = load_plan(plan_path)
    ckpt = open_checkpoint(plan.checkpoint_dir(plan_path))
    graph = build_graph(list(ckpt.tensors), facts=read_config(ckpt.root))
    groups = FusedGroups.find(n for l in graph.stack_layers() for n in l.params)
    return plan, graph, ckpt.tensors, groups, read_config(ckpt.root).top_k


def predicted_us(plan_path: Path, hw: Hardware, batch: int, graphs: bool = False) -> int:
    """The plan's placement predicted at `batch`, eager or (`graphs`) replayed from a CUDA graph."""
    plan, graph, tensors, groups, top_k = plan_facts(plan_path)
    return CostModel(graph, tensors, hw, batch, groups, top_k, graphs=graphs).predict(plan.params).step_us


def predicted_prefill(work: Path, name: str, text: str, plan: Plan, tokens: list[int]) -> dict[int, float | None]:
    """T -> the planner's predicted prefill (ms) of `plan`'s placement at prompt_tokens T; None where the
    policy at T places differently (mixed weighs the prefill of T)."""
    out = {}
    for t in tokens:
        path = work / f"{name}-{t}.policy.yaml"
        path.write_text(text + f"workload: {{prompt_tokens: {t}}}\n")
        d = build(load_policy(path), work)
        out[t] = d.cost.prefill_us / 1e3 if d.params == plan.params else None
    return out


def link_bytes(plan: Plan, tensors: dict, touched: dict[str, set[int]], ids: torch.Tensor) -> int:
    """The offloaded bytes a prefill over `ids` must move: every prefetched and uva tensor, but a routed expert on
    uva or cpu only if `touched`, and of an embedding on uva the rows of the prompt's tokens (prefill.py's doc)."""
    embeddings = {n for l in build_graph(plan.params, plan.stacks).layers if l.kind is LayerKind.EMBED
                  for n in l.params}
    total = 0
    for name, place in plan.params.items():
        if place is Placement.GPU:
            continue
        if place is Placement.UVA and name in embeddings:  # a lookup: one row per distinct token
            info = tensors[name]
            total += info.nbytes // info.shape[0] * min(info.shape[0], ids.unique().numel())
            continue
        expert = expert_number(name)
        if place in (Placement.UVA, Placement.CPU) and expert is not None:  # cpu: streamed as uva ones above
            group = name[:name.index(".experts.") + len(".experts")]
            if expert not in touched.get(group, ()):
                continue
        total += tensors[name].nbytes
    return total
