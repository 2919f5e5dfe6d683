"""At load: the checks, the engine and the binding of a plan's experts on cpu (engine.py), for load_steps.py.

`check` runs before anything is allocated; `engine_for` before the arena is filled (the kernel compiles on a
thread meanwhile); `bind` once the experts modules are bound to offplan's experts implementation, and then the
host timed against the plan's figures (pace.py).
"""
from __future__ import annotations

import os
import warnings

import torch

from planner.errors import ModelMismatchError, OffplanError
from planner.inputs.hardware import H100
from planner.plan import Plan

from ...place import dequant
from ...place.arena import typed
from ...place.names import Target
from .. import experts
from . import native, pace
from .engine import HostExperts, HostSlot, gated_like
from .module import NATIVE_DTYPES


def check(plan: Plan, targets: list[Target], quantized: dict, uva: bool, device: torch.device,
          model: torch.nn.Module) -> None:
    """Refuse what the runtime cannot do with experts on cpu, before anything is allocated: a module that does not
    dispatch through transformers' experts interface, quantized experts there that the host does not compute
    (`_quantized_on_cpu`), `uva=False`, a plan without its cost section's thread count, or more host threads than
    this process may run on, or than the host has in all its processes (tensor parallelism: the plan gives each its
    share of the profile's). `quantized`: quant.py `map_stored`'s, by module."""
    on_cpu = [t.name for t in targets if t.on_cpu]
    if not on_cpu:
        return
    for name in on_cpu:
        path, _, param = name.rpartition(".")
        module = model.get_submodule(path)
        if not experts.supports(module) or param not in experts.stored_params(module, quantized.get(module, {})):
            raise OffplanError(f"{name}: the plan puts it on cpu, but {type(module).__name__} does not dispatch "
                               "through transformers' experts interface (`use_experts_implementation`), through "
                               "which the host computes experts; place it on uva (rebuild the plan)")
    threads = plan.cost.cpu_threads if plan.cost is not None else 0
    if threads < 1:
        raise OffplanError(f"the plan puts experts on cpu ({on_cpu[0]}) but names no host threads for them "
                           "(cost.cpu_threads): rebuild it with `plan build`")
    problems = _quantized_on_cpu([t for t in targets if t.on_cpu], quantized, model)
    if problems:
        raise OffplanError("the plan puts quantized experts on cpu that the host cannot compute:\n  - "
                           + "\n  - ".join(problems))
    if not uva and device.type == "cuda":
        raise OffplanError(f"uva=False copies each uva parameter to the GPU whole, but the plan computes experts "
                           f"of {on_cpu[0]} on the host CPU from pinned memory: load it with uva=True (the default)")
    cores = len(os.sched_getaffinity(0))
    if threads > cores:
        raise OffplanError(f"the plan computes experts on cpu with {threads} host threads (cost.cpu_threads), but "
                           f"this process may run on {cores} cores: rebuild it with a hardware profile measured "
                           f"at those (`plan calibrate --cpu-threads {cores}`), or run it where it has {threads}")
    gpus, host = plan.parallel.gpus if plan.parallel is not None else 1, os.cpu_count() or cores
    if threads * gpus > host:  # every process of a tensor-parallel plan runs on this one host (each may be bound
        # to its own cores: each checked its own above)
        raise OffplanError(f"the plan computes experts on cpu with {threads} host threads (cost.cpu_threads) in "
                           f"each of its {gpus} processes, {threads * gpus} in all, but this host has {host} cores: "
                           + (f"rebuild it with a hardware profile measured at `plan calibrate --cpu-threads "
                              f"{host}`" if host >= gpus else
                              "place the experts on uva (rebuild the plan)"))


def _quantized_on_cpu(on_cpu: list[Target], quantized: dict, model: torch.nn.Module) -> list[str]:
    """One line per quantized tensor on cpu that the host cannot compute (module.py): MXFP4, and FP8 but where
    native.cpp does (E4M3, gated experts with every projection FP8, computed in bf16, native.cpp built)."""
    problems, uva = [], "place them on uva (rebuild the plan)"
    for t in on_cpu:
        path, _, param = t.name.rpartition(".")
        module = model.get_submodule(path)
        q = next((q for q in quantized.get(module, {}).values() if param == q.data), None)
        if q is None:
            continue
        if q.format != "fp8":
            problems.append(f"{t.name}: {q.format.upper()} experts: the host kernel computes bf16 and block-scaled "
                            f"FP8 experts only; {uva}")
        elif (t.dtype != torch.float8_e4m3fn or q.dtype != torch.bfloat16 or not gated_like(module)
              or not set(experts.fused_params(module)) <= set(quantized[module])):
            problems.append(f"{t.name}: FP8 experts stored {t.dtype}, read as {q.dtype}, of {type(module).__name__}"
                            ": the host kernel computes FP8 E4M3 experts in bf16, gated as silu(gate) * up, every "
                            f"projection FP8, only; {uva}")
        elif native.library() is None:
            problems.append(f"{t.name}: FP8 experts, which only the host's native kernel (native.cpp) computes, and "
                            f"{native.why_not or 'this process has none'}; {uva}, or build the host kernel "
                            "(`pip install -e .`, with a C++ compiler)")
    return problems


def engine_for(plan: Plan, targets: list[Target], model: torch.nn.Module, device: torch.device):
    """The engine for the plan's experts on cpu, its kernel compiling on a thread while the load fills the
    arena (for the gated experts that native.cpp does not compute); None when the plan puts none there."""
    on_cpu = [t for t in targets if t.on_cpu]
    if not on_cpu:
        return None
    above = plan.prefill.above_tokens if plan.prefill is not None else H100.stage_above_tokens
    engine = HostExperts(device, plan.cost.cpu_threads, above)
    top_k = getattr(model.config.get_text_config(), "num_experts_per_tok", None)
    native = engine.lib is not None  # native.cpp computes gated bf16 and FP8 experts: nothing to compile for them
    shapes = {}
    for t in on_cpu:  # the compiled kernel's shapes: uninitialized tensors, whose pages are mapped when touched
        module = model.get_submodule(t.name.rpartition(".")[0])
        if gated_like(module) and t.name.endswith(".gate_up_proj") and not (native and t.dtype in NATIVE_DTYPES):
            down = next(d for d in targets if d.name == t.name.rpartition(".")[0] + ".down_proj")
            shapes[t.shape, down.shape, t.dtype] = top_k or module.num_experts
    engine.kernel.start([(torch.empty(gate_up, dtype=dtype), torch.empty(down, dtype=dtype), k)
                         for (gate_up, down, dtype), k in shapes.items()])
    return engine


def bind(handle, modules: dict[torch.nn.Module, dict[str, Target]]) -> None:
    """Each experts module with experts on cpu (`modules`: its stored parameters' targets by name) given to the
    handle's engine with its fused parameters' host tensors (the arena's CPU views); every fused parameter of it
    must put the same experts there. Then the engine's buffers and worker, the compiled kernel awaited, and the
    host's pace probed: a `HostSlowerWarning` (and `handle.host_warning`) where it is much slower than the plan
    assumed (pace.py)."""
    engine = handle.host_experts
    if engine is None:
        return
    top_k = getattr(handle.model.config.get_text_config(), "num_experts_per_tok", None)

    def host(t: Target) -> torch.Tensor:  # the arena's CPU view of a target
        return typed(handle.arena.host_view(handle.layout.host_offset[t.name], t.nbytes), t.dtype, t.shape)
    for module, params in modules.items():
        wanted = experts.fused_params(module)
        on_cpu = {params[p].on_cpu if p in params else () for p in wanted}
        if on_cpu == {()}:
            continue
        if len(on_cpu) > 1:
            name = next(iter(params.values())).name.rpartition(".")[0]
            raise ModelMismatchError(f"{name}: its fused parameters put different experts on cpu, but the host "
                                     "computes an expert whole; rebuild the plan (the planner keeps an expert's "
                                     "tensors together)")
        weights = {p: host(params[p]) for p in wanted}
        quants = dequant.quantized(module)  # FP8: each fused parameter's scales too, in pinned memory beside it
        fp8 = ({p: host(params[quants[p].scale]) for p in wanted}, quants[wanted[0]].block,
               quants[wanted[0]].dtype) if quants else None
        index = engine.add(module, weights, list(on_cpu.pop()), top_k or module.num_experts, fp8)
        module._offplan_host = HostSlot(engine, engine.key, index)
        handle.host_bound.append((module, index))
    engine.finish()
    engine.ready()
    cost = handle.plan.cost
    got = pace.probe(engine, cost.cpu_expert_gbps, cost.cpu_expert_sync_us)
    if got is not None and got.slower > pace.SLOWER:
        handle.host_warning = got.message()
        warnings.warn(f"offplan: {handle.host_warning}", pace.HostSlowerWarning, stacklevel=2)
