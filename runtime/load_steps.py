"""`load` and `apply`: carry out a plan on a model, step by step.

The runtime never decides a placement: every tensor goes where the plan says,
or the call fails. The steps:

1. open: the plan (parsed once) and its checkpoint's headers; refuse a stale
   plan (planner/planfile/staleness.py), and a header-only checkpoint when loading;
2. map names: checkpoint tensors to model tensors (checkpoint_names.py), one
   error listing everything that does not match; for a quantized checkpoint
   the meta model first made to hold FP8/MXFP4 tensors as stored (quant.py);
   under tensor parallelism the meta model cut to this process's share (place/shards.py);
   a plan with experts on cpu checked (execute/host/bind.py), and their kernel
   compiling on a thread from step 4 on;
3. lay out: the arena and slot offsets, read from the plan (layout.py);
4. allocate: check free GPU memory, then the pinned arena, resident tensors
   and the prefetch slots;
5. fill: each tensor straight into place, from the checkpoint's mmap (`load`)
   or from the model's current tensors (`apply`);
6. bind: views of the slots (prefetch) and of the arena (uva) or the staging
   buffer (`uva=False`), assigned into the model (`load_state_dict(assign=True)`)
   once the buffers no checkpoint holds are computed (buffers.py), hooks
   registered; quantized tensors read dequantized (dequant.py); experts in
   pinned memory, quantized, or on cpu, read through offplan's experts implementation
   (bind_experts.py, experts.py), with the resident rows of a split fused parameter copied to
   HBM and the host's engine for those on cpu; the plan's prefill staging set up (prefill.py: uva layers copied to the
   GPU before a forward over many tokens); the collectives of tensor parallelism.

From step 4 on an `OffloadHandle` owns what was allocated; on any failure it
releases all of it before the error propagates.
"""
from __future__ import annotations

from pathlib import Path

import torch

from planner.errors import OffplanError, PlanFileError
from planner.inputs.checkpoint import Checkpoint, open_checkpoint
from planner.layers.groups import FusedGroups
from planner.plan import Placement, Plan, Runs
from planner.planfile import load_plan
from planner.planfile.staleness import require_current

from .bind_experts import bind_experts
from .execute.handle import OffloadHandle
from .execute.host import bind as host
from .execute.prefetch import PrefetchEngine
from .execute.prefill import PrefillStager
from .execute.staging import UvaStaging
from .place import dequant, quant
from .place.arena import PinnedArena, as_bytes, typed
from .place.buffers import materialize_buffers
from .place.layout import check_gpu_memory, lay_out
from .place.loader import TORCH_DTYPES, Progress, ShardReader, Stager, check_holds_weights
from .place.names import Target, map_tensors
from .place.shards import SlicingReader, share

GPU, UVA, PREFETCH = Placement.GPU, Placement.UVA, Placement.PREFETCH


def load(model: torch.nn.Module, plan: str | Path | Plan, *, checkpoint: str | Path | Checkpoint | None = None,
         device: str | torch.device | None = None, uva: bool = True, progress: bool | None = None) -> OffloadHandle:
    """Fill a model built on the meta device from the plan's checkpoint, each tensor straight into place.

    `device` defaults to cuda when available; without CUDA everything lives on
    the CPU and prefetch runs its schedule with synchronous copies. `uva=False`
    copies uva tensors to the GPU just before their module runs (staging.py)
    instead of reading them in place. `progress` forces the bar on or off
    (default: on a terminal). A `Plan` object needs `checkpoint=`: a directory,
    or the `Checkpoint` whose headers were already read (then it is not read again).
    """
    plan, ckpt = open_plan(plan, checkpoint)
    check_holds_weights(ckpt)
    return _run(model, plan, ckpt, device, uva, progress, from_checkpoint=True)


def apply(model: torch.nn.Module, plan: str | Path | Plan, *, checkpoint: str | Path | Checkpoint | None = None,
          device: str | torch.device | None = None, uva: bool = True) -> OffloadHandle:
    """Move the tensors of an already materialized model (CPU or GPU) to match the plan."""
    plan, ckpt = open_plan(plan, checkpoint)
    return _run(model, plan, ckpt, device, uva, False, from_checkpoint=False)


def open_plan(plan: str | Path | Plan, checkpoint: str | Path | Checkpoint | None) -> tuple[Plan, Checkpoint]:
    """Step 1: the plan and its checkpoint's headers; a stale plan is refused."""
    if isinstance(plan, Plan):
        if checkpoint is None:
            raise OffplanError("a Plan object carries no location: pass checkpoint=DIR")
    else:
        path = Path(plan)
        plan = load_plan(path)
        checkpoint = checkpoint if checkpoint is not None else plan.checkpoint_dir(path)
    if isinstance(checkpoint, Checkpoint):
        ckpt, ckpt_dir = checkpoint, checkpoint.root
    else:
        ckpt_dir = Path(checkpoint)
        ckpt = open_checkpoint(ckpt_dir)
    if ckpt.fingerprint == plan.checkpoint_fingerprint and set(plan.params) != set(ckpt.tensors):
        odd = sorted(set(plan.params) ^ set(ckpt.tensors))
        raise PlanFileError("the plan's tensors differ from its checkpoint's although the fingerprints match "
                            "(edited by hand?); rebuild it with `plan build POLICY`", odd)
    require_current(plan, ckpt, ckpt_dir)
    return plan, ckpt


def _run(model, plan: Plan, ckpt: Checkpoint, device, uva: bool, progress, *, from_checkpoint: bool) -> OffloadHandle:
    device = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    formats, scales = quant.scan(ckpt)
    if formats and not from_checkpoint:
        raise OffplanError(f"{ckpt.root}: the checkpoint is quantized ({len(formats)} FP8/MXFP4 tensors) and "
                           "apply() cannot quantize a materialized model again: build the model on the meta "
                           "device and use load()")
    if formats and not uva and device.type == "cuda":
        raise OffplanError("uva=False is not supported for quantized checkpoints: a quantized uva tensor is "
                           "read once per access by its dequantization, so there is nothing to stage; load it "
                           "with uva=True (the default)")
    tp = local = None
    if plan.parallel is not None:  # one process per GPU, each applying the plan to its share (place/shards.py)
        tp, local, targets, quantized = share(model, plan, ckpt, (formats, scales), from_checkpoint)
    elif formats:  # step 2; the meta model made to hold the quantized tensors as stored (quant.py)
        targets, quantized = quant.map_stored(model, ckpt, plan.params, formats, scales)
    else:
        targets, quantized = map_tensors(model, {n: (ckpt.tensors[n].shape, p) for n, p in plan.params.items()}), {}
    try:
        host.check(plan, targets, quantized, uva, device, model)
        split = [t.name for t in targets if t.resident]
        if split and not uva and device.type == "cuda":
            more = f" (and {len(split) - 1} more)" if len(split) > 1 else ""
            raise OffplanError(f"uva=False copies each uva parameter to the GPU whole before its module runs, but "
                               f"the plan keeps some experts of {split[0]}{more} on the GPU and reads the rest in "
                               "place: load it with uva=True (the default)")
        layout = lay_out(targets, plan, model)  # step 3
    except BaseException:
        quant.unprepare(quantized)
        raise
    handle = OffloadHandle(model, plan, ckpt, device, targets, layout)
    handle.parallel, handle.shares = tp, local
    handle.quantized = quantized
    handle.quantized_names = {f"{path}.{name}".lstrip(".") for path, m in model.named_modules() if m in quantized
                              for q in quantized[m].values() for name in (q.data, q.scale)}
    try:
        handle.host_experts = host.engine_for(plan, targets, model, device)  # compiling its kernel meanwhile
        with torch.no_grad():
            placed = _allocate_and_fill(handle, from_checkpoint, progress)  # steps 4 and 5
            _bind(handle, placed, staged=handle.cuda and not uva)  # step 6
    except BaseException:
        # load(): the model was empty (meta) and goes back to empty, GPU tensors included;
        # apply(): the user's model keeps its values, offloaded ones copied back to the CPU.
        handle.release(restore=not from_checkpoint, failed=from_checkpoint)
        raise
    return handle


def _allocate_and_fill(h: OffloadHandle, from_checkpoint: bool, progress) -> dict[str, torch.Tensor]:
    """Steps 4 and 5: the arena and resident tensors, filled; returns each target's tensor by name."""
    if h.cuda:
        resident = sum(t.nbytes for t in h.targets if t.placement is GPU) + sum(
            t.nbytes // t.shape[0] * len(t.resident) for t in h.targets if t.resident)
        pools = (h.plan.prefetch.pool_bytes if h.plan.prefetch else 0) + (
            h.plan.prefill.pool_bytes if h.plan.prefill else 0) + h.plan.summary.working_peak_bytes
        check_gpu_memory(h.device, resident, pools)
        torch.cuda.synchronize(h.device)
        torch.cuda.reset_peak_memory_stats(h.device)
        h.start_alloc = torch.cuda.memory_allocated(h.device)
    h.arena = PinnedArena(h.layout.arena_bytes, cuda=h.cuda, device=h.device)
    current = h.model.state_dict(keep_vars=True) if not from_checkpoint else None
    reader = None if not from_checkpoint else ShardReader(h.checkpoint) if h.parallel is None else \
        SlicingReader(h.checkpoint, h.plan.parallel.dims, h.parallel.rank, h.parallel.gpus)
    tensors = h.shares or h.checkpoint.tensors
    stager = Stager(h.device) if h.cuda and from_checkpoint else None
    bar = Progress(sum(t.nbytes for t in h.targets), progress)
    placed: dict[str, torch.Tensor] = {}
    try:
        for t in h.targets:
            if t.placement is GPU:
                dst = torch.empty(t.shape, dtype=t.dtype, device=h.device)
            else:
                dst = typed(h.arena.host_view(h.layout.host_offset[t.name], t.nbytes), t.dtype, t.shape)
            if from_checkpoint:
                _fill(tensors, t, dst, reader, stager)
            else:
                dst.copy_(current[t.name].detach())
            bar.update(t.nbytes)
            placed[t.name] = dst
        if stager is not None:
            stager.finish()
    finally:
        if reader is not None:
            reader.close()
    h.load_seconds = bar.close()
    return placed


def _fill(tensors, t: Target, dst: torch.Tensor, reader: ShardReader, stager: Stager | None) -> None:
    """`t`'s pieces from the checkpoint into `dst`; `tensors`: the headers (one GPU's share of them under tensor
    parallelism, which `reader` then reads)."""
    for piece in t.pieces:
        part = dst[piece.index] if piece.index else dst
        info = tensors[piece.source]
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


def _bind(h: OffloadHandle, placed: dict[str, torch.Tensor], staged: bool) -> None:
    """Step 6: the tensors the model runs with (slot, arena or staging views), assigned; hooks registered."""
    if h.plan.prefetch is not None:
        h.engine = PrefetchEngine(h.plan.prefetch, h.layout.layers, h.arena, h.device)
        for t in h.targets:
            if t.placement is PREFETCH:
                view = h.engine.slot_view(h.layout.streamed_in[t.name], h.layout.slot_offset[t.name], t.nbytes)
                placed[t.name] = typed(view, t.dtype, t.shape)
    uva = [t for t in h.targets if t.placement is UVA]
    if staged and uva:
        h.staging = UvaStaging(uva, h.layout.host_offset, h.arena, h.model, h.device)
        placed.update(h.staging.views)
    else:
        for t in uva:
            placed[t.name] = typed(h.arena.device_view(h.layout.host_offset[t.name], t.nbytes), t.dtype, t.shape)
    state = {alias: placed[t.name] for t in h.targets for alias in t.aliases}
    materialize_buffers(h.model, h.device)  # before the assignment: init writes only to meta parameters
    h.model.load_state_dict(state, assign=True, strict=True)
    h.assigned = True
    if h.parallel is not None:
        h.parallel.install(h.model)
    dequant.bind(h.quantized)
    bind_experts(h)
    if h.plan.prefill is not None and h.staging is None:
        # quantized tensors are read once per access by their dequantization: never staged
        quantized = {p.source for t in h.targets if t.name in h.quantized_names for p in t.pieces}
        runs = {l.name: l.runs for l in h.plan.layers}  # a vision tower runs in image prompts only
        h.prefill = PrefillStager(h.plan.prefill, uva, set(FusedGroups.find(h.plan.params).group_of), quantized,
                                  h.layout.host_offset, h.arena, h.model, h.device,
                                  early=runs.get(h.plan.prefill.layers[0].layer) is Runs.STEP)
    if h.cuda:
        if h.engine is not None:
            torch.cuda.current_stream(h.device).wait_stream(h.engine.copy_stream)
        torch.cuda.synchronize(h.device)
        h.peak_gpu_bytes = torch.cuda.max_memory_allocated(h.device) - h.start_alloc
