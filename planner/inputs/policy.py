"""The policy file (format 1): YAML -> JSON Schema -> frozen dataclasses.

Nothing past `load_policy` sees raw YAML. Cross-field checks follow vLLM's
offload config: `num_in_group <= group_size`, `step >= 1` whenever prefetch is
on. Settings for a backend that will not run are kept but warned about.
"""
from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import PolicyError
from ..plan import Backend, Placement, Role
from ..units import GIB
from . import yamlio
from .patterns import Pattern, compile_pattern
from .schema import validate


@dataclass(frozen=True)
class Rule:
    """`rules[i]`: tensors matching any pattern get a placement, a role, or both; first match wins.

    Example: `{match: [embed_tokens, lm_head], place: gpu}`, or `{match: [shared_experts], role: dense}`.
    """

    patterns: tuple[Pattern, ...]  # `match:` vLLM segment patterns or `re:` regexes, e.g. (experts,)
    place: Placement | None  # `place:` gpu | uva | prefetch | cpu (routed experts); None: the rule only sets a role
    role: Role | None = None  # `role:` what the cost model assumes a step reads of them


@dataclass(frozen=True)
class Workload:
    """`workload:` what the cost model predicts for. Example:

        workload:
          batch_size: 8
          experts_per_token: 8
          routing: qwen3.routing.yaml   # written by `plan profile CHECKPOINT -o qwen3.routing.yaml`
          cuda_graphs: false            # predict eager decode steps (default: replayed from a CUDA graph)
          prompt_tokens: 2048           # the prefill to predict: the time to first token
          new_tokens: 128               # tokens generated per request

    Without `routing`, the cost model assumes every expert of a layer is equally likely to be picked, and the
    plan says so; with it, each expert's share of decode tokens comes from the profile (planner/inputs/routing.py),
    and `backend: mixed` keeps the most-hit experts on the GPU. A request is a prefill of `prompt_tokens` and
    `new_tokens` decode steps; `backend: mixed` minimises its predicted time, not the step's alone.
    """

    batch_size: int = 1  # sequences decoded together
    experts_per_token: int | None = None  # MoE top-k; None: read from the checkpoint's config.json
    routing: Path | None = None  # `routing:` resolved against the policy's directory, `~` expanded
    routing_text: str | None = None  # as written in the policy, e.g. "qwen3.routing.yaml"
    cuda_graphs: bool = True  # steps replay a CUDA graph (as plan apply runs them): no CPU launch cost; False: eager
    prompt_tokens: int = 512  # the typical prompt, whose prefill (time to first token) the cost model predicts
    new_tokens: int = 256  # tokens generated per request: mixed minimises prefill + new_tokens x step


@dataclass(frozen=True)
class UvaPolicy:
    """`uva:` vLLM's zero-copy knobs, and prefill staging. Example: `{offload_gib: 8, params: [mlp]}`, or
    `{stage_prefill: false}` to read uva tensors in place at prefill too (no staging buffers). Staging
    (planner/decide/staging.py): a forward over more than the hardware profile's `stage_above_tokens` tokens
    copies each layer's uva tensors (embeddings aside) into one of 2 GPU slots before the layer runs, since a
    GEMM reading them in place re-reads them per tile. The slots count in the GPU footprint. Routed experts
    stream through a ring of at most 1 GiB instead, which each staged forward allocates (working memory, in the
    footprint: decide/working.py), and follow `stage_experts`: unset, the planner decides where the workload's
    prompt touches most of them; `true` stages them, `false` never.
    """

    offload_gib: float = 0  # GiB of layer tensors to offload, walking layers in order (vLLM cpu_offload_gb)
    params: tuple[Pattern, ...] = ()  # only these tensors are candidates (vLLM cpu_offload_params)
    stage_prefill: bool = True  # copy uva layers to GPU slots at prefill (whatever placed them on uva)
    stage_experts: bool | None = None  # routed experts too: None, the planner decides (see above)

    @property
    def offloads(self) -> bool:
        """The backend knobs are set (stage_prefill applies to rules' uva tensors too, so it is not one)."""
        return self.offload_gib > 0 or bool(self.params)


@dataclass(frozen=True)
class PrefetchPolicy:
    """`prefetch:` vLLM's streaming knobs. Example: `{group_size: 8, num_in_group: 2, step: 2, params: [experts]}`
    streams the experts of layers 6, 7, 14, 15, ... through 2 slots."""

    group_size: int = 0  # layer i streams iff i % group_size >= group_size - num_in_group (offload_group_size)
    num_in_group: int = 1  # streamed layers per group (offload_num_in_group)
    step: int = 1  # layers copied ahead = slots in the GPU buffer pool (offload_prefetch_step)
    params: tuple[Pattern, ...] = ()  # only these tensors of a streamed layer move (offload_params)


@dataclass(frozen=True)
class Policy:
    """A policy file, parsed and checked (`load_policy`). Example:

        format_version: 1
        checkpoint: ./Qwen3-30B-A3B
        budget_gib: 24
        prefetch: {step: 2, params: [experts]}
    """

    path: Path  # the policy file
    fingerprint: str  # sha256 of the policy file's bytes, e.g. "sha256:8a86..."
    checkpoint: Path  # `checkpoint:` resolved against the policy's directory, `~` expanded
    checkpoint_text: str  # as written in the policy, e.g. "./Qwen3-30B-A3B"
    backend: Backend = Backend.AUTO  # `backend:` auto | uva | prefetch | mixed
    budget_gib: float | None = None  # `budget_gib:` GiB offplan may take: weights, buffers, working memory; e.g. 24
    stacks: tuple[str, ...] | None = None  # `stacks:` layer-stack prefixes when detection is wrong, e.g. (model.layers,)
    uva: UvaPolicy = UvaPolicy()
    prefetch: PrefetchPolicy = PrefetchPolicy()
    rules: tuple[Rule, ...] = ()
    hardware: Path | None = None  # `hardware:` a `plan calibrate` profile, resolved like `checkpoint`
    workload: Workload = Workload()
    gpus: int = 1  # `gpus:` GPUs of one host that share the model (tensor parallelism: layers/shards.py), e.g. 2
    cpu_experts: bool = False  # `cpu_experts:` backend mixed may put routed experts on cpu (decide/mixed.py)
    # each GPU's budget in GiB when they differ (`gpus: [20, 24]` or `budget_gib: [20, 24]`); None: budget_gib on each
    gpu_budgets_gib: tuple[float, ...] | None = None
    warnings: tuple[str, ...] = field(default=(), compare=False)  # settings that will be ignored, located
    # "uva.params[1]" -> "policy.yaml:5:21", for every pattern and stacks entry
    locations: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def where(self, key_path: str) -> str:
        """`file:line:column` of a pattern, stacks entry (`rules[0].match[1]`) or `workload.routing`, else the file."""
        return self.locations.get(key_path, str(self.path))

    @property
    def budget_bytes(self) -> int | None:
        """Each GPU's budget; with per-GPU budgets the smallest, which every GPU's share of a tensor-parallel
        plan (the same on each) must fit."""
        return None if self.budget_gib is None else int(self.budget_gib * GIB)

    @property
    def gpu_budgets_bytes(self) -> tuple[int, ...] | None:
        return None if self.gpu_budgets_gib is None else tuple(int(b * GIB) for b in self.gpu_budgets_gib)

    def all_patterns(self) -> list[tuple[str, Pattern]]:
        """Every pattern with the key path it came from, for "matches nothing" checks."""
        out = [(f"uva.params[{i}]", p) for i, p in enumerate(self.uva.params)]
        out += [(f"prefetch.params[{i}]", p) for i, p in enumerate(self.prefetch.params)]
        for r, rule in enumerate(self.rules):
            out += [(f"rules[{r}].match[{i}]", p) for i, p in enumerate(rule.patterns)]
        return out


def policy_fingerprint(text: str) -> str:
    """The fingerprint a plan records for its policy: sha256 of the file's text."""
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def load_policy(path: str | Path) -> Policy:
    """Read, validate and type a policy file; raises PolicyError listing every problem."""
    path = Path(path)
    text, doc = yamlio.load_mapping(path, PolicyError, "policy",
                                    "start with `format_version: 1` and `checkpoint: DIR`")
    validate(doc, "policy.schema.json", PolicyError, f"{path}: the policy is invalid")
    data = doc.data
    problems: list[str] = []
    locations: dict[str, str] = {}

    def patterns(key_path: list, items) -> tuple[Pattern, ...]:
        out = []
        for i, text in enumerate(items or []):
            locations[yamlio.dotted(key_path + [i])] = doc.where(key_path + [i])
            try:
                out.append(compile_pattern(text))
            except re.error as e:
                problems.append(f"{doc.where(key_path + [i])}: {yamlio.dotted(key_path + [i])}: "
                                f"bad regular expression {text[3:]!r}: {e}")
        return tuple(out)

    u = data.get("uva", {})
    p = data.get("prefetch", {})
    # JSON Schema's "integer" admits 2.0: store ints, so plans and messages print 2.
    uva = UvaPolicy(u.get("offload_gib", 0), patterns(["uva", "params"], u.get("params")),
                    bool(u.get("stage_prefill", True)), u.get("stage_experts"))
    pre = PrefetchPolicy(int(p.get("group_size", 0)), int(p.get("num_in_group", 1)),
                         int(p.get("step", 1)), patterns(["prefetch", "params"], p.get("params")))
    for i, _ in enumerate(data.get("stacks", [])):
        locations[f"stacks[{i}]"] = doc.where(["stacks", i])
    rules = tuple(
        Rule(patterns(["rules", i, "match"], r["match"]), Placement(r["place"]) if "place" in r else None,
             Role(r["role"]) if "role" in r else None)
        for i, r in enumerate(data.get("rules", []))
    )
    w = data.get("workload", {})
    routing = beside(path, w["routing"]) if "routing" in w else None
    workload = Workload(int(w.get("batch_size", 1)),
                        int(w["experts_per_token"]) if "experts_per_token" in w else None,
                        routing, w.get("routing"), bool(w.get("cuda_graphs", True)),
                        int(w.get("prompt_tokens", 512)), int(w.get("new_tokens", 256)))
    if routing is not None:
        locations["workload.routing"] = doc.where(["workload", "routing"])
        if not routing.is_file():
            ckpt = beside(path, data["checkpoint"])
            problems.append(f"{doc.where(['workload', 'routing'])}: workload.routing: " + (
                f"{routing} is a directory; name a routing profile file" if routing.is_dir() else f"no such file "
                f"{routing} (record one with `plan profile {ckpt} -o {routing}`; the path is relative to the policy "
                "file)"))
    hardware = beside(path, data["hardware"]) if "hardware" in data else None
    if hardware is not None and not hardware.is_file():
        problems.append(f"{doc.where(['hardware'])}: hardware: no such file {hardware} "
                        "(write one with `plan calibrate -o FILE` on the GPU machine)")
    backend = Backend(data.get("backend", "auto"))
    warnings = []
    prefetch_on = backend is Backend.PREFETCH or (backend is Backend.AUTO and pre.group_size > 0)
    if pre.group_size > 0 and pre.num_in_group > pre.group_size:
        problems.append(f"{doc.where(['prefetch', 'num_in_group'])}: prefetch.num_in_group "
                        f"({pre.num_in_group}) must be <= prefetch.group_size ({pre.group_size})")
    if prefetch_on and pre.step < 1:
        problems.append(f"{doc.where(['prefetch', 'step'])}: prefetch.step must be >= 1 when "
                        f"prefetch is on (it is {pre.step})")
    # A field is "set" when it differs from its default: `prefetch: {step: 2}` under
    # backend uva is as ignored as a group_size would be.
    uva_set = uva.offloads
    pre_set = pre != PrefetchPolicy()
    if backend is Backend.UVA and pre_set:
        warnings.append(f"{doc.key_where([], 'prefetch')}: prefetch.* is set but backend is uva; it is ignored")
    if backend is Backend.PREFETCH and uva_set:
        warnings.append(f"{doc.key_where([], 'uva')}: uva.* is set but backend is prefetch; it is ignored")
    if backend is Backend.AUTO and pre_set and pre.group_size == 0:
        warnings.append(f"{doc.key_where([], 'prefetch')}: prefetch.* is set but backend auto only prefetches "
                        "when prefetch.group_size > 0; it is ignored (set group_size, or `backend: "
                        "prefetch` to let budget_gib choose the layers)")
    gpus, budgets = _gpus(data, doc, problems)
    if backend in (Backend.AUTO, Backend.UVA) and uva.params and not uva.offload_gib and not budgets and \
            data.get("budget_gib") is None:
        warnings.append(f"{doc.key_where(['uva'], 'params')}: uva.params is set but no amount (uva.offload_gib or "
                        "budget_gib): it picks the candidates only, so it offloads nothing; set one")
    if "gpus" in data:
        locations["gpus"] = doc.where(["gpus"])
    if backend is Backend.MIXED and budgets is None and "budget_gib" not in data:
        problems.append(f"{doc.key_where([], 'backend')}: backend: mixed needs budget_gib: it chooses "
                        "placements to fit a GPU budget")
    if data.get("cpu_experts") and backend is not Backend.MIXED:
        warnings.append(f"{doc.key_where([], 'cpu_experts')}: cpu_experts is set but backend is not mixed; it is "
                        "ignored (rules place experts on cpu with `place: cpu`)")
    if "parallel" in data and gpus == 1:
        warnings.append(f"{doc.key_where([], 'parallel')}: parallel is set but gpus is 1; it is ignored")
    if backend is Backend.MIXED and (uva_set or pre.group_size > 0 or pre.params):
        warnings.append(f"{doc.key_where([], 'backend')}: backend mixed decides placements itself; "
                        "uva.* and prefetch.group_size/num_in_group/params are ignored (prefetch.step is used)")
    if backend is Backend.AUTO and uva_set and pre.group_size > 0:
        warnings.append(f"{doc.key_where([], 'uva')}: both uva.* and prefetch.group_size are set under "
                        "backend: auto; prefetch wins and uva.* is ignored")
    if problems:
        raise PolicyError(f"{path}: the policy is invalid", problems)
    ckpt_text = data["checkpoint"]
    return Policy(
        path=path, fingerprint=policy_fingerprint(text),
        checkpoint=beside(path, ckpt_text), checkpoint_text=ckpt_text, backend=backend,
        budget_gib=min(budgets) if budgets else data.get("budget_gib"),
        stacks=tuple(data["stacks"]) if "stacks" in data else None,
        uva=uva, prefetch=pre, rules=rules,
        hardware=hardware, workload=workload, gpus=gpus, cpu_experts=bool(data.get("cpu_experts", False)),
        gpu_budgets_gib=budgets if budgets and len(set(budgets)) > 1 else None,
        warnings=tuple(warnings), locations=locations,
    )


def beside(policy_path: Path, name: str) -> Path:
    """A path a policy names (checkpoint, hardware, routing): relative to the policy's folder, `~` expanded."""
    return policy_path.parent / Path(name).expanduser()


def _gpus(data: dict, doc, problems: list[str]) -> tuple[int, tuple[float, ...] | None]:
    """(GPU count, per-GPU budgets or None) from `gpus:` (a count, or each GPU's budget) and `budget_gib:`
    (one budget for each GPU, or a list, one per GPU); a problem when the two disagree."""
    gpus, budget = data.get("gpus", 1), data.get("budget_gib")
    lists = [key for key, value in (("gpus", gpus), ("budget_gib", budget)) if isinstance(value, list)]
    if len(lists) == 2 or (lists == ["gpus"] and budget is not None):
        problems.append(f"{doc.key_where([], 'budget_gib')}: budget_gib and a list of per-GPU budgets under gpus "
                        "both set the budget: give it once (`gpus: 2` with `budget_gib: [20, 24]`, or "
                        "`gpus: [20, 24]` alone)")
        return (len(gpus) if isinstance(gpus, list) else int(gpus)), None
    if lists == ["gpus"]:
        return len(gpus), tuple(float(b) for b in gpus)
    if lists == ["budget_gib"]:
        if "gpus" in data and int(gpus) != len(budget):
            problems.append(f"{doc.where(['budget_gib'])}: budget_gib lists {len(budget)} per-GPU budgets but "
                            f"gpus is {int(gpus)}: give one budget per GPU")
        return len(budget), tuple(float(b) for b in budget)
    return int(gpus), None


def resolve_backend(policy: Policy) -> tuple[Backend, str | None]:
    """The backend that will run, and why `auto` chose it (None: the policy names it)."""
    b = policy.backend
    if b is not Backend.AUTO:
        return b, None
    if policy.prefetch.group_size > 0:
        return Backend.PREFETCH, "prefetch.group_size is set"
    if policy.uva.offload_gib > 0:
        return Backend.UVA, "uva.offload_gib is set"
    if policy.budget_gib is not None:
        return Backend.UVA, "budget_gib is set"
    return Backend.NONE, "no offload amount or budget is set"
