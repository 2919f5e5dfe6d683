"""The handle `load` and `apply` return: it owns what they allocated, and undoes it.

Lifecycle: created by `load`/`apply` (load_steps.py) -> use the model (`generate`) -> `remove()`.
It owns the pinned arena, the prefetch engine (slots, copy stream, hooks), the
prefill stager (its slots and staged module classes), the uva staging buffer and
the generators' static caches and captured decode steps (generation.py), and
the host's engine for experts on cpu (host/engine.py: its exchange buffers,
side stream and worker); nothing else in the runtime keeps GPU state.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from planner.inputs.checkpoint import Checkpoint
from planner.plan import Placement, Plan

from ..place import dequant
from ..place.arena import PinnedArena, typed
from ..place.layout import HostLayout
from ..place.names import Target
from ..place.quant import Quant
from . import experts
from .generation import Generating, Generator, capture_graph
from .host.engine import HostExperts
from .lookahead import Lookahead
from .prefetch import PrefetchEngine
from .prefill import PrefillStager
from .staging import UvaStaging

GPU, UVA, PREFETCH = Placement.GPU, Placement.UVA, Placement.PREFETCH


@dataclass(frozen=True)
class LoadStats:
    """What a load did, in bytes and seconds (`OffloadHandle.stats()`)."""

    device: str
    gpu_bytes: int  # resident tensors
    uva_bytes: int
    prefetch_bytes: int
    host_bytes: int  # the arena: offloaded tensors plus alignment
    pinned_host_bytes: int  # of it page-locked (cudaHostRegister; 0 without CUDA)
    gpu_buffer_bytes: int  # prefetch slots, prefill staging slots, the uva staging buffer, the experts lookahead buffer
    prefetch_copies: int  # layer copies issued so far
    prefetch_reprimes: int  # forwards that started over after one stopped part-way
    load_seconds: float
    peak_gpu_bytes_during_load: int  # above what was allocated before the load
    uva_in_place: bool  # False: `uva=False` on CUDA, tensors staged before their module runs
    prefill_staged_layers: int = 0  # layer forwards so far whose uva tensors were copied first (prefill.py)
    host_warning: str = ""  # the host computes experts on cpu much slower than the plan assumed (host/pace.py)

    @property
    def pinned_ratio(self) -> float | None:
        """Pinned host bytes per offloaded byte (1.0 is ideal; per-tensor `pin_memory` gives up to 2)."""
        offloaded = self.uva_bytes + self.prefetch_bytes
        return self.pinned_host_bytes / offloaded if offloaded and self.pinned_host_bytes else None

    @property
    def load_bytes_per_s(self) -> float | None:
        total = self.gpu_bytes + self.uva_bytes + self.prefetch_bytes
        return total / self.load_seconds if self.load_seconds else None


class OffloadHandle(Generating):
    """What `load`/`apply` did to a model, and what it holds. See the module doc for the lifecycle."""

    def __init__(self, model: torch.nn.Module, plan: Plan, checkpoint: Checkpoint, device: torch.device,
                 targets: list[Target], layout: HostLayout):
        self.model = model
        self.plan = plan
        self.checkpoint = checkpoint
        self.device = device
        self.cuda = device.type == "cuda"
        self.targets = targets
        self.layout = layout
        self.arena: PinnedArena | None = None
        self.engine: PrefetchEngine | None = None
        self.staging: UvaStaging | None = None
        self.prefill: PrefillStager | None = None
        self.assigned = False  # the model holds our tensors
        self.quantized: dict[torch.nn.Module, dict[str, Quant]] = {}  # tensors read dequantized (quant.py)
        self.quantized_names: set[str] = set()  # their stored tensors' model names
        self.bound_experts: list[torch.nn.Module] = []  # experts modules given resident rows (experts.py)
        self.lookahead: Lookahead | None = None  # their next experts read ahead at decode (lookahead.py)
        self.host_experts: HostExperts | None = None  # the plan's experts on cpu (host/engine.py)
        self.host_bound: list[tuple[torch.nn.Module, int]] = []  # the modules it computes experts of
        self.host_warning = ""  # the load found the host much slower than the plan assumed (host/pace.py)
        self.experts_before: str | None = None  # the experts implementation before offplan's (bind_experts.py)
        self.experts_set = False  # whether bind_experts.py set one
        self.generators: dict[tuple[bool, bool], Generator] = {}  # `generate`'s, by (eager, compile)
        self.parallel = None  # tensor parallelism: this process's place and collectives (distributed/collectives.py)
        self.shares = None  # tensor parallelism: this GPU's share of the checkpoint's headers
        self.load_seconds = 0.0
        self.start_alloc = 0
        self.peak_gpu_bytes = 0

    def stats(self) -> LoadStats:
        by = {p: 0 for p in Placement}
        for t in self.targets:
            on_gpu = t.nbytes // t.shape[0] * len(t.resident)  # experts of a split parameter kept in HBM
            by[t.placement] += t.nbytes - on_gpu
            by[GPU] += on_gpu
        return LoadStats(
            device=str(self.device), gpu_bytes=by[GPU], uva_bytes=by[UVA], prefetch_bytes=by[PREFETCH],
            host_bytes=self.arena.nbytes if self.arena is not None else 0,
            pinned_host_bytes=self.arena.pinned_bytes if self.arena is not None else 0,
            gpu_buffer_bytes=(self.engine.pool_bytes if self.engine else 0)
            + (self.staging.stage_bytes if self.staging else 0) + (self.prefill.pool_bytes if self.prefill else 0)
            + (self.lookahead.buffer_bytes if self.lookahead else 0),
            prefetch_copies=self.engine.copies if self.engine else 0,
            prefetch_reprimes=self.engine.reprimes if self.engine else 0,
            load_seconds=self.load_seconds, peak_gpu_bytes_during_load=self.peak_gpu_bytes,
            uva_in_place=self.staging is None,
            prefill_staged_layers=self.prefill.staged_forwards if self.prefill else 0,
            host_warning=self.host_warning)

    def synchronize(self) -> None:
        """Wait for prefetch copies and lookahead reads in flight (before and after capturing a CUDA graph;
        see `capture`)."""
        if self.engine is not None:
            self.engine.synchronize()
        if self.lookahead is not None:
            self.lookahead.synchronize()

    def join(self) -> None:
        """Make the current stream wait for prefetch copies and lookahead reads in flight: at the end of a
        captured forward, and after an eager forward that a graph replay follows."""
        if self.engine is not None:
            self.engine.join()
        if self.lookahead is not None:
            self.lookahead.join()

    def capture(self, step: Callable[[], object], warmup: int = 2) -> tuple[torch.cuda.CUDAGraph, object]:
        """Capture one call of `step` (a decode step over static inputs) in a CUDA graph.

        Warm-up calls run on a side stream first, as CUDA graphs require; the
        prefetch copies the step starts for the next one are joined into the
        capture. Returns (graph, what the captured call returned: its static
        outputs). Replays run the copies too; after an eager forward, call
        `join()` before replaying. Example, with a static KV cache:

            graph, logits = handle.capture(
                lambda: model(ids, past_key_values=cache, cache_position=pos).logits)
            ids.copy_(next_token); pos.fill_(n); graph.replay()   # logits now holds the step's output
        """
        return capture_graph(step, self.device, warmup, self.join, self.synchronize)

    def remove(self, restore: bool = True) -> None:
        """Remove hooks, streams, slots and pinned memory; the model is back to plain tensors.

        GPU-resident tensors stay where they are. Offloaded tensors become
        ordinary CPU tensors (`restore=True`) or are dropped to the meta device
        (`restore=False`, to free everything).
        """
        self.release(restore)

    def release(self, restore: bool, failed: bool = False) -> None:
        """Free everything the handle owns; `failed`: a load that stopped part-way gives back its GPU tensors too."""
        for generator in self.generators.values():
            generator.release()  # first: a captured graph holds the slots and buffers below
        self.generators = {}
        if self.parallel is not None:
            self.parallel.remove()
        if self.prefill is not None:
            self.prefill.remove()  # first: the parameters are plain again before anything is restored
            self.prefill = None
        if self.staging is not None:
            self.staging.remove()
            self.staging = None
        if self.lookahead is not None:
            self.lookahead.remove()
            self.lookahead = None
        for module, _ in self.host_bound:
            del module._offplan_host
        self.host_bound = []
        if self.host_experts is not None:
            self.host_experts.close()
            self.host_experts = None
        for module in self.bound_experts:
            experts.unbind(module)
        if self.experts_set:
            self.model.set_experts_implementation(self.experts_before)
            self.experts_set = False
        self.bound_experts = []
        if self.engine is not None:
            self.engine.remove()
            self.engine = None
        if self.quantized:
            self._unbind_quantized(restore, failed)
        if self.arena is not None and self.arena.alive:
            offloaded = [t for t in self.targets if (failed or t.placement in (UVA, PREFETCH))
                         and t.name not in self.quantized_names]
            if offloaded and self.assigned:
                state = {}
                for t in offloaded:
                    value = self._host_copy(t) if restore and t.placement is not GPU else \
                        torch.empty(t.shape, dtype=t.dtype, device="meta")
                    for alias in t.aliases:
                        state[alias] = value
                self.model.load_state_dict(state, assign=True, strict=False)
            self.arena.release()
        self.arena = None
        self.assigned = False

    def _unbind_quantized(self, restore: bool, failed: bool) -> None:
        """Each quantized tensor a plain one again, dequantized: on the GPU if it was resident, on the CPU
        (`restore`) or the meta device otherwise, and after a failed load on the meta device."""
        by_name = {t.name: t for t in self.targets}
        for path, module in self.model.named_modules():
            for q in list(self.quantized.get(module, {}).values()):
                data, scale = (by_name.get(f"{path}.{n}".lstrip(".")) for n in (q.data, q.scale))
                live = self.assigned and not failed and data is not None and scale is not None
                if live and data.placement is GPU:
                    value = dequant.dequantize(q, dequant.stored(module, q.data), dequant.stored(module, q.scale))
                elif live and restore and self.arena is not None and self.arena.alive:
                    value = dequant.dequantize(q, self._host_copy(data), self._host_copy(scale))
                else:
                    value = torch.empty(q.shape, dtype=q.dtype, device="meta")
                dequant.unbind(module, q, value)
        self.quantized = {}

    def _host_copy(self, t: Target) -> torch.Tensor:
        """A pageable CPU copy of an offloaded tensor, read back from the arena."""
        return typed(self.arena.host_view(self.layout.host_offset[t.name], t.nbytes), t.dtype, t.shape).clone()
