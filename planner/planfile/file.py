"""The plan file: deterministic YAML on disk, typed (plan.py) in memory.

`dumps(loads(text)) == text` byte for byte, and the same inputs give the same bytes (no timestamps, no dict-order
surprises). A plan's `built:` stamp ends in the digest of the text around it (planner/provenance.py): `dumps` writes
it last. Paths inside a plan are relative to the plan file's directory, so a plan committed next to its policy stays
valid in any clone.

Every reader goes through `read_plan` (or `loads`), which refuses a plan whose parts disagree (consistency.py):
`plan show`, `validate`, `diff`, `check` and the runtime alike.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import groupby
from operator import itemgetter
from pathlib import Path

from ..errors import InconsistentPlanError, OffplanError, PlanFileError
from ..inputs import yamlio
from ..inputs.checkpoint import Checkpoint, TensorInfo, open_checkpoint
from ..inputs.schema import validate
from ..nogc import no_gc
from ..plan import (Backend, Buffer, Built, Cost, LayerBytes, Layout, Parallel, Placement, Plan, PrefetchSchedule,
                    PrefillStaging, RoutingRef, Runs, StagedLayer, Summary, Transfer)
from ..provenance import PLACEHOLDER, sign
from .consistency import inconsistencies
from .reading import parse_plan

FORMAT_VERSION = 2  # 2: slot layouts with offsets, module paths, `runs`
HEADER = (
    "# offplan plan: written by `plan build`, applied exactly by the runtime. Do not edit by hand.\n"
    "# Review: `plan show`; compare: `plan diff OLD NEW`; staleness: `plan check`.\n"
)


# ---------------------------------------------------------------- writing

_s = yamlio.scalar


def _v(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return _s(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_v(v) for v in value) + "]"
    raise TypeError(value)


def _row(layer: LayerBytes) -> str:
    runs = {} if layer.runs is Runs.STEP else {"runs": layer.runs.value}
    why = {} if layer.why is None else {"why": layer.why}
    experts = {} if layer.experts is None else {"experts": layer.experts}
    cpu = {} if not layer.cpu else {"cpu": layer.cpu}  # absent without experts on cpu, as in plans before it
    return _flow(name=layer.name, **runs, gpu=layer.gpu, uva=layer.uva, prefetch=layer.prefetch, **cpu,
                 h2d=layer.h2d, us=layer.us, **experts, **why)


def _flow(**items) -> str:
    return "{" + ", ".join(f"{k}: {_v(v)}" for k, v in items.items()) + "}"


def _buffer(b: Buffer) -> str:
    """A slot layout's line: `_flow` of its fields, written out (a layer's 1.5k experts' tensors each)."""
    return (f"        - {{name: {_s(b.name)}, dtype: {_s(b.dtype)}, shape: [{', '.join(map(str, b.shape))}], "
            f"offset: {b.offset}, bytes: {b.bytes}}}\n")


def dumps(plan: Plan) -> str:
    with no_gc():  # 90k lines: the cyclic collector would rescan every object planning made, again and again
        return _dumps(plan)


def _dumps(plan: Plan) -> str:
    s = plan.summary
    b = plan.built
    out = [HEADER, f"format_version: {FORMAT_VERSION}\n",
           *([] if b is None else  # absent where the version is unknown, as in plans before stamps
             ["built:\n", f"  offplan: {_s(b.offplan)}\n", f"  inputs: {_s(b.inputs)}\n", f"  digest: {_s(PLACEHOLDER)}\n"]),
           "checkpoint:\n",
           f"  path: {_s(plan.checkpoint_path)}\n",
           f"  fingerprint: {_s(plan.checkpoint_fingerprint)}\n",
           f"  tensors: {plan.tensors}\n",
           f"  bytes: {plan.total_bytes}\n",
           "policy:\n",
           f"  path: {_s(plan.policy_path)}\n",
           f"  fingerprint: {_s(plan.policy_fingerprint)}\n",
           *(["routing: null\n"] if plan.routing is None else
             ["routing:\n", f"  path: {_s(plan.routing.path)}\n", f"  fingerprint: {_s(plan.routing.fingerprint)}\n"]),
           f"backend: {plan.backend.value}\n",
           f"budget_bytes: {_v(plan.budget_bytes)}\n",
           f"stacks: {_v(list(plan.stacks))}\n",
           f"tied_embeddings: {_v(plan.tied_embeddings)}\n",
           *_parallel(plan.parallel),
           "summary:\n",
           f"  gpu_bytes: {s.gpu_bytes}\n",
           f"  uva_bytes: {s.uva_bytes}\n",
           f"  prefetch_bytes: {s.prefetch_bytes}\n",
           *([f"  cpu_bytes: {s.cpu_bytes}\n"] if s.cpu_bytes else []),
           f"  prefetch_buffer_bytes: {s.prefetch_buffer_bytes}\n",
           # absent without staging, as in plans before it
           *([f"  stage_buffer_bytes: {s.stage_buffer_bytes}\n"] if s.stage_buffer_bytes else []),
           f"  gpu_footprint_bytes: {s.gpu_footprint_bytes}\n",
           f"  predicted_h2d_bytes_per_step: {s.predicted_h2d_bytes_per_step}\n",
           f"  predicted_step_us: {s.predicted_step_us}\n",
           *[f"  working_{k}_bytes: {v}\n" for k, v in (("decode", s.working_decode_bytes),
                                                        ("prefill", s.working_prefill_bytes),
                                                        ("buffer", s.working_buffer_bytes)) if v]]
    c = plan.cost
    if c is None:
        out.append("cost: null\n")
    else:
        graphs = {"cuda_graphs": True} if c.cuda_graphs else {}  # absent for eager, as plans before it
        graphs |= {"eager_cpu_us": c.eager_cpu_us} if c.eager_cpu_us is not None else {}  # graph plans only
        prefill = {"prompt_tokens": c.prompt_tokens, "prefill_us": c.prefill_us} if c.prompt_tokens else {}
        threads = {"cpu_threads": c.cpu_threads, "cpu_expert_gbps": c.cpu_expert_gbps,
                   "cpu_expert_sync_us": c.cpu_expert_sync_us} if c.cpu_threads else {}
        top_k = {"top_k": c.top_k} if c.top_k else {}  # absent for a dense model, as in plans before it
        flow = _flow(hardware=c.hardware, batch_size=c.batch_size, cpu_us=c.cpu_us, gpu_us=c.gpu_us,
                     link_us=c.link_us, **graphs, **prefill, **threads, **top_k)
        out.append(f"cost: {flow}\n")
    out.append("notes:" + (" []\n" if not plan.notes else "\n"))
    out += [f"  - {_s(n)}\n" for n in plan.notes]
    out.append("layers:\n")
    out += [f"  - {_row(l)}\n" for l in plan.layers]
    p = plan.prefetch
    if p is None:
        out.append("prefetch: null\n")
    else:
        out += ["prefetch:\n", f"  step: {p.step}\n", f"  slots: {p.slots}\n",
                f"  slot_bytes: {p.slot_bytes}\n", "  layouts:\n"]
        for layout in p.layouts:
            out += [f"    - bytes: {layout.bytes}\n", "      buffers:\n"]
            out += map(_buffer, layout.buffers)
        out.append("  schedule:\n")
        out += [f"    - {_flow(layer=t.layer, module=t.module, layout=t.layout, slot=t.slot, after=t.after)}\n"
                for t in p.schedule]
    st = plan.prefill
    if st is not None:  # absent when nothing is staged, as in plans before staging
        out += ["prefill:\n", f"  above_tokens: {st.above_tokens}\n", f"  slots: {st.slots}\n",
                f"  slot_bytes: {st.slot_bytes}\n", *([f"  ring_bytes: {st.ring_bytes}\n"] if st.experts else []), "  layers:\n"]
        out += [f"    - {_flow(layer=l.layer, module=l.module, bytes=l.bytes)}\n" for l in st.layers]
    out.append("params:\n")
    out += _params(plan.params)
    return "".join(out) if b is None else sign("".join(out))


def _parallel(par: Parallel | None) -> list[str]:
    """The `parallel:` section; absent for one GPU, as in plans before it."""
    if par is None:
        return []
    return ["parallel:\n", f"  layout: {par.layout}\n", f"  gpus: {par.gpus}\n",
            f"  budgets: {_v(None if par.budgets is None else list(par.budgets))}\n",
            f"  collectives: {_flow(per_step=par.collectives_per_step, us=par.collectives_us)}\n",
            "  split:" + (" {}\n" if not par.split else "\n"), *(f"    {_s(t)}: {d}\n" for t, d in par.split),
            f"  reduce: {_v(list(par.reduce))}\n" if not par.reduce else "  reduce:\n",
            *(f"    - {_s(r)}\n" for r in par.reduce), f"  gather: {_v(list(par.gather))}\n"]


_AS_PARAM = {p: f": {p.value}\n" for p in Placement}
_NAME, _PLACE = itemgetter(0), itemgetter(1)  # of a params item


def _params(params: dict[str, Placement]) -> Iterable[str]:
    """`  name: placement` lines, as the pieces of one join. Names are written as `scalar` writes them; when
    all of them are plain (checked at once, over the names joined by newlines), they need no look each, and
    each run of names of one placement (a layer's experts, its attention) is written by one join."""
    names = "\n".join(params)
    if not (names.count("\n") == len(params) - 1 and yamlio.all_plain(names)):  # no name holds a newline
        return [f"  {_s(name)}: {place.value}\n" for name, place in params.items()]
    return ["  " + (end + "  ").join(map(_NAME, run)) + end
            for place, run in groupby(params.items(), key=_PLACE) for end in [_AS_PARAM[place]]]


# ---------------------------------------------------------------- reading

@dataclass(frozen=True)
class LoadedPlan:
    """A plan read from its file and checked, with its checkpoint's headers when they are at hand."""

    plan: Plan
    checkpoint: Checkpoint | None  # the plan's checkpoint, unchanged since the build; None: not at hand
    unchecked: str | None  # why tensor sizes were not compared (None: they were)


def loads(text: str, path: str | Path = "<plan>", tensors: Mapping[str, TensorInfo] | None = None) -> Plan:
    """Parse, schema-check and consistency-check a plan (consistency.py; exact with `tensors`,
    the checkpoint's headers). Raises PlanFileError with `file:line:column`s."""
    plan, doc = _parse(text, Path(path))
    _refuse_inconsistent(plan, doc, tensors, None if tensors is not None else "no checkpoint given")
    return plan


def read_plan(path: str | Path, beside: LoadedPlan | None = None) -> LoadedPlan:
    """Read a plan file and check it, against its checkpoint's headers when they are at hand
    (the checkpoint exists and its fingerprint is the plan's): `plan show`, `plan validate`,
    `plan diff`, `plan check` and the runtime all read plans through here. `beside`: another plan read,
    whose checkpoint is taken where it is this one's (the same directory and fingerprint: `plan diff`)."""
    path = Path(path)
    plan, doc = _parse(yamlio.read(path, PlanFileError, "plan"), path)
    ckpt, unchecked = _checkpoint_at_hand(plan, path, beside.checkpoint if beside else None)
    _refuse_inconsistent(plan, doc, ckpt.tensors if ckpt else None, unchecked)
    return LoadedPlan(plan, ckpt, unchecked)


def load_plan(path: str | Path) -> Plan:
    return read_plan(path).plan


def _checkpoint_at_hand(plan: Plan, path: Path, read: Checkpoint | None = None) -> tuple[Checkpoint | None, str | None]:
    where = plan.checkpoint_dir(path)
    if read is not None and read.fingerprint == plan.checkpoint_fingerprint and read.root.resolve() == where.resolve():
        return read, None  # read already, for another plan
    if not where.exists():
        return None, f"its checkpoint {plan.checkpoint_path} is not at hand"
    try:
        ckpt = open_checkpoint(where)
    except OffplanError:
        return None, f"its checkpoint {plan.checkpoint_path} cannot be read"
    if ckpt.fingerprint != plan.checkpoint_fingerprint:
        return None, f"its checkpoint {plan.checkpoint_path} changed since the plan was built (see `plan check`)"
    return ckpt, None


def _refuse_inconsistent(plan: Plan, doc: yamlio.Located, tensors, unchecked: str | None) -> None:
    problems = inconsistencies(plan, doc.where, tensors, doc.data["summary"]["gpu_footprint_bytes"])
    if problems:
        how = ("with the tensor sizes in its checkpoint's headers" if unchecked is None
               else f"by tensor names only: {unchecked}")
        policy = (doc.file.parent / plan.policy_path).as_posix()
        raise InconsistentPlanError(
            f"{doc.file}: the plan is inconsistent (edited by hand?): params: compared with layers:, "
            f"summary:, prefetch: and prefill: {how}; rebuild it: plan build {policy} -o {doc.file}", problems)


def _parse(text: str, path: Path) -> tuple[Plan, yamlio.Located]:
    doc = parse_plan(path, text)
    wrong = yamlio.wrong_kind(path, doc.data, "plan")
    if wrong:
        raise PlanFileError(wrong)
    if not isinstance(doc.data, dict) or "params" not in doc.data:
        cut = " (it starts as one: cut short?)" if text.startswith(HEADER.splitlines()[0]) else ""
        raise PlanFileError(f"{path}: not an offplan plan (no `params:` mapping){cut}; build one with "
                            "`plan build POLICY`")
    if isinstance(doc.data, dict) and doc.data.get("format_version") == 1:
        raise PlanFileError(f"{path}: a format 1 plan, from an offplan without slot layouts in plans; "
                            "rebuild it with `plan build POLICY`")
    validate(doc, "plan.schema.json", PlanFileError, f"{path}: the plan is invalid")
    d = doc.data
    p = d["prefetch"]
    prefetch = None if p is None else PrefetchSchedule(
        p["step"], p["slots"], p["slot_bytes"],
        tuple(Layout(l["bytes"], tuple(Buffer(b["name"], b["dtype"], tuple(b["shape"]), b["offset"], b["bytes"])
                                       for b in l["buffers"])) for l in p["layouts"]),
        tuple(Transfer(t["layer"], t["module"], t["layout"], t["slot"], t["after"]) for t in p["schedule"]))
    s = d["summary"]
    st = d.get("prefill")
    prefill = None if st is None else PrefillStaging(
        st["above_tokens"], st["slots"], st["slot_bytes"],
        tuple(StagedLayer(l["layer"], l["module"], l["bytes"]) for l in st["layers"]), st.get("ring_bytes", 0))
    par = d.get("parallel")
    parallel = None if par is None else Parallel(
        par["gpus"], tuple(par["split"].items()), tuple(par["reduce"]), tuple(par["gather"]),
        None if par["budgets"] is None else tuple(par["budgets"]), par["collectives"]["per_step"],
        par["collectives"]["us"], par["layout"])
    plan = Plan(
        checkpoint_path=d["checkpoint"]["path"],
        checkpoint_fingerprint=d["checkpoint"]["fingerprint"],
        tensors=d["checkpoint"]["tensors"],
        total_bytes=d["checkpoint"]["bytes"],
        policy_path=d["policy"]["path"],
        policy_fingerprint=d["policy"]["fingerprint"],
        backend=Backend(d["backend"]),
        budget_bytes=d["budget_bytes"],
        stacks=tuple(d["stacks"]),
        tied_embeddings=d["tied_embeddings"],
        summary=Summary(s["gpu_bytes"], s["uva_bytes"], s["prefetch_bytes"], s["prefetch_buffer_bytes"],
                        s["predicted_h2d_bytes_per_step"], s["predicted_step_us"], s.get("stage_buffer_bytes", 0),
                        s.get("cpu_bytes", 0), s.get("working_decode_bytes", 0),
                        s.get("working_prefill_bytes", 0), s.get("working_buffer_bytes", 0)),
        layers=tuple(LayerBytes(**{**l, "runs": Runs(l.get("runs", "step"))}) for l in d["layers"]),
        prefetch=prefetch,
        params={k: Placement(v) for k, v in d["params"].items()},
        notes=tuple(d["notes"]),
        cost=None if d["cost"] is None else Cost(**d["cost"]),
        routing=None if d.get("routing") is None else RoutingRef(d["routing"]["path"], d["routing"]["fingerprint"]),
        prefill=prefill,
        parallel=parallel,
        built=None if d.get("built") is None else Built(d["built"]["offplan"], d["built"]["inputs"],
                                                       d["built"]["digest"]),
    )
    return plan, doc
