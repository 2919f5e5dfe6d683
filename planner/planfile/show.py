"""What `plan show` prints: rich tables for people, plain dicts for `--json`.

Everything here returns data or rich renderables; `print_to` writes them: in
colour at the terminal's width on a terminal, as plain text without wrapping
or trailing spaces elsewhere (pipes, logs, tests), so lines can be grepped.
Bytes are in binary units (`human`), times in milliseconds.
"""
from __future__ import annotations

import io
import sys
from collections import Counter
from collections.abc import Iterable, Mapping

from rich import box
from rich.console import Console, RenderableType
from rich.table import Table
from rich.text import Text

from ..decide.notes import WARNING, is_warning, saving
from ..inputs.checkpoint import TensorInfo
from ..layers.graph import Layer, build_graph
from ..layers.expert_map import group_numbers, ranges
from ..plan import Placement, Plan
from ..units import human, ms, percent, plural
from . import parallel_review
from .parallel import share

KINDS = ("gpu", "uva", "prefetch", "cpu")


def kinds(*plans: Plan) -> tuple[str, ...]:
    """The placements a table or record shows: cpu only where a plan computes experts on the host CPU, so
    that plans without it read as before."""
    return KINDS if any(p.summary.cpu_bytes for p in plans) else KINDS[:3]


def print_to(file, renderables: Iterable[RenderableType | str]) -> None:
    """Print strings (never read as markup) and rich renderables to `file` (default: stdout)."""
    file = file or sys.stdout
    probe = Console(file=file)
    if probe.is_terminal:
        for r in renderables:
            probe.print(_styled(r) if isinstance(r, str) else r, highlight=False)
        return
    buf = io.StringIO()
    plain = Console(file=buf, width=10_000, highlight=False, color_system=None)
    for r in renderables:
        plain.print(Text(r) if isinstance(r, str) else r)
    file.write("".join(line.rstrip() + "\n" for line in buf.getvalue().splitlines()))


def _styled(line: str) -> Text:
    if line.startswith(WARNING):
        return Text.assemble(("warning:", "bold yellow"), line[len("warning:"):])
    if line.startswith("note: "):
        return Text.assemble(("note:", "cyan"), line[len("note:"):])
    return Text(line)


def table(columns: list[str], rows: list[list], footer: list | None = None, align: str | None = None) -> Table:
    """A plain table whose cells are text (never markup). `align`: one letter per column, `l` or `r`;
    by default the first column left and the others (numbers) right."""
    align = align or "l" + "r" * (len(columns) - 1)
    t = Table(box=box.SIMPLE, show_edge=False, pad_edge=False, show_footer=footer is not None,
              header_style="bold", footer_style="bold")
    for i, c in enumerate(columns):
        t.add_column(c, justify="left" if align[i] == "l" else "right",
                     footer=Text(str(footer[i])) if footer is not None else "")
    for r in rows:
        t.add_row(*(Text(str(c)) for c in r))
    return t


# ---------------------------------------------------------------- plan show

def show_data(plan: Plan) -> dict:
    s = plan.summary
    slot = {t.layer: t.slot for t in plan.prefetch.schedule} if plan.prefetch else {}
    return {
        "checkpoint": plan.checkpoint_path,
        "routing": None if plan.routing is None else plan.routing.path,
        "backend": plan.backend.value,
        "tensors": plan.tensors,
        "layers": [{"name": l.name, **{k: getattr(l, k) for k in kinds(plan)},
                    "slot": slot.get(l.name), "h2d_bytes_per_step": l.h2d, "gpu_us": l.us,
                    "why": l.why} for l in plan.layers],
        "summary": {**{f"{k}_bytes": getattr(s, f"{k}_bytes") for k in kinds(plan)},
                    "prefetch_buffer_bytes": s.prefetch_buffer_bytes, "stage_buffer_bytes": s.stage_buffer_bytes,
                    "gpu_footprint_bytes": s.gpu_footprint_bytes, "budget_bytes": plan.budget_bytes,
                    "predicted_h2d_bytes_per_step": s.predicted_h2d_bytes_per_step,
                    "predicted_step_us": s.predicted_step_us,
                    **{f"working_{k}_bytes": getattr(s, f"working_{k}_bytes")
                       for k in ("decode", "prefill", "buffer")}},
        "cost": None if plan.cost is None else {
            "hardware": plan.cost.hardware, "batch_size": plan.cost.batch_size,
            "cpu_us": plan.cost.cpu_us, "gpu_us": plan.cost.gpu_us, "link_us": plan.cost.link_us,
            "cuda_graphs": plan.cost.cuda_graphs, "eager_cpu_us": plan.cost.eager_cpu_us,
            "prompt_tokens": plan.cost.prompt_tokens or None, "prefill_us": plan.cost.prefill_us or None,
            **({"cpu_threads": plan.cost.cpu_threads, "cpu_expert_gbps": plan.cost.cpu_expert_gbps or None,
                "cpu_expert_sync_us": plan.cost.cpu_expert_sync_us or None} if plan.cost.cpu_threads else {})},
        "prefetch": None if plan.prefetch is None else {
            "step": plan.prefetch.step, "slots": plan.prefetch.slots, "slot_bytes": plan.prefetch.slot_bytes,
            "layers": len(plan.prefetch.schedule)},
        "prefill": None if plan.prefill is None else {
            "above_tokens": plan.prefill.above_tokens, "slots": plan.prefill.slots,
            "slot_bytes": plan.prefill.slot_bytes, "ring_bytes": plan.prefill.ring_bytes or None,
            "layers": [l.layer for l in plan.prefill.layers]},
        "notes": list(plan.notes),
        "parallel": parallel_review.data(plan.parallel),
    }


def _bytes(n: int) -> str:
    return human(n) if n else "-"


def show(plan: Plan, unchecked: str | None = None) -> list[RenderableType | str]:
    """The per-layer table and the totals; `unchecked` says why byte counts went unchecked."""
    why = any(l.why for l in plan.layers)
    slot = {t.layer: t.slot for t in plan.prefetch.schedule} if plan.prefetch else {}
    shown = kinds(plan)
    rows = [[l.name, *(_bytes(getattr(l, k)) for k in shown), slot.get(l.name, "-"), _bytes(l.h2d),
             f"{l.us / 1e3:.3f}", *([l.why or ""] if why else [])] for l in plan.layers]
    s = plan.summary
    total = ["total", *(human(getattr(s, f"{k}_bytes")) for k in shown), "",
             human(s.predicted_h2d_bytes_per_step), f"{plan.cost.gpu_us / 1e3:.3f}" if plan.cost else "",
             *([""] if why else [])]
    out: list[RenderableType | str] = [
        f"plan for {plan.checkpoint_path}: {plural(plan.tensors, 'tensor')}, {human(plan.total_bytes)}"
        + (f" ({human(s.gpu_bytes + s.uva_bytes + s.prefetch_bytes + s.cpu_bytes)} on each GPU)"
           if plan.parallel else "")
        + f", backend {plan.backend.value}", *([parallel_review.headline(plan.parallel)] if plan.parallel else []), "",
        table(["layer", *shown, "slot", "h2d/step", "gpu ms", *(["why"] if why else [])],
              rows, total, "l" + "r" * (len(shown) + 3) + ("l" if why else "")), ""]
    if plan.prefetch:
        p = plan.prefetch
        out.append(f"prefetch: {plural(len(p.schedule), 'layer')}, step {p.step}, {plural(p.slots, 'slot')} x "
                   f"{human(p.slot_bytes)} = {human(p.pool_bytes)} of GPU buffers")
    if plan.prefill:
        st = plan.prefill
        slots = (f"copy their uva tensors through {plural(st.slots, 'slot')} x {human(st.slot_bytes)} = "
                 f"{human(st.pool_bytes)} of GPU buffers" if st.slots else "hold only routed experts")
        out.append(f"prefill staging: {plural(len(st.layers), 'layer')} {slots} when a forward carries more than "
                   f"{plural(st.above_tokens, 'token')}"
                   + (f"; routed experts stream through a ring of {human(st.ring_bytes)}, allocated by each such "
                      "forward (working memory: in the footprint)" if st.experts else ""))
    out += _footprint(plan)
    if plan.cost:
        c = plan.cost
        bound = max((c.cpu_us, "kernel launches (CPU)"), (c.gpu_us, "the GPU (its kernels and reads)"),
                    (c.link_us, "the host link"))[1]
        mode = "CUDA graph replay" if c.cuda_graphs else "eager"
        ttft = (f"; time to first token (prefill of {plural(c.prompt_tokens, 'token')}) {ms(c.prefill_us)}"
                if c.prompt_tokens else "")
        link = (f"each of the {plan.parallel.gpus} host links carries {human(s.predicted_h2d_bytes_per_step)} per step"
                if plan.parallel else f"{human(s.predicted_h2d_bytes_per_step)} over the link per step")
        eager = (f"; eager, step {ms(c.step_us_in(False))} (launches {ms(c.eager_cpu_us)})"
                 if c.eager_cpu_us is not None else "")
        out.append(f"predicted at batch {c.batch_size}, {mode}, on {c.hardware}: {link}; step {ms(c.step_us)} = "
                   f"max(cpu {ms(c.cpu_us)}, gpu {ms(c.gpu_us)}, link {ms(c.link_us)}), bound by {bound}{eager}"
                   f"{ttft}")
    out += [n if is_warning(n) else f"note: {n}" for n in plan.notes]
    if unchecked:
        out.append(f"note: the layer table is the plan's own, not recomputed from tensor sizes: {unchecked}")
    return out


def _verdict(footprint: int, budget: int) -> str:
    """`fits, 3.3 KiB to spare` or `OVER BUDGET, 1.0 MiB too much`."""
    fits = footprint <= budget
    return f"{'fits' if fits else 'OVER BUDGET'}, {human(abs(budget - footprint))} {'to spare' if fits else 'too much'}"


def _footprint(plan: Plan) -> list[str]:
    """The GPU footprint against the budget (a tensor-parallel plan's: each GPU's against its own), and the host's."""
    s = plan.summary
    budget, each, used = plan.budget_bytes, plan.parallel and plan.parallel.budgets, s.gpu_footprint_bytes
    verdict = "no budget set" if budget is None else f"budget {human(budget)}: {_verdict(used, budget)}"
    if each:
        verdict = "; ".join(f"GPU {i} budget {human(b)}: {_verdict(used, b)}" for i, b in enumerate(each))
    pools = [(s.prefetch_buffer_bytes, "prefetch buffers"), (s.stage_buffer_bytes, "prefill staging buffers"),
             (s.working_peak_bytes, "experts' working memory")]
    parts = "".join(f" + {human(b)} {what}" for b, what in pools if b)
    parts = f"{human(s.gpu_bytes)} resident{parts} = " if parts else ""
    per = " per GPU" if plan.parallel else ""
    out = [f"GPU footprint{per}: {parts}{human(s.gpu_footprint_bytes)} ({verdict})"]
    if s.working_peak_bytes:  # decide/working.py
        runs = ", ".join(f"{what} {human(b)}" for what, b in (
            (f"a decode step at batch {plan.cost.batch_size if plan.cost else 1}", s.working_decode_bytes),
            ("a prefill", s.working_prefill_bytes), ("buffers", s.working_buffer_bytes)) if b)
        out.append(f"experts' working memory{per}: {runs}; the footprint counts the buffers and the larger phase")
    if s.cpu_bytes:
        c = plan.cost
        threads = f" with {c.cpu_threads} threads" if c and c.cpu_threads else ""
        if c and c.cpu_expert_gbps:
            threads += f" (assumed: {c.cpu_expert_gbps:g} GB/s and {c.cpu_expert_sync_us:g} us a call)"
        out.append(f"host CPU{per}: computes {human(s.cpu_bytes)} of routed experts{threads}, kept in host memory")
    offloaded, saved = saving(s)
    if not offloaded:
        out.append(f"host (pinned){per}: nothing offloaded")
        return out
    host = " + ".join(f"{human(b)} {k}" for k, b in (("uva", s.uva_bytes), ("prefetch", s.prefetch_bytes),
                                                     ("cpu", s.cpu_bytes)) if b)
    if saved < 0:  # the buffers and working memory take more than the offloaded bytes free
        out.append(f"host (pinned){per}: {host}; offloading costs {human(-saved)} of GPU memory: the buffers and "
                   "working memory above take more than it moves off the GPU")
        return out
    out.append(f"host (pinned){per}: {host}; offloading saves {human(saved)} of GPU memory "
               f"({percent(saved, offloaded)} of the offloaded bytes" + ("; the buffers and working memory above take "
                                                                          "the rest)" if saved < offloaded else ")"))
    return out


def units_of(layer: Layer, *plans: Mapping[str, Placement]) -> list[tuple[str, tuple[str, ...]]]:
    """A layer's tensors as units, in order: each fused expert group once per combination of the
    placements its tensors have in `plans` (named by the group, and where that splits it, by its
    experts: `model.layers.3.mlp.experts [experts 0-5,7]`, or by the parameters of tensors that hold
    every expert at once: `model.layers.3.mlp.experts [down_proj, down_proj_bias]`), every other
    tensor alone."""
    groups, numbers = group_numbers(layer)
    places = zip(*(map(p.get, layer.params) for p in plans))  # per tensor: its placement in each plan
    members: dict[tuple, list[int]] = {}
    for i, (n, group, where) in enumerate(zip(layer.params, groups, places)):
        members.setdefault((n,) if group is None else (group, where), []).append(i)
    parts = Counter(key[0] for key in members if len(key) == 2)
    out = []
    for key, at in members.items():
        name, names = key[0], tuple(map(layer.params.__getitem__, at))
        if len(key) == 2 and parts[name] > 1:
            experts = {numbers[i] for i in at} - {None}
            stacked = [n[len(name) + 1:] for i, n in zip(at, names) if numbers[i] is None]  # pre-fused parameters
            name += f" [{', '.join(([f'experts {ranges(experts)}'] if experts else []) + stacked)}]"
        out.append((name, names))
    return out


def tensors_data(plan: Plan, sizes: Mapping[str, TensorInfo] | None) -> dict:
    """`plan show --tensors --json`: every tensor, or fused unit, with its placement (and bytes); under tensor
    parallelism one GPU's bytes, and `split`: the dim each GPU holds a share of (parallel_review.split_of)."""
    rows = []
    sizes = share(plan, sizes)
    dims = plan.parallel.dims if plan.parallel else None
    for layer in build_graph(plan.params, plan.stacks).layers:
        for name, members in units_of(layer, plan.params):
            rows.append({"layer": layer.name, "name": name, "tensors": len(members),
                         "placement": plan.params[members[0]].value,
                         "bytes": None if sizes is None else sum(sizes[m].nbytes for m in members),
                         **({} if dims is None else {"split": parallel_review.split_of(members, name, dims)})})
    return {"checkpoint": plan.checkpoint_path, "units": rows}


def show_tensors(plan: Plan, sizes: Mapping[str, TensorInfo] | None, unchecked: str | None) -> list:
    d = tensors_data(plan, sizes)
    rows, last = [], None
    for u in d["units"]:
        local = u["name"][len(u["layer"]) + 1:] or u["name"]
        what = f"{local} (fused: {plural(u['tensors'], 'tensor')})" if u["tensors"] > 1 else local
        rows.append([u["layer"] if u["layer"] != last else "", what, u["placement"],
                     *([human(u["bytes"])] if sizes is not None else []),
                     *([parallel_review.split_text(u["split"])] if plan.parallel else [])])
        last = u["layer"]
    units = len(d["units"])
    grouped = (f" in {plural(units, 'unit')} (a fused expert group is one unit per placement)"
               if units != plan.tensors else "")
    par = plan.parallel
    split = (f"; tensor parallel over {par.gpus} GPUs: bytes are one GPU's share, split the dim each GPU holds "
             f"1/{par.gpus} of" if par else "")
    out: list = [f"plan for {plan.checkpoint_path}: {plural(plan.tensors, 'tensor')}{grouped}, backend "
                 f"{plan.backend.value}{split}", "",
                 table(["layer", "tensor", "placement", *(["bytes"] if sizes is not None else []),
                        *(["split"] if par else [])], rows, align="lll" + "r" * (sizes is not None) + "l")]
    if sizes is None:
        out += ["", f"note: no bytes per tensor: {unchecked}"]
    return out
