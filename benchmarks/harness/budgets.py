"""moe.py --skew: per-expert placement under a GPU budget against whole layers' experts on uva, with the same
bytes resident, on a routing profile recorded on other prompts than the timed ones; and their table."""
from __future__ import annotations

import statistics
from pathlib import Path

import torch

from .loops import PROMPT_LEN
from .routers import hit_shares


def record_profile(run, plan: Path) -> Path:
    """Record a routing profile with the all-GPU model on `--profile-prompts` prompts other than the timed
    ones, `--new-tokens` each."""
    from planner.inputs.routing import write_profile
    from runtime.measure.routing import checkpoint_groups, record_routing
    model, handle = run.load(plan, None)
    seed = 99
    ids = torch.randint(3, run.vocab, (run.args.profile_prompts, PROMPT_LEN),
                        generator=torch.Generator().manual_seed(seed))
    try:
        profile = record_routing(model, list(ids), run.args.new_tokens,
                                 checkpoint_fingerprint=run.info.fingerprint, checkpoint_path="ckpt",
                                 source=f"random token ids, seed {seed}",
                                 keys=checkpoint_groups(model, run.info))
    finally:
        handle.remove(restore=False)
        del model, handle
    path = run.work / "routing.yaml"
    write_profile(path, profile)
    layers = [hit_shares(list(h.decode)) for h in profile.layers.values()]
    run.record(kind="profile", path=str(path), layers=len(layers), decode_tokens=profile.decode_tokens,
                **{k: statistics.fmean(l[k] for l in layers) for k in layers[0]})
    return path


def measure_budgets(run, profile: Path) -> None:
    """Per `--resident` fraction: per-expert placement under a budget (the profile ranks the experts), without
    and with experts on cpu, against whole layers' experts on uva, with the same bytes resident."""
    from planner.planfile import load_plan

    from .plans import experts_working_bytes
    layer_experts = run.experts * run.expert_bytes
    dense = run.info.total_bytes - run.layers * layer_experts
    workload = f"workload: {{{{batch_size: {{batch}}, routing: {profile.name}, cuda_graphs: true}}}}\n"
    mode = ["graph"] if run.cuda else ["eager"]
    for b in run.args.budget_batches:  # what the cost model makes of the all-GPU plan, beside its measurement
        p = load_plan(run.plan(f"gpu-b{b}", workload.format(batch=b)))
        best = run.best_gpu.get((mode[0], b), (None, None))
        run.record(kind="prediction", name="gpu", batch=b,
                    predicted_steps_per_s=1e6 / max(1, p.summary.predicted_step_us),
                    best_gpu_steps_per_s=best[0], best_gpu_implementation=best[1])
    working = experts_working_bytes(run.work, "format_version: 1\ncheckpoint: ckpt\nhardware: hw.yaml\n",
                                    workload.format(batch=1))  # the budget counts it (planner/decide/working.py)
    for fraction in run.args.resident:
        host = round((1 - fraction) * run.layers)  # layers whose experts whole layers put on uva
        resident = dense + (run.layers - host) * layer_experts + working
        whole = "|".join(map(str, range(host)))
        plans = {
            f"budget-per-expert-{fraction:g}":
                f"backend: mixed\nbudget_gib: {resident / 2**30!r}\n{workload}",
            f"budget-per-expert-cpu-{fraction:g}":  # the host computes a share of the experts left on uva
                f"backend: mixed\ncpu_experts: true\nbudget_gib: {resident / 2**30!r}\n{workload}",
            f"whole-layers-uva-{fraction:g}":
                f"rules:\n  - match: ['re:^model\\.layers\\.({whole})\\.mlp\\.experts\\.']\n"
                f"    place: uva\n{workload}"}
        for name, body in plans.items():
            path = run.plan(name, body.format(batch=1))
            plan = load_plan(path)
            predicted, h2d = {}, {}
            for b in run.args.budget_batches:  # the same placement's prediction at each batch
                p = plan if b == 1 else load_plan(run.plan(f"{name}-b{b}", body.format(batch=b)))
                if p.params == plan.params:
                    h2d[b] = p.summary.predicted_h2d_bytes_per_step
                    if p.summary.predicted_step_us:
                        predicted[b] = 1e6 / p.summary.predicted_step_us
            run.measure(name, path, None, mode, offloaded=True, batches=run.args.budget_batches,
                         predicted=predicted, floor=False, resident_fraction=fraction,
                         gpu_bytes=plan.summary.gpu_bytes, uva_bytes=plan.summary.uva_bytes,
                         prefetch_bytes=plan.summary.prefetch_bytes, predicted_h2d_bytes_per_step=h2d,
                         cpu_bytes=plan.summary.cpu_bytes)


def budget_table(rows: list[dict]) -> None:
    """Per-expert placement against whole layers, per resident fraction and batch (with --skew)."""
    got = {(r["name"].rsplit("-", 1)[0], r["resident_fraction"], r["batch"]): r
           for r in rows if r["kind"] == "decode" and "resident_fraction" in r}
    if not got:
        return

    def f(x, spec=".1f"):
        return "-" if x is None else format(x, spec)
    print("\n| experts resident | batch | placement | steps/s | predicted | link MB/step: observed | predicted "
          "| x whole layers | x per-expert without cpu |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (name, fraction, b), r in got.items():
        whole = got.get(("whole-layers-uva", fraction, b))
        plain = got.get(("budget-per-expert", fraction, b))
        mb = r["predicted_h2d_bytes_per_step"].get(str(b), r["predicted_h2d_bytes_per_step"].get(b))
        print(f"| {fraction:.0%} | {b} | {name} | {r['steps_per_s']:.1f} | {f(r['predicted_steps_per_s'])} | "
              f"{f(r.get('observed_h2d_bytes_per_step', 0) / 1e6)} | {f(mb and mb / 1e6)} | "
              f"{f(whole and r['steps_per_s'] / whole['steps_per_s'], '.2f')} | "
              f"{f(plain and r['steps_per_s'] / plain['steps_per_s'], '.2f')} |")
