"""`load` and `apply`: carry out a plan on a model, and the handle that undoes it.

The runtime never decides a placement: every tensor goes where the plan says,
or the call fails. Steps, in order:

1. read the plan and the checkpoint's headers; refuse a stale plan
   (`StalePlanError`, distinct from a plan that does not fit the model);
2. map checkpoint tensors to model tensors (`names.map_tensors`), listing in
   one error everything that does not match;
3. lay out the pinned arena (uva tensors, then prefetched layers in slot
   order) and the prefetch slots; check free GPU memory before allocating;
4. copy each tensor into place: from the checkpoint's mmap (`load`) or from
   the model's current tensors (`apply`);
5. assign the tensors into the model (`load_state_dict(assign=True)`) and
   start the prefetch engine.

On any failure everything allocated so far is released before re-raising.
"""
from __future__ import annotations

from pathlib import Path

import torch

from planner.checkpoint import Checkpoint, open_checkpoint
from planner.errors import OffplanError, PlanFileError
from planner.plan import Placement, Plan
from planner.planfile import load_plan
from planner.staleness import require_current

from .arena import PinnedArena, as_bytes, typed
from .loader import TORCH_DTYPES, Progress, ShardReader, Stager, check_holds_weights
from .layout import layout, plan_layer_of
from .names import Target, map_tensors
from .prefetch import OnDemandCopies, PrefetchEngine

GPU, UVA, PREFETCH = Placement.GPU, Placement.UVA, Placement.PREFETCH


def load(model: torch.nn.Module, plan: str | Path | Plan, *, checkpoint: str | Path | None = None,
         device: str | torch.device | None = None, uva: bool = True,
         progress: bool | None = None) -> "OffloadHandle":
    """Fill a model built on the meta device from the plan's checkpoint, each tensor straight into place.

    `device` defaults to cuda when available; without CUDA everything lives on
    the CPU and prefetch runs its schedule with synchronous copies. `uva=False`
    copies uva tensors to the GPU just before their module runs instead of
    reading them in place. `progress` forces the bar on or off (default: when
    stderr is a terminal). A `Plan` object needs `checkpoint=`.
    """
    return OffloadHandle(model, plan, checkpoint, device, uva, progress, from_checkpoint=True)


def apply(model: torch.nn.Module, plan: str | Path | Plan, *, checkpoint: str | Path | None = None,
          device: str | torch.device | None = None, uva: bool = True) -> "OffloadHandle":
    """Move the tensors of an already materialized model (CPU or GPU) to match the plan."""
    return OffloadHandle(model, plan, checkpoint, device, uva, False, from_checkpoint=False)


def _open(plan: str | Path | Plan, checkpoint) -> tuple[Plan, Checkpoint]:
    if isinstance(plan, Plan):
        if checkpoint is None:
            raise OffplanError("a Plan object carries no location: pass checkpoint=DIR")
        ckpt_dir = Path(checkpoint)
    else:
        path = Path(plan)
        plan = load_plan(path)
        ckpt_dir = Path(checkpoint) if checkpoint is not None else plan.checkpoint_dir(path)
    ckpt = open_checkpoint(ckpt_dir)
    if ckpt.fingerprint == plan.checkpoint_fingerprint and set(plan.params) != set(ckpt.tensors):
        odd = sorted(set(plan.params) ^ set(ckpt.tensors))
        raise PlanFileError("the plan's tensors differ from its checkpoint's although the fingerprints match "
                            "(edited by hand?); rebuild it with `plan build POLICY`", odd)
    require_current(plan, ckpt, ckpt_dir)
    return plan, ckpt


class OffloadHandle:
    """What `load`/`apply` did to a model. Lifecycle: created by load/apply -> use the model -> `remove()`."""

    def __init__(self, model, plan, checkpoint, device, uva, progress, *, from_checkpoint: bool):
        self.model = model
        self.plan, self.checkpoint = _open(plan, checkpoint)
        if from_checkpoint:
            check_holds_weights(self.checkpoint)
        self.device = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
        self.cuda = self.device.type == "cuda"
        # uva=False on CUDA: copy uva tensors to the GPU before their module runs. On the CPU, host
        # memory is read in place whatever `uva` says.
        self.copy_uva_on_demand = self.cuda and not uva
        self.arena: PinnedArena | None = None
        self.engine: PrefetchEngine | None = None
        self.ondemand: OnDemandCopies | None = None
        self.load_seconds = 0.0
        self.peak_gpu_bytes = 0
        self._assigned = False  # the model holds our tensors
        if self.cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.targets = map_tensors(model, {n: (self.checkpoint.tensors[n].shape, p)
                                           for n, p in self.plan.params.items()})
        try:
            with torch.no_grad():
                self._place(from_checkpoint, progress)
        except BaseException:
            # load(): the model was empty (meta) and goes back to empty, GPU tensors included;
            # apply(): the user's model keeps its values, offloaded ones copied back to the CPU.
            self._release(restore=not from_checkpoint, failed=from_checkpoint)
            raise

    # ------------------------------------------------------------ placing

    def _check_gpu_memory(self, resident: int, pool: int) -> None:
        if not self.cuda:
            return
        free, total = torch.cuda.mem_get_info(self.device)
        need = resident + pool
        if need > free:
            gib = 2**30
            raise OffplanError(
                f"the plan needs {need / gib:.2f} GiB of GPU memory ({resident / gib:.2f} GiB resident + "
                f"{pool / gib:.2f} GiB prefetch buffers) but only {free / gib:.2f} GiB of "
                f"{total / gib:.2f} GiB is free on {self.device}; rebuild the plan with budget_gib <= "
                f"{free / gib * 0.95:.1f}")

    def _place(self, from_checkpoint: bool, progress: bool | None) -> None:
        arena_bytes, offsets, layers, slot_bytes = layout(self.targets, self.plan, self.model)
        self._offsets = offsets  # arena offset per target, for remove(restore=True)
        resident = sum(t.nbytes for t in self.targets if t.placement is GPU)
        pool = slot_bytes * (self.plan.prefetch.slots if self.plan.prefetch else 0)
        self._check_gpu_memory(resident, pool)
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            start_alloc = torch.cuda.memory_allocated(self.device)
        self.arena = PinnedArena(arena_bytes, cuda=self.cuda, device=self.device)
        current = self.model.state_dict(keep_vars=True) if not from_checkpoint else None
        reader = ShardReader(self.checkpoint) if from_checkpoint else None
        stager = Stager(self.device) if self.cuda and from_checkpoint else None
        bar = Progress(sum(t.nbytes for t in self.targets), progress)
        placed: dict[str, torch.Tensor] = {}
        host_views: dict[int, torch.Tensor] = {}
        try:
            for t in self.targets:
                if t.placement is GPU:
                    dst = torch.empty(t.shape, dtype=t.dtype, device=self.device)
                    placed_tensor = dst
                else:
                    dst = typed(self.arena.host_view(offsets[id(t)], t.nbytes), t.dtype, t.shape)
                    host_views[id(t)] = dst
                    placed_tensor = None
                if from_checkpoint:
                    self._fill(t, dst, reader, stager)
                else:
                    dst.copy_(current[t.name].detach())
                bar.update(t.nbytes)
                if placed_tensor is None:
                    if t.placement is UVA and not self.copy_uva_on_demand:
                        placed_tensor = typed(self.arena.device_view(offsets[id(t)], t.nbytes), t.dtype, t.shape)
                    else:
                        placed_tensor = dst  # prefetch: replaced by the slot view below
                placed[t.name] = placed_tensor
            if stager is not None:
                stager.finish()
        finally:
            if reader is not None:
                reader.close()
        del current
        if layers:
            self.engine = PrefetchEngine(self.plan.prefetch, layers, slot_bytes, self.arena, self.device)
            self._bind_prefetch(placed, offsets, layers)
        state = {}
        for t in self.targets:
            for alias in t.aliases:
                state[alias] = placed[t.name]
        self.model.load_state_dict(state, assign=True, strict=True)
        self._assigned = True
        self._materialize_buffers()
        if self.copy_uva_on_demand:
            entries = []
            for t in self.targets:
                if t.placement is UVA:
                    for alias in t.aliases:
                        owner, _, attr = alias.rpartition(".")
                        entries.append((self.model.get_submodule(owner), attr, host_views[id(t)]))
            self.ondemand = OnDemandCopies(entries, self.device)
        if self.engine is not None and self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.engine.copy_stream)
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.peak_gpu_bytes = torch.cuda.max_memory_allocated(self.device) - start_alloc
        self.load_seconds = bar.close()

    def _bind_prefetch(self, placed, offsets, layers) -> None:
        layer_of = plan_layer_of(self.plan)
        for t in self.targets:
            if t.placement is not PREFETCH:
                continue
            layer = layers[layer_of(t.pieces[0].source)]
            arena_off = offsets[id(t)]
            for a, s, n in layer.runs:
                if a <= arena_off < a + n:
                    slot_off = s + (arena_off - a)
                    break
            else:  # pragma: no cover - the layout always covers its own tensors
                raise AssertionError(t.name)
            view = self.engine.slot_view(layer.name, slot_off, t.nbytes)
            placed[t.name] = typed(view, t.dtype, t.shape)

    def _fill(self, t: Target, dst: torch.Tensor, reader: ShardReader, stager: Stager | None) -> None:
        for piece in t.pieces:
            part = dst[piece.index] if piece.index else dst
            info = self.checkpoint.tensors[piece.source]
            same = TORCH_DTYPES.get(info.dtype, None) == t.dtype or (
                info.dtype not in TORCH_DTYPES and info.nbytes == part.numel() * part.element_size())
            if not same:
                part.copy_(reader.typed(piece.source))  # dtype conversion: rare, so the plain path
                continue
            src = reader.raw(piece.source)
            out = as_bytes(part)
            if out.device.type == "cuda":
                stager.copy(src, out)
            else:
                out.copy_(src)

    def _materialize_buffers(self) -> None:
        """Non-persistent buffers (rotary tables) are not in checkpoints: build them on the device."""
        pending = []
        for module in self.model.modules():
            for name, buf in list(module.named_buffers(recurse=False)):
                if buf is None:
                    continue
                if buf.is_meta:
                    module.register_buffer(name, torch.empty_like(buf, device=self.device), persistent=False)
                    pending.append(module)
                elif buf.device != self.device:
                    persistent = name in module.state_dict(keep_vars=True)
                    module.register_buffer(name, buf.to(self.device), persistent=persistent)
        init = getattr(self.model, "_init_weights", None)
        for module in dict.fromkeys(pending):
            if init is None or any(True for _ in module.parameters(recurse=False)):
                raise OffplanError(f"{type(module).__name__}: buffers left on the meta device and no way to "
                                   "compute them; build the model with its buffers materialized")
            init(module)  # transformers recomputes rotary tables and the like here

    # ------------------------------------------------------------ public

    def stats(self) -> dict:
        """Bytes per placement, pinned host bytes, GPU buffer bytes, load speed and peak GPU memory."""
        by = {p.value: 0 for p in Placement}
        for t in self.targets:
            by[t.placement.value] += t.nbytes
        offloaded = by["uva"] + by["prefetch"]
        pinned = self.arena.pinned_bytes if self.arena is not None else 0
        total = sum(by.values())
        return {
            "device": str(self.device),
            "gpu_bytes": by["gpu"], "uva_bytes": by["uva"], "prefetch_bytes": by["prefetch"],
            "pinned_host_bytes": pinned,
            "host_bytes": self.arena.nbytes if self.arena is not None else 0,
            "pinned_ratio": (pinned / offloaded) if offloaded and pinned else None,
            "gpu_buffer_bytes": self.engine.pool_bytes if self.engine else 0,
            "prefetch_copies": self.engine.copies if self.engine else 0,
            "prefetch_reprimes": self.engine.reprimes if self.engine else 0,
            "load_seconds": self.load_seconds,
            "load_gb_per_s": total / self.load_seconds / 1e9 if self.load_seconds else None,
            "peak_gpu_bytes_during_load": self.peak_gpu_bytes,
            "uva_in_place": not self.copy_uva_on_demand,
        }

    def synchronize(self) -> None:
        """Wait for prefetch copies in flight. Call it before capturing a CUDA graph and after.

        Example, a decode step in a CUDA graph (static KV cache, static input tensors):

            handle.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = model(static_ids, cache_position=static_pos, past_key_values=cache).logits
                handle.join()      # the last layers' copies for the next step, joined into the capture
            handle.synchronize()
            for ...:               # fill static_ids / static_pos, then
                graph.replay()
        """
        if self.engine is not None:
            self.engine.synchronize()

    def join(self) -> None:
        """Make the current stream wait for prefetch copies in flight: at the end of a captured
        forward, and after an eager forward that a graph replay follows."""
        if self.engine is not None:
            self.engine.join()

    def remove(self, restore: bool = True) -> None:
        """Remove hooks, streams, slots and pinned memory; the model is back to plain tensors.

        GPU-resident tensors stay where they are. Offloaded tensors become
        ordinary CPU tensors (`restore=True`) or are dropped to the meta device
        (`restore=False`, to free everything).
        """
        self._release(restore)

    def _release(self, restore: bool, failed: bool = False) -> None:
        if self.ondemand is not None:
            self.ondemand.remove()
            self.ondemand = None
        if self.engine is not None:
            self.engine.remove()
            self.engine = None
        if self.arena is not None and self.arena.alive:
            state = {}
            # On a failed load the model gives back every tensor the runtime put in, GPU ones too.
            offloaded = [t for t in self.targets if failed or t.placement in (UVA, PREFETCH)]
            if offloaded and self._assigned:
                host = self._host_copies(offloaded) if restore else {}
                for t in offloaded:
                    value = host.get(t.name)
                    if value is None:
                        value = torch.empty(t.shape, dtype=t.dtype, device="meta")
                    for alias in t.aliases:
                        state[alias] = value
                self.model.load_state_dict(state, assign=True, strict=False)
            self.arena.release()
        self.arena = None
        self._assigned = False

    def _host_copies(self, offloaded: list[Target]) -> dict[str, torch.Tensor]:
        """Pageable CPU copies of offloaded tensors, read back from the arena."""
        return {t.name: typed(self.arena.host_view(self._offsets[id(t)], t.nbytes), t.dtype, t.shape).clone()
                for t in offloaded}
