"""The several-GPUs section (parallel-*.jsonl, benchmarks/parallel.py): N GPUs, each reading its share over its own
link, against one GPU and against the floor of the links measured together."""
from __future__ import annotations

from .records import RESULTS, fmt, read_rows


def parallel_tables() -> list[str]:
    out = []
    for path in sorted(RESULTS.glob("parallel-*.jsonl")):
        rows = read_rows(path)
        run = next(r for r in rows if r["kind"] == "run")
        decode = [r for r in rows if r["kind"] == "decode"]
        link = decode[0]["link"]
        cpu = any(r.get("cpu_share") for r in decode)  # benchmarks/parallel.py --cpu-shares
        base = decode[0].get("cpu_share") or 0  # the share of the run's one-GPU baseline (its first)
        fp8, b = run.get("fp8", False), run.get("fp8_block") or 128  # records before fp8_block: 128
        out += [f"## {run['model']}{' FP8' * fp8}: tensor parallelism over {max(r['gpus'] for r in decode)} GPUs of "
                f"one host{' (experts partly on cpu)' * cpu}", "",
                f"`{path.name}` (`benchmarks/parallel.py`; {run['layers'] or 'all its'} decoder layers; {run['device']}, "
                f"{run['gpus_on_host']} on the host; torch {run['torch']}). "
                + ("Every other decoder layer streamed (prefetch, step 2)" if link == "h2d" else
                   "Every routed expert in pinned memory (uva)")
                + (", but `share on cpu` of each layer's experts computed by the host CPU (`place: cpu`): each process "
                   "its share of them, with `threads` of the host's (the plan's `cpu_threads`); the floor is still "
                   "the all-uva plan's (above 1x, the host's cores add to the links), and `x 1 GPU` and the tokens are "
                   f"against one GPU with {f'{base:.0%} on cpu' if base else 'every expert on uva'}; tokens also part "
                   "where the host sums its experts in its own order" if cpu else "")
                + (f", the checkpoint block-scaled FP8 ({b} x {b} blocks): each process holds its share of every "
                   "split weight and of its scales as stored, and the floor counts those bytes" if fp8 else "")
                + ". Each process measured its own link while the others measured theirs; floor: the bytes a step "
                "moves over each link over that link's rate, at the slowest process. Decode steps replayed from a "
                "CUDA graph, greedy. Tokens: the steps that agree with the one-GPU run's before the first "
                "difference (the GPUs sum each split projection in another order). Memory: each process's peak "
                "during its load against its share's footprint.", "",
                "| GPUs | " + "share on cpu | threads (each) | " * cpu + "batch | steps/s | x floor | x 1 GPU | "
                "predicted steps/s | link GB/s (each) | tokens as 1 GPU's "
                "| load peak - footprint | load s (mean of the processes) |", "|---" * (10 + 2 * cpu) + "|"]
        for r in decode:
            rates = r["h2d_copy_gbps"] if link == "h2d" else r["uva_read_gbps"]
            extra = max(r["load_peak_bytes"]) - r["footprint_bytes"]
            shares = f"{r['cpu_share']:.0%} | {r['cpu_threads'] or '-'} | " if cpu else ""
            out.append(f"| {r['gpus']} | {shares}{r['batch']} | {r['steps_per_s']:.1f} | {fmt(r['ratio_to_floor'])} | "
                       f"{fmt(r['speedup'])} | {fmt(r['predicted_steps_per_s'], '.1f')} | "
                       f"{', '.join(f'{g:.1f}' for g in rates)} | {r['tokens_agree_steps']} of {r['new_tokens']} "
                       f"steps | {extra / 2**20:+.0f} MiB | {fmt(r.get('load_seconds'))} |")
        out.append("")
    return out
