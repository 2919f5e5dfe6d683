"""What a plan says, typed: the plan's vocabulary (enums) and its model (frozen dataclasses).

A plan holds names, not modules: every checkpoint tensor exactly once, in execution order, with its placement,
plus the summaries a reviewer reads (per-layer bytes, the prefetch schedule) and the fingerprints that staleness
checks compare against. Reading and writing it is planfile.py; checking that its parts agree is consistency.py;
staleness is staleness.py.

This module is the vocabulary the planner, the plan file and the runtime share; it imports nothing else of offplan.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path


class Placement(Enum):
    """Where one parameter lives at run time."""

    GPU = "gpu"  # resident in GPU memory
    UVA = "uva"  # pinned host memory, read in place through a zero-copy CUDA view
    PREFETCH = "prefetch"  # pinned host memory, copied ahead of use into static GPU buffers
    CPU = "cpu"  # host memory, computed by the host CPU: routed experts only (the GPU sums their outputs)

    __hash__ = object.__hash__  # members are singletons; Enum's own hash is slow Python code


class Backend(Enum):
    """What decides the offloaded tensors. `auto` appears only in policies (it resolves to one of the
    others); `none` only in plans (nothing was offloaded beyond what rules place)."""

    AUTO = "auto"
    NONE = "none"
    UVA = "uva"
    PREFETCH = "prefetch"
    MIXED = "mixed"


class Role(Enum):
    """What fraction of a tensor one decode step reads, for the cost model (cost.py)."""

    EXPERT = "expert"  # a routed expert: read when routing picks it
    EMBEDDING = "embedding"  # an embedding table: one row per sequence
    DENSE = "dense"  # read whole every step


class LayerKind(Enum):
    """A node of the layer graph (graph.py)."""

    EMBED = "embed"  # embedding-like modules, first
    LAYER = "layer"  # one layer of a repeated stack
    MODULE = "module"  # anything else (final norms, projectors)
    HEAD = "head"  # the output head, last


class Runs(Enum):
    """When a layer runs, as the layer graph knows it (graph.py)."""

    STEP = "step"  # in every decode step
    IMAGES = "images"  # only for prompts with images, in the prefill (vision towers, projectors)
    MTP = "mtp"  # never in plain decode: multi-token prediction layers (DeepSeek-V3's last layer)


@dataclass(frozen=True)
class LayerBytes:
    """One layer of the plan: bytes by placement, and what the cost model predicts of it per step."""

    name: str
    gpu: int = 0
    uva: int = 0
    prefetch: int = 0
    h2d: int = 0  # predicted bytes over the host link per decode step
    us: int = 0  # predicted GPU time per step (HBM and UVA reads)
    why: str | None = None  # mixed plans: what the layer offloads and why
    runs: Runs = Runs.STEP  # when it runs (graph.py); the cost model counts only what runs every step
    experts: str | None = None  # split expert groups: which experts are where (expert_map.py `experts_map`)
    cpu: int = 0  # routed experts the host CPU computes (absent from the file when 0)


@dataclass(frozen=True)
class Buffer:
    """Where a prefetched tensor sits in its layer's slot: name in the layer, dtype, shape, byte offset in the slot."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    bytes: int


@dataclass(frozen=True)
class Layout:
    """A prefetched layer's slot image (slots.py): its tensors at their offsets, `bytes` long; alike layers share it."""

    bytes: int
    buffers: tuple[Buffer, ...]


@dataclass(frozen=True)
class Transfer:
    """Copy `layer`'s prefetched tensors into `slot`, laid out as `layouts[layout]`, once `after`'s forward has run;
    the runtime hooks the forward of the module at path `module`. `after` is the previous user of the slot
    (cyclically), so a copy never overwrites a buffer that a layer still has to read. The runtime also issues the
    first transfer of every slot at load, so the first forward finds its layers ready."""

    layer: str
    module: str
    layout: int
    slot: int
    after: str


@dataclass(frozen=True)
class PrefetchSchedule:
    """`step` slots at most (vLLM's offload_prefetch_step), each `slot_bytes`: the largest layout."""

    step: int
    slots: int
    slot_bytes: int
    layouts: tuple[Layout, ...]
    schedule: tuple[Transfer, ...]

    @property
    def pool_bytes(self) -> int:
        return self.slots * self.slot_bytes


@dataclass(frozen=True)
class StagedLayer:
    """A layer whose uva tensors (routed experts only if `PrefillStaging.experts`) are copied to the GPU before a
    forward over many tokens: the plan's layer name, the module whose forward the runtime hooks (as `Transfer.module`),
    and the bytes its staged tensors but routed experts take in a slot, each ALIGN (256 B) apart (0: experts only)."""

    layer: str
    module: str
    bytes: int


@dataclass(frozen=True)
class PrefillStaging:
    """uva tensors staged for prefill (runtime/execute/prefill.py).

    A GEMM reading a weight in place through a UVA view re-reads it over the
    host link once per output tile: past a few hundred tokens that is many
    times the weight's bytes (24x at 8192 tokens on the H100). So when a
    forward carries more than `above_tokens` tokens (the hardware profile's
    crossover, measured by `plan calibrate`), each staged layer's uva tensors
    are copied into one of `slots` GPU buffers of `slot_bytes` first, the next
    layer's copy overlapping this one's compute, as prefetch does; at or below
    it (decode) they are read in place. Routed experts on uva are staged only
    where `ring_bytes` is set (staging.py says when the planner sets it), and
    not through the slots: their rows stream through a ring of `ring_bytes`
    that each staged forward allocates and frees (runtime/execute/ring.py), prefill
    working memory (decide/working.py, in the footprint). Otherwise offplan's experts
    implementation reads each touched expert once per forward, after the router.
    """

    above_tokens: int
    slots: int  # min(2, staged layers with `bytes`): 0 when only routed experts are staged
    slot_bytes: int  # the largest staged layer's `bytes`
    layers: tuple[StagedLayer, ...]  # in execution order
    ring_bytes: int = 0  # routed experts on uva staged too, through a ring of this many bytes (0: not staged)

    @property
    def experts(self) -> bool:
        return self.ring_bytes > 0

    @property
    def pool_bytes(self) -> int:
        """The slots, held from load on (the ring is allocated per staged forward: working memory, in `Summary`)."""
        return self.slots * self.slot_bytes


def working_peak(decode: int, prefill: int, buffers: int) -> int:
    return buffers + max(decode, prefill)  # the experts' working memory at its most: a decode step or a prefill


@dataclass(frozen=True)
class Summary:
    gpu_bytes: int
    uva_bytes: int
    prefetch_bytes: int
    prefetch_buffer_bytes: int
    predicted_h2d_bytes_per_step: int = 0
    predicted_step_us: int = 0
    stage_buffer_bytes: int = 0  # the prefill staging pool (PrefillStaging.pool_bytes)
    cpu_bytes: int = 0  # routed experts the host CPU computes, in host memory (no GPU memory)
    # the experts' working memory (decide/working.py), in the footprint: a decode step, a prefill, buffers
    working_decode_bytes: int = 0
    working_prefill_bytes: int = 0
    working_buffer_bytes: int = 0

    @property
    def working_peak_bytes(self) -> int:
        return working_peak(self.working_decode_bytes, self.working_prefill_bytes, self.working_buffer_bytes)

    @property
    def gpu_footprint_bytes(self) -> int:
        """Every byte offplan holds on the GPU at once: resident tensors, the pools, and the most working memory."""
        return self.gpu_bytes + self.prefetch_buffer_bytes + self.stage_buffer_bytes + self.working_peak_bytes


@dataclass(frozen=True)
class Cost:
    """What the cost model assumed and predicted (see planner/decide/cost.py)."""
    hardware: str  # the profile's device name
    batch_size: int
    cpu_us: int  # per step: launching the kernels (overlaps the GPU)
    gpu_us: int  # per step: HBM reads + UVA reads
    link_us: int  # per step: UVA reads + prefetch copies over the host link
    cuda_graphs: bool = False  # steps replay a captured CUDA graph: cpu_us is 0
    prompt_tokens: int = 0  # tokens of the predicted prefill (workload.prompt_tokens); 0: a plan without one
    prefill_us: int = 0  # predicted prefill of prompt_tokens tokens, one sequence: the time to first token
    cpu_threads: int = 0  # host threads assumed for experts on cpu (the hardware profile's); 0: none on cpu
    cpu_expert_gbps: float = 0.0  # with them, the host figures assumed (the load checks them: host/pace.py); 0:
    cpu_expert_sync_us: float = 0.0  # no expert on cpu, or a plan written before they were recorded
    top_k: int = 0  # routed experts a token reads, as assumed (workload or config.json); 0: a dense model, or unknown
    eager_cpu_us: int | None = None  # a graph prediction's: cpu_us were the steps eager; None in eager ones

    @property
    def step_us(self) -> int:
        return max(self.cpu_us, self.gpu_us, self.link_us)

    def step_us_in(self, graphs: bool) -> int | None:
        """The decode step replayed from a CUDA graph (`graphs`) or eager, whichever the workload named: they differ
        in the launches only. None for eager in a graph plan written before `eager_cpu_us`."""
        launches = 0 if graphs else self.eager_cpu_us if self.cuda_graphs else self.cpu_us
        return None if launches is None else max(launches, self.gpu_us, self.link_us)


@dataclass(frozen=True)
class Built:
    """How a plan was built (planfile/stamp.py): the offplan version, a fingerprint of the inputs the plan names
    no fingerprint of (the hardware profile and config.json), and a digest of the plan's own text, which
    `plan check` compares instead of building the plan again."""

    offplan: str
    inputs: str
    digest: str = field(default="", compare=False)  # of the text: `dumps` writes it, "" until then


@dataclass(frozen=True)
class RoutingRef:
    """The routing profile a plan was built with (planner/inputs/routing.py): path relative to the plan
    file's directory, and the fingerprint of its bytes, which staleness compares."""

    path: str
    fingerprint: str


@dataclass(frozen=True)
class Parallel:
    """Tensor parallelism over `gpus` GPUs of one host (planner/layers/shards.py): each GPU holds its share of
    every tensor that `split` names, along that dimension, and the whole of every other; one process per GPU
    applies the plan to its share, so the plan's placements, bytes, layouts and predictions are each GPU's.

    Example (Qwen3-MoE over 2 GPUs): split `{model.layers.*.self_attn.q_proj.weight: 0,
    model.layers.*.mlp.experts.*.down_proj.weight: 1, lm_head.weight: 0, ...}`, reduce
    `(model.layers.*.self_attn.o_proj, model.layers.*.mlp.experts)`, gather `(lm_head,)`.
    """

    gpus: int
    split: tuple[tuple[str, int], ...]  # (checkpoint name template, `*` for numbers; the dim each GPU takes 1/gpus of)
    reduce: tuple[str, ...]  # module templates whose outputs the GPUs sum (all-reduce)
    gather: tuple[str, ...]  # modules whose outputs the GPUs concatenate along the last dim (all-gather)
    budgets: tuple[int, ...] | None = None  # each GPU's budget in bytes, when the policy gives them apart
    collectives_per_step: int = 0  # all-reduces and all-gathers in one decode step
    collectives_us: int = 0  # their predicted time per step (in the cost's gpu_us)
    layout: str = "tensor"

    @property
    def dims(self) -> dict[str, int]:
        return dict(self.split)


@dataclass(frozen=True)
class Plan:
    checkpoint_path: str  # relative to the plan file's directory
    checkpoint_fingerprint: str
    tensors: int
    total_bytes: int
    policy_path: str  # relative to the plan file's directory
    policy_fingerprint: str
    backend: Backend  # what ran: none, uva, prefetch or mixed
    budget_bytes: int | None
    stacks: tuple[str, ...]
    tied_embeddings: bool
    summary: Summary
    layers: tuple[LayerBytes, ...]
    prefetch: PrefetchSchedule | None
    params: dict[str, Placement]  # execution order
    notes: tuple[str, ...] = field(default=())
    cost: Cost | None = None
    routing: RoutingRef | None = None  # None: routing assumed uniform (no `workload.routing`)
    prefill: PrefillStaging | None = None  # None: nothing staged (no uva layer, or `uva.stage_prefill: false`)
    parallel: Parallel | None = None  # None: one GPU; else every figure above is each GPU's share
    built: Built | None = None  # None: offplan's version unknown, or a plan from before stamps

    def checkpoint_dir(self, plan_file: str | Path) -> Path:
        return Path(plan_file).parent / self.checkpoint_path
