"""Tensor parallelism at run time: the collectives that join the GPUs' shares (planner/layers/shards.py).

Each process holds its share of the model (runtime/place/shards.py) and runs
the same forward on the same tokens. Where a module reads input features that
are split (attention's o projection, the MLP's down projection, an experts
module: the plan's `parallel.reduce`), its output on each GPU is a partial
sum: a forward hook sums it over the GPUs in place (`all_reduce`), so every
GPU continues with the full activations, as transformers' rowwise and MoE
experts styles do. The head's output is each GPU's share of the vocabulary: a
hook concatenates the shares (`all_gather`, the plan's `parallel.gather`), as
transformers' `colwise_gather_output` does, so every GPU picks the same token.

The collectives are torch.distributed's, on its default process group: NCCL
between GPUs, gloo on the CPU. NCCL collectives are captured in a CUDA graph
like kernels (measured: 9.7 us for an all-reduce of one token's activations
in a replayed graph on two NVLinked GPUs, 60-70 us launched eagerly), so a
decode step of a tensor-parallel model replays as a one-GPU step does.
Every process must run the same forwards in the same order.

Lifecycle: made by `load` (load_steps.py), told its `modules` -> `install` once the
model holds its tensors -> the model runs -> `remove()` (the handle's `remove`).
"""
from __future__ import annotations

import torch

from planner.errors import OffplanError, StalePlanError
from planner.plan import Parallel


def world() -> tuple[int, int] | None:
    """(this process's rank, the world size) when torch.distributed is initialized, else None."""
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist.get_rank(), dist.get_world_size()


class TensorParallel:
    """This process's place among the plan's GPUs, and the hooks of its collectives (module doc)."""

    def __init__(self, par: Parallel):
        got = world()
        if got is None:
            raise OffplanError(f"a tensor-parallel plan (parallel.gpus: {par.gpus}) runs one process per GPU under "
                               "torch.distributed, which this process has not initialized: run `plan apply PLAN` "
                               f"(it starts the {par.gpus} processes), or `torchrun --nproc-per-node {par.gpus}` "
                               "with your script calling torch.distributed.init_process_group first")
        self.rank, size = got
        if size != par.gpus:
            raise StalePlanError(f"the plan was built for {par.gpus} GPUs (parallel.gpus: {par.gpus}) but "
                                 f"torch.distributed's world size is {size}: run {par.gpus} processes, or rebuild "
                                 f"the plan with `gpus: {size}` in its policy")
        self.gpus = par.gpus
        self.handles: list = []
        self.reduced: list[str] = []  # the model's modules whose outputs the GPUs sum
        self.gathered: list[str] = []  # and concatenate

    def modules(self, reduce: list[str], gather: list[str]) -> None:
        self.reduced, self.gathered = list(reduce), list(gather)

    def install(self, model: torch.nn.Module) -> None:
        """Sum the outputs of the `reduced` modules over the GPUs, and concatenate those of the `gathered`."""
        for path in self.reduced:
            self.handles.append(model.get_submodule(path).register_forward_hook(self._sum))
        for path in self.gathered:
            self.handles.append(model.get_submodule(path).register_forward_hook(self._gather))

    @staticmethod
    def _sum(module, args, output):
        import torch.distributed as dist
        dist.all_reduce(output[0] if isinstance(output, tuple) else output)
        return output

    def _gather(self, module, args, output: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        output = output.contiguous()
        parts = [torch.empty_like(output) for _ in range(self.gpus)]
        dist.all_gather(parts, output)
        return torch.cat(parts, dim=-1)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
