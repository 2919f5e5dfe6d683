"""`plan build`: policy + checkpoint headers -> Plan. The one place the steps are wired together."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from ..errors import CheckpointError, OffplanError, PolicyError
from ..files import relpath
from ..inputs.checkpoint import INDEX_NAME, Checkpoint, open_checkpoint
from ..inputs.config import read_config
from ..inputs.hardware import H100, Hardware, load_hardware
from ..inputs.patterns import Names, closest
from ..inputs.policy import Policy, load_policy
from ..inputs.prefused import prefused_key
from ..inputs.quantized import pairs
from ..inputs.routing import load_profile
from ..layers.alike import Shapes
from ..layers.graph import build_graph
from ..layers.scales import layer_pairs
from ..layers.shards import collectives, find_split, local_tensors
from ..nogc import no_gc
from ..plan import Built, Parallel, Placement, Plan, RoutingRef, Runs
from ..provenance import inputs_fingerprint, version
from .notes import WARNING, parallel_notes
from .placement import decide


def default_output(policy_path: Path) -> Path:
    """`qwen3.policy.yaml` -> `qwen3.plan.yaml`, beside the policy."""
    name = policy_path.name
    for suffix in (".policy.yaml", ".policy.yml", ".yaml", ".yml"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return policy_path.with_name(name + ".plan.yaml")


_BY_NUMBER = re.compile(r"(^|\.)experts\.\d")


def _stacked_example(names: list[str]) -> str:
    """A tensor holding every expert at once (prefused.py), a weight rather than a bias or scale; "" if none."""
    stacked = [n for n in names if prefused_key(n)]
    return next((n for n in stacked if "bias" not in n and "scale" not in n), stacked[0] if stacked else "")


def check_patterns(policy: Policy, names: list[str]) -> None:
    """Every pattern of the policy must match some tensor: vLLM ignores typos silently.

    A pattern that picks experts by number (`experts.3`) where the checkpoint stores them already
    fused (prefused.py) is told why it cannot: the plan places each checkpoint tensor whole."""
    problems = []
    index = Names(names)
    fused = None
    for where, pattern in policy.all_patterns():
        if not index.any_match(pattern):
            near = [] if pattern.regex else closest(pattern.text, names)
            hint = f"; did you mean {' or '.join(repr(n) for n in near)}?" if near else ""
            if _BY_NUMBER.search(pattern.text) or (pattern.regex and "experts" in pattern.text):
                fused = fused if fused is not None else _stacked_example(names)
                if fused:
                    hint = (f": this checkpoint stores its experts already fused, one tensor holding a parameter "
                            f"of every expert ({fused}), and the plan places a checkpoint tensor whole, so a rule "
                            f"cannot pick some of its experts; match the parameter (`experts.{prefused_key(fused)[1]}`)"
                            " or the module (`experts`)")
            problems.append(f"{policy.where(where)}: {where}: {pattern.text!r} matches no tensor "
                            f"of the checkpoint{hint}")
    if problems:
        raise PolicyError(f"{policy.path}: patterns that match nothing", problems)


def _refuse_missing_layers(graph, layers: int | None, root: Path) -> None:
    """config.json's decoder layers (`num_hidden_layers`) against the checkpoint's: no stack holding as many is a
    checkpoint missing layers (a shard left out) or a config.json of another model, which only the load would find.
    A vision tower's stack is not the text model's: not counted."""
    counts: dict[str, int] = {}
    for l in graph.layers:
        if l.stack is not None and l.runs is not Runs.IMAGES:
            counts[l.stack] = counts.get(l.stack, 0) + 1
    if layers is None or not counts or max(counts.values()) >= layers:
        return
    stack = max(counts, key=counts.get)
    raise CheckpointError(f"{root / 'config.json'}: num_hidden_layers is {layers}, but the checkpoint's tensors make "
                          f"{counts[stack]} layers of {stack}: a checkpoint missing layers (a shard left out?) or the "
                          "config.json of another model; point `checkpoint:` at the whole checkpoint, or restore its "
                          "config.json")


def _refuse_threadless(policy: Policy, hardware: Hardware) -> None:
    """Experts on cpu over more GPUs than the profile's host threads: each GPU's process would get none
    (hardware.py `one_of`)."""
    if hardware.cpu_threads >= policy.gpus:
        return
    asks = [f"{policy.where(f'rules[{i}].match[0]')}: rules[{i}] (place: cpu)"
            for i, rule in enumerate(policy.rules) if rule.place is Placement.CPU]
    asks += [f"{policy.where('cpu_experts')}: cpu_experts: true"] if policy.cpu_experts else []
    if asks:
        raise PolicyError(f"{policy.path}: experts on cpu over {policy.gpus} GPUs, but the hardware profile's "
                          f"cpu_threads is {hardware.cpu_threads}: each GPU's process computes its share of the experts "
                          "with its share of those threads, and would get none; use fewer GPUs, a profile of a host "
                          "with more cores (`plan calibrate`), or leave the experts on uva", asks)


def threads_warning(hardware: Hardware) -> str | None:
    """The note of a plan with experts on cpu whose profile's cpu_threads are not the threads its host rates were
    measured with (`cpu_rates_threads`: a calibrated profile edited after, or one written by hand that sets
    cpu_threads over the built-in rates). The cost model reads the rates as they are: it knows no law from threads
    to rate, and a host's is not proportional (memory bounds it)."""
    threads, measured = hardware.cpu_threads, hardware.cpu_rates_threads
    if threads == measured:
        return None
    return (f"{WARNING}experts on cpu with {threads} host threads (the hardware profile's cpu_threads), predicted "
            f"with host rates measured with {measured} ({hardware.cpu_expert_gbps:g} GB/s beside UVA reads): a "
            "host's rate is not proportional to its threads (8 took 1.39-1.63x the time of 15 on an H200 machine's "
            "host, docs/host-experts/), so the plan's figures for them may not hold; calibrate with the threads the "
            f"plan will run (`plan calibrate --cpu-threads {threads}`), or give cpu_threads: {measured} where the "
            "host has the cores")


def build(policy: Policy, plan_dir: Path, checkpoint: Checkpoint | None = None) -> Plan:
    """Plan `policy` for a plan file that will live in `plan_dir` (paths are stored relative to it)."""
    with no_gc():
        return _build(policy, plan_dir, checkpoint)


def _build(policy: Policy, plan_dir: Path, checkpoint: Checkpoint | None) -> Plan:
    if checkpoint is None and not policy.checkpoint.exists():
        raise PolicyError(f"{policy.path}: checkpoint: {policy.checkpoint_text} -> {policy.checkpoint}: no such file "
                          "or directory (the path is relative to the policy file)")
    ckpt = checkpoint or open_checkpoint(policy.checkpoint)
    facts = read_config(ckpt.root)
    names = list(ckpt.tensors)
    try:  # the layers first, which pair quantized weights with their scales; their error after the checks below
        graph, unfit = build_graph(names, policy.stacks, policy.where, facts), None
    except PolicyError as e:
        graph, unfit = None, e
    shapes = Shapes(ckpt.tensors)  # each layer's dtypes and shapes, read once for the pairs and the cost model
    quantized, problems = pairs(ckpt.tensors, facts.fp8_block) if graph is None else layer_pairs(
        graph.layers, ckpt.tensors, facts.fp8_block, shapes)
    if problems:  # the runtime could not load the plan: say so now, not at apply
        raise CheckpointError(f"{ckpt.root}: quantized tensors offplan cannot load", problems)
    check_patterns(policy, names)
    if unfit is not None:
        raise unfit
    if policy.stacks is None:  # else the stacks are the policy's: the text model's may be none of them
        _refuse_missing_layers(graph, facts.layers, ckpt.root)
    hardware = load_hardware(policy.hardware) if policy.hardware else H100
    threads = threads_warning(hardware)  # of the whole host's profile: each GPU's share (`one_of`) is made alike
    top_k = policy.workload.experts_per_token or facts.top_k
    routing = load_profile(policy.workload.routing) if policy.workload.routing else None
    tensors, parallel, waits = ckpt.tensors, None, None
    if policy.gpus > 1:  # one GPU's share of every tensor (layers/shards.py); its link shared with the others'
        split, problems = find_split(ckpt.tensors, facts, policy.gpus)
        if problems:
            raise PolicyError(f"{policy.where('gpus')}: gpus: {policy.gpus}: tensor parallelism cannot split "
                              f"{ckpt.root}", problems)
        tensors = local_tensors(ckpt.tensors, split.dims, policy.gpus)
        waits = collectives(graph.layers, split, tensors, facts.hidden)
        _refuse_threadless(policy, hardware)
        hardware = hardware.one_of(policy.gpus)
        parallel = Parallel(policy.gpus, tuple(split.dims.items()), split.reduce, split.gather,
                            policy.gpu_budgets_bytes)
    d = decide(graph, tensors, policy, hardware, top_k, routing, ckpt.fingerprint, facts.experts, quantized, waits,
               shapes if tensors is ckpt.tensors else None)
    if threads and d.summary.cpu_bytes:
        d = dataclasses.replace(d, notes=(*d.notes, threads))
    if parallel is not None:
        parallel = dataclasses.replace(parallel, collectives_per_step=d.collectives[0], collectives_us=d.collectives[1])
        d = dataclasses.replace(d, notes=(*parallel_notes(policy.gpus, facts.model_type, hardware.h2d_copy_gbps,
                                                          policy.gpu_budgets_bytes), *d.notes))
    # The directory when it is the standard layout, else the file the policy named.
    if ckpt.index is None:
        ckpt_file = ckpt.root / next(iter(ckpt.tensors.values())).shard
    else:
        ckpt_file = ckpt.root if ckpt.index.name == INDEX_NAME else ckpt.index
    ckpt_path = relpath(ckpt_file, plan_dir)
    offplan = version()
    return Plan(
        checkpoint_path=ckpt_path,
        checkpoint_fingerprint=ckpt.fingerprint,
        tensors=len(ckpt.tensors),
        total_bytes=ckpt.total_bytes,
        policy_path=relpath(policy.path, plan_dir),
        policy_fingerprint=policy.fingerprint,
        backend=d.backend,
        budget_bytes=policy.budget_bytes,
        stacks=graph.stacks,
        tied_embeddings=graph.tied_embeddings,
        summary=d.summary,
        layers=d.layers,
        prefetch=d.prefetch,
        params=d.params,
        notes=d.notes,
        cost=d.cost,
        routing=None if routing is None else RoutingRef(relpath(routing.path, plan_dir), routing.fingerprint),
        prefill=d.prefill,
        parallel=parallel,
        built=None if offplan is None else Built(offplan, inputs_fingerprint(offplan, policy.hardware, ckpt.root)),
    )


def build_file(policy_path: str | Path, output: str | Path | None = None) -> tuple[Plan, Path]:
    policy = load_policy(policy_path)
    out = Path(output) if output else default_output(Path(policy_path))
    return build(policy, out.parent), out


def step_at(plan: Plan, plan_file: str | Path, batch: int, graphs: bool) -> int | None:
    """`plan`'s decode step at `batch` sequences, replayed from a CUDA graph (`graphs`) or eager. At the plan's own
    batch its cost gives both modes (Cost.step_us_in; None for eager in a graph plan written before that). At
    another, its policy is built again for that batch and mode (planning from headers: a second or so on
    DeepSeek-V3), and counts where it places every tensor as the plan does (`backend: mixed` may place otherwise).
    None where neither holds, or where the policy is gone or no longer builds."""
    if plan.cost is None or plan.cost.batch_size == batch:
        return None if plan.cost is None else plan.cost.step_us_in(graphs)
    directory = Path(plan_file).parent
    try:
        policy = load_policy(directory / plan.policy_path)
        again = build(dataclasses.replace(policy, workload=dataclasses.replace(
            policy.workload, batch_size=batch, cuda_graphs=graphs)), directory)
    except OffplanError:
        return None
    return again.summary.predicted_step_us if again.params == plan.params else None
