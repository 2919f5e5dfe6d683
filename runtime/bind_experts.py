"""Step 6 of load_steps.py for MoE experts: experts in pinned memory, quantized, or on cpu, bound to offplan's
experts implementation (execute/experts.py), with the lookahead over them (execute/lookahead.py) and the host's
engine for those on cpu (execute/host/).
"""
from __future__ import annotations

import torch

from planner.errors import ModelMismatchError
from planner.plan import Placement

from .execute import experts
from .execute.handle import OffloadHandle
from .execute.host import bind as host
from .execute.lookahead import LOOKAHEAD, Lookahead
from .place.arena import typed
from .place.names import Target

UVA = Placement.UVA


def bind_experts(h: OffloadHandle) -> None:
    """Experts in pinned memory, or quantized, run through offplan's experts implementation (experts.py):
    each such fused parameter's resident rows (the experts the plan keeps on the GPU) copied to HBM and
    bound to its module; quantized experts are dequantized only where touched, wherever they are."""
    pinned = [t for t in h.targets if t.placement is UVA and not h.staging and _experts_module(h.model, t) is not None]
    quantized = [m for m in h.quantized if experts.supports(m)]
    if not pinned and not quantized:
        _lean_grouped(h)
        return
    experts.register()
    by_module: dict[torch.nn.Module, dict[str, Target]] = {}
    for t in pinned:
        module = _experts_module(h.model, t)
        param = t.name.rpartition(".")[2]
        by_module.setdefault(module, {})[param] = t
        rows = torch.empty((len(t.resident), *t.shape[1:]), dtype=t.dtype, device=h.device)  # may be none
        if t.resident:
            index = torch.tensor(t.resident)
            rows.copy_(typed(h.arena.host_view(h.layout.host_offset[t.name], t.nbytes), t.dtype, t.shape)[index])
        slot = torch.full((t.shape[0],), -1, dtype=torch.int32)
        slot[list(t.resident)] = torch.arange(len(t.resident), dtype=torch.int32)
        experts.bind(module, param, rows, slot.to(h.device))
        if module not in h.bound_experts:
            h.bound_experts.append(module)
    h.bound_experts += [m for m in quantized if m not in h.bound_experts]
    h.experts_before = h.model.config._experts_implementation
    h.experts_set = True
    h.model.set_experts_implementation("offplan")
    host.bind(h, by_module)  # those with experts on cpu: their engine
    on_cpu = {m: h.host_experts.modules[i].on_cpu_device for m, i in h.host_bound}
    h.lookahead = lookahead(h.model, h.bound_experts, h.device, on_cpu)


def _lean_grouped(h: OffloadHandle) -> None:
    """A model whose experts all lie in HBM, run through transformers' `grouped_mm`: the same arithmetic less its
    masks for expert parallelism (experts.py `grouped_mm_forward`: bitwise its outputs, faster). Only with bf16
    experts: under torch.compile torch's grouped_mm takes nothing else, where transformers' falls back to its own
    kernel. Any other implementation the model was given is left as it is."""
    modules = [m for m in h.model.modules() if experts.supports(m)]
    if h.model.config._experts_implementation != "grouped_mm" or not modules or \
            any(m.down_proj.dtype != torch.bfloat16 for m in modules):
        return
    experts.register()
    h.experts_before, h.experts_set = "grouped_mm", True
    h.model.set_experts_implementation("offplan_grouped_mm")


def lookahead(model: torch.nn.Module, bound: list[torch.nn.Module], device: torch.device,
              on_cpu: dict[torch.nn.Module, torch.Tensor] | None = None,
              count: int = LOOKAHEAD) -> Lookahead | None:
    """The lookahead over the experts modules with experts in pinned memory (lookahead.py), in forward order;
    None where fewer than two have them. `on_cpu`: per module with experts on cpu, its [E] bool mask of them
    (on `device`): a guess leaves them out, as it leaves out those resident in HBM, since the link reads neither."""
    order = {m: (i, p) for i, (p, m) in enumerate(model.named_modules())}
    names = {order[m][1]: [n for n in experts.stored_params(m) if experts.slot_of(m, n) is not None] for m in bound}
    paths = sorted((p for p, n in names.items() if n), key=lambda p: order[model.get_submodule(p)][0])
    if len(paths) < 2 or not count:
        return None
    on_cpu = on_cpu or {}
    unread = {}  # path -> [E] bool: the experts its gathers do not read over the link
    for p in paths:
        module = model.get_submodule(p)
        mask = experts.slot_of(module, names[p][0]) >= 0
        if module in on_cpu:
            mask = mask | on_cpu[module]
        if bool(mask.any()):
            unread[p] = mask
    return Lookahead(model, paths, names, count, device, unread)


def _experts_module(model: torch.nn.Module, t: Target) -> torch.nn.Module | None:
    """The module of a fused expert parameter that takes offplan's experts implementation, else None.

    A parameter split between the GPU and pinned memory needs one: an error names the class that lacks it."""
    module = model.get_submodule(t.name.rpartition(".")[0])
    if experts.supports(module) and t.name.rpartition(".")[2] in experts.stored_params(module):
        return module
    if t.resident or t.on_cpu:
        where = "on the GPU" if t.resident else "on cpu (the host computes them)"
        raise ModelMismatchError(f"{t.name}: the plan puts experts {list(t.resident or t.on_cpu)[:4]}... of it {where} and "
                                 f"the rest in pinned memory, but {type(module).__name__} does not dispatch through "
                                 "transformers' experts interface (`use_experts_implementation`), which offplan "
                                 "needs to read them apart; place the whole group together (rebuild the plan with a "
                                 "rule for its experts)")
    return None

