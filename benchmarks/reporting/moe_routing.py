"""Where a MoE decode step's time goes and how routing shapes it: GPU time per kernel by placement
(moe-kernels-*.jsonl, benchmarks/moe_kernels.py), how well pre-gating guesses the next layer's experts
(moe-predict-*.jsonl, benchmarks/moe_predict.py), and per-expert budgets under skewed routing (moe.py --skew)."""
from __future__ import annotations

from pathlib import Path

from .records import RESULTS, fmt, read_rows, run_header


def kernel_tables() -> list[str]:
    """moe_kernels.py: GPU time per kernel of one graph-replayed batch-1 decode step, per placement."""
    path = RESULTS / "moe-kernels-qwen3-30b-a3b.jsonl"
    rows = read_rows(path)
    steps = [r for r in rows if r["kind"] == "step"]
    if not steps:
        return []
    gather = {}  # the experts' gathers: with the lookahead (one tensor a launch), and without (a module's at once)
    for r in rows:
        if r["kind"] == "kernel" and r["kernel"] in ("_gather_kernel", "_gather_many_kernel"):
            gather[r["name"]] = gather.get(r["name"], 0) + r["us"]
    out = ["### Where a batch-1 step's time goes", "",
           f"`{path.name}` (`python benchmarks/moe_kernels.py --layers 8 --skew 0.7 --resident 0.25 0.5 "
           "--compiled`): one decode step replayed 50 times under `torch.profiler`; every kernel's GPU time summed. "
           "The gather is offplan's experts gather (runtime/execute/gather.py), which reads host experts through the "
           "zero-copy view; gaps: the step's time less its kernels' (the GPU idle between a graph's kernels). The "
           "replayed step repeats one token, so the budget plans' bytes are those of that token's experts.", "",
           "| placement | step us | kernels | kernel us | gather us | other kernels us | gaps us | pinned MB per step "
           "| gather GB/s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in steps:
        g = gather.get(r["name"], 0.0)
        rate = f"{r['host_bytes_per_step'] / g / 1e3:.1f}" if g and r["name"].startswith("experts-host") else "-"
        out.append(f"| {r['name']} | {r['step_us']:.0f} | {r['kernels']} | {r['kernel_us']:.0f} | {g:.0f} | "
                   f"{r['kernel_us'] - g:.0f} | {r['gap_us']:.0f} | {r['host_bytes_per_step'] / 1e6:.0f} | {rate} |")
    host = next((r for r in steps if r["name"] == "experts-host-offplan"), None)
    comp = next((r for r in steps if r["name"] == "experts-host-offplan-compiled"), None)
    if host and comp:
        out += ["", f"With every expert in pinned memory the gather reads at the UVA rate: the link is saturated "
                f"while it runs. The rest, {host['step_us'] - gather['experts-host-offplan']:.0f} us a step "
                f"({comp['step_us'] - gather['experts-host-offplan-compiled']:.0f} us compiled), is attention, "
                "routing, the experts' GEMVs over the staged rows and the head, and it cannot overlap the gather: "
                "a layer's experts are known only after its router runs, and the next layer needs their output. "
                "That is what kept batch 1 under 0.95x the floor (the floor counts only the link). This profile "
                "was taken before the runtime read guessed experts ahead in that time "
                "(runtime/execute/lookahead.py; its "
                "gain: the batch-1 table above)."]
    return out + [""]


def predict_tables() -> list[str]:
    """moe_predict.py: how often the next layer's router, applied to this layer's experts input, names experts
    that the next layer's router then picks."""
    runs = {p.name: read_rows(p) for p in sorted(RESULTS.glob("moe-predict-qwen3-30b-a3b*.jsonl"))}
    if not runs:
        return []
    first = next(iter(runs.values()))[0]
    out = ["### Predicting the next layer's experts", "",
           "`python benchmarks/moe_predict.py --layers 8` (and `--skew 0.7`): greedy decode of "
           f"{first['decode_steps']} steps, all on the GPU; for each of the {first['layers'] - 1} pairs of "
           "consecutive MoE layers, the next layer's router applied to this layer's experts input (pre-gating) "
           f"names its top S experts; the share of them among the {first['top_k']} the next layer's router then "
           "picks. Random weights, not a trained model.", "",
           "| routing | " + " | ".join(f"top {r['predicted']}" for r in next(iter(runs.values()))) + " |",
           "|---|" + "---|" * len(next(iter(runs.values())))]
    for name, rows in runs.items():
        label = "uniform (random weights)" if rows[0]["skew"] is None else f"RouterSkew {rows[0]['skew']:g}"
        out.append(f"| {label} | " + " | ".join(f"{r['precision']:.1%}" for r in rows) + " |")
    out += ["", "At batch 1 the link idles for about 250 us a layer (\"Where a batch-1 step's time goes\"), time "
            "enough for one or two experts of this shape (9.4 MB each). The runtime reads the top 2 guessed "
            "experts of the next layer ahead in that time (runtime/execute/lookahead.py): on a side stream, once the "
            "layer's gather is done, by one kernel of 8 programs (51 GB/s, the SMs left to the compute stream), "
            "rank by rank until the next layer's gather needs the link, which then takes the guessed experts' "
            "completed blocks from HBM. An earlier trial with a gather of a full grid on the side stream held the "
            "SMs and slowed the compute stream's small kernels tenfold; one that always read two whole experts "
            "outlasted the idle time.", ""]
    return out


def skew_tables() -> list[str]:
    """moe-qwen3-30b-a3b-skew*.jsonl: the run with the random model's own routing first, then with --spread."""
    paths = sorted(RESULTS.glob("moe-qwen3-30b-a3b-skew*.jsonl"), key=lambda p: ("spread" in p.name, p.name))
    return [line for p in paths for line in _skew_table(p)]


def _skew_table(path: Path) -> list[str]:
    rows = read_rows(path)
    if not rows:
        return []
    skew = next(r for r in rows if r["kind"] == "skew")
    spread = next((r for r in rows if r["kind"] == "spread"), None)
    prof = next(r for r in rows if r["kind"] == "profile")
    budget = [r for r in rows if r["kind"] == "decode" and "resident_fraction" in r]
    gpu = {r["batch"]: r for r in rows if r["kind"] == "prediction"}
    title = "" if spread is None else f", each token routed apart (`--spread {spread['strength']:g}`)"
    out = [f"## Qwen3-30B-A3B (MoE), skewed routing{title}: per-expert placement under a GPU budget", "",
           f"Random weights route almost uniformly; real routers do not. Here every router sees a fixed bias "
           f"(benchmarks/harness/routers.py `RouterSkew`, strength {skew['strength']}): expert logits move by "
           f"-{skew['strength']} sigma ln(rank), ranks in a random order per layer. It is synthetic. Strength 0.7 "
           "was picked in a simulation over Gaussian logits (44% of the experts take 90% of the hits) to match "
           "published counts for Qwen3-30B-A3B (llama.cpp imatrix counts: 58 of 128 experts, 45%, on a narrow "
           "workload, 65 on a diverse one). On this model the routing profile, "
           f"recorded on other prompts than the timed ones ({prof['decode_tokens']} decode tokens), gives 90% of "
           f"the decode hits to {prof['experts_for_90pct']:.0f} of 128 experts (the simulation: 56), "
           f"{prof['top_quarter_share']:.0%} to the top quarter, {prof['top_half_share']:.0%} to the top half."
           + ("" if spread is None else
              " The routers also see harness/routers.py's `RouterSpread`: a random model's hidden states collapse "
              "with depth, "
              "so each of its sequences routes to a few experts of its own; spread, each token is routed apart, "
              "as a trained router does, and the timed prompts route as the profile's did. The spread widens the "
              "logits about 2.2x (noise of twice the input's RMS), so the bias needs about that much more "
              "strength for the same skew."), "",
           "- " + run_header(path, rows), "",
           "Each budget holds the dense weights and the given share of the expert bytes. Per expert: `backend: "
           "mixed` with the profile in `workload.routing`, which keeps the most-hit experts of every layer on the GPU. "
           "Whole layers: every expert of the first layers on uva, the rest on the GPU, the same bytes resident "
           "(the best whole-layer plan here: reading a layer's touched experts in place moves fewer bytes than "
           "copying the layer). Both plans predict graph replay (`workload.cuda_graphs: true`); graph replay "
           "measured; link MB/step observed = the bytes of host experts routing touched per step on the timed "
           "prompts.", "",
           "Predicted: the plan's own prediction (planner/decide/cost.py, with the hardware calibrated in the run, GPU "
           "time per layer included); predicted / measured: 1.00 is exact, above 1 optimistic. At observed bytes: "
           "the same prediction with the link bytes the timed prompts actually read (the observed bytes over the "
           "run's UVA rate in place of the predicted ones): what is left of the miss is the model's arithmetic, "
           "not the routing.", "",
           *(["`budget-per-expert-cpu`: the same budget with `cpu_experts: true`: of the experts the budget leaves "
              "off the GPU, the plan puts a share on cpu, computed by the host's cores beside the link "
              "(runtime/execute/host/); x without cpu: against the per-expert row. Its predictions at other "
              "batches than 1 are left out where the same policy built for that batch splits otherwise; its "
              "tokens are not compared (the host sums in another order).", ""]
             if any(r["name"].startswith("budget-per-expert-cpu") for r in budget) else []),
           "| experts resident | batch | placement | steps/s | x whole layers | x without cpu | predicted steps/s | "
           "predicted / measured | link MB/step: observed / predicted | predicted at observed bytes / measured | "
           "tokens equal |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    uva = next(r for r in rows if r["kind"] == "hardware")["uva_read_gbps"] * 1e3  # bytes per us
    by = {(r["name"].rsplit("-", 1)[0], r["resident_fraction"], r["batch"]): r for r in budget}
    worst, ratios = 0.0, []
    for (name, fraction, b), r in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        whole, plain = by.get(("whole-layers-uva", fraction, b)), by.get(("budget-per-expert", fraction, b))
        mb = r["predicted_h2d_bytes_per_step"].get(str(b))
        guess, got = r["predicted_steps_per_s"], r["steps_per_s"]
        at_observed = None if guess is None else 1e6 / (1e6 / guess + (r["observed_h2d_bytes_per_step"] - mb) / uva)
        if guess is not None:
            worst = max(worst, abs(at_observed / got - 1))
            ratios.append(guess / got)
        equal = "-" if r["same_tokens"] is None else "yes" if r["same_tokens"] else "NO"
        out.append(f"| {fraction:.0%} | {b} | {name} | {got:.1f} | {got / whole['steps_per_s']:.2f} | "
                   f"{fmt(plain and got / plain['steps_per_s'])} | {fmt(guess, '.1f')} | "
                   f"{fmt(guess and guess / got)} | {r['observed_h2d_bytes_per_step'] / 1e6:.0f} / "
                   f"{fmt(mb and mb / 1e6, '.0f')} | {fmt(at_observed and at_observed / got)} | {equal} |")
    if gpu:
        out += ["", "For the all-GPU plan the model predicts " + ", ".join(
                    f"{g['predicted_steps_per_s']:.0f} steps/s at b={b} where {g['best_gpu_implementation']} "
                    f"measured {g['best_gpu_steps_per_s']:.0f} "
                    f"({g['predicted_steps_per_s'] / g['best_gpu_steps_per_s']:.2f})" for b, g in sorted(gpu.items())) +
                ". Its GPU time per layer is calibrated at batch 1 (`plan calibrate`: graph-replayed tiny models), "
                "so larger batches, whose kernels take longer, are predicted optimistic. "
                + (f"Predicted / measured spans {min(ratios):.2f} to {max(ratios):.2f} over the budget rows; at the "
                   f"observed bytes, within {worst:.0%} in every row." if spread is not None else
                   "Its link bytes hold for whole layers. Per expert, the timed prompts (one sequence at b=1, eight "
                   "at b=8, greedy decodes of random tokens) hit more of the experts the profile ranked low than the "
                   "profile's own prompts did, up to 2x the predicted bytes at 50% resident, where they are tens of "
                   f"MB; at the observed bytes the prediction is within {worst:.0%} of the measurement in every "
                   "row.")]
    host = [r for r in rows if r["kind"] == "decode" and r["name"] == "experts-host-offplan"]
    if host:
        out += ["", "Every expert in pinned memory, in the same run (the floor from the unique experts the skewed "
                "routing touches): " + ", ".join(f"b={r['batch']} {r['steps_per_s']:.1f} steps/s "
                                                 f"({r['ratio_to_floor']:.2f} x floor)" for r in host) + "."]
    return out + [""]
