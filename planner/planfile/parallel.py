"""The `parallel:` section against the rest of the plan (consistency.py asks it).

A tensor-parallel plan's bytes are one GPU's share (planner/layers/shards.py):
the consistency checks compare them with `local_tensors` of the checkpoint's
headers (`share`), and with them the layers must add up to that share. What
the names alone tell: every `split` template names tensors of `params:`, each
dim-1 (rowwise) tensor sits under a module that `reduce` sums, every `reduce`
module holds such a tensor, each module `gather` names holds a split tensor,
and `budgets` has one entry per GPU, the smallest `budget_bytes`.
"""
from __future__ import annotations

from collections.abc import Mapping

from ..inputs.checkpoint import TensorInfo
from ..layers.shards import local_tensors, template
from ..plan import Plan


def share(plan: Plan, tensors: Mapping[str, TensorInfo] | None) -> Mapping[str, TensorInfo] | None:
    """The checkpoint's headers as the plan's bytes count them: one GPU's share under tensor parallelism."""
    if plan.parallel is None or tensors is None:
        return tensors
    return local_tensors(tensors, plan.parallel.dims, plan.parallel.gpus)


def parallel_problems(plan: Plan, at, tensors: Mapping[str, TensorInfo] | None = None) -> list[str]:
    """The `parallel:` section's disagreements with `params:` and the layer table; `tensors`: `share`'s."""
    par = plan.parallel
    if par is None:
        return []
    problems = []
    layers = sum(l.gpu + l.uva + l.prefetch + l.cpu for l in plan.layers)
    if tensors is not None and layers != (local := sum(t.nbytes for t in tensors.values())):
        problems.append(f"{at('layers')}: add up to {layers} bytes, but one GPU's share of the checkpoint "
                        f"(parallel.split over {par.gpus} GPUs) is {local}")
    templates = {template(n) for n in plan.params}
    dims = par.dims
    for tpl, _ in par.split:
        if tpl not in templates:
            problems.append(f"{at('parallel', 'split', tpl)}: names no tensor of params:")
    rowwise = [t for t, d in dims.items() if d == 1]
    for t in rowwise:
        if not any(t.startswith(r + ".") for r in par.reduce):
            problems.append(f"{at('parallel', 'split', t)}: split along its input features (dim 1), but no "
                            "module of parallel.reduce holds it: its partial outputs would never be summed")
    for i, r in enumerate(par.reduce):
        if not any(t.startswith(r + ".") for t in rowwise):
            problems.append(f"{at('parallel', 'reduce', i)}: {r} holds no tensor split along dim 1")
    for i, g in enumerate(par.gather):
        if not any(t.startswith(g + ".") for t in dims):
            problems.append(f"{at('parallel', 'gather', i)}: {g} holds no split tensor")
    if par.budgets is not None and len(par.budgets) != par.gpus:
        problems.append(f"{at('parallel', 'budgets')}: lists {len(par.budgets)} budgets for {par.gpus} GPUs")
    if par.budgets and min(par.budgets) != plan.budget_bytes:
        problems.append(f"{at('parallel', 'budgets')}: the smallest is {min(par.budgets)} but budget_bytes is "
                        f"{plan.budget_bytes}: every GPU applies the same share, so the plan fits the smallest")
    return problems
