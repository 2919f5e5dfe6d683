"""offplan's runtime: apply a plan to a model, exactly.

    import runtime
    handle = runtime.load(model, "plans/x.plan.yaml")   # model built on the meta device
    handle = runtime.apply(model, "plans/x.plan.yaml")  # model already materialized
    handle.stats()                                      # a LoadStats
    handle.remove()

`runtime.hf.from_pretrained(plan)` builds the transformers model from the
checkpoint's config.json on the meta device and loads it per the plan.
`runtime.routing.record_routing(model, prompts, new_tokens, ...)` records a
routing profile (which experts the prompts route to) for `workload.routing`.
A tensor-parallel plan (`parallel:`) runs one process per GPU, each loading its
share: `runtime.run_ranks(fn, gpus, ...)` starts them (or torchrun does), and
`load` in each applies the plan to its share.
This package is the only part of offplan that imports torch. Its stages, each importing only those before it:
distributed/ (the processes of several GPUs and their collectives) -> place/ (tensors into their place) ->
execute/ (what runs while the model computes) -> measure/ (calibration, routing); load_steps.py carries out the
steps in order.
"""
from . import hf
from .distributed.launch import run_ranks
from .execute.handle import LoadStats, OffloadHandle
from .load_steps import apply, load
from .measure import routing

__all__ = ["LoadStats", "OffloadHandle", "apply", "hf", "load", "routing", "run_ranks"]
