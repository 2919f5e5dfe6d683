"""The llama.cpp section (peers-*.jsonl, benchmarks/peers.py): offplan and llama.cpp on the same weights, one run."""
from __future__ import annotations

from .records import RESULTS, read_rows


def rows_table(records: list[dict]) -> list[str]:
    """One line per row of a peers run (and per skipped group, saying why), as peers.py prints it last."""
    out = ["| row | batch or prompt tokens | offplan's decode step | offplan | llama.cpp | offplan / llama.cpp | "
           "llama.cpp command |", "|---|---|---|---|---|---|---|"]
    for r in records:
        if r["kind"] == "row":
            out.append(f"| {r['what']} | {r['n']} | {r.get('mode', 'graph') if 'decode' in r['what'] else '-'} | "
                       f"{r['offplan']:.1f} | "
                       f"{'-' if r['llama_cpp'] is None else format(r['llama_cpp'], '.1f')} | "
                       f"{'-' if r['ratio'] is None else format(r['ratio'], '.2f')} | "
                       f"{'`' + r['command'] + '`' if r.get('command') else '-'} |")
        elif r["kind"] == "skipped":
            out.append(f"| skipped: {r['what']} ({r['why']}) | | | | | | |")
    return out


def peers_tables() -> list[str]:
    """peers-*.jsonl: each run's rows, under what ran them (the llama.cpp build, the threads, the GPU)."""
    out = []
    for path in sorted(RESULTS.glob("peers-*.jsonl")):
        records = read_rows(path)
        run = next(r for r in records if r["kind"] == "run")
        build = run.get("llama_cpp") or {}
        rows = [r for r in records if r["kind"] == "row"]
        compiled = any(r.get("mode", "").startswith("compiled") for r in rows)
        computed = any("gpu_compute_bytes" in r for r in rows)
        out += [f"## {path.stem.removeprefix('peers-')}: offplan beside llama.cpp, same weights, one run", "",
                f"`{path.name}` ({run['layers']} decoder layers, random bf16, {run['device']}, torch "
                f"{run['torch']}): {build.get('source') or 'llama.cpp ' + str(build.get('build_commit'))} "
                f"(backends {build.get('backends', '-')}, llama-bench's flash attention setting "
                f"{build.get('flash_attn', '-')}: -1 is auto; build.sh leaves out its flash-attention CUDA kernels "
                "unless LLAMA_CUDA_FA=ON, "
                f"{run['threads']} threads) reads a GGUF written from the same safetensors checkpoint "
                "(`benchmarks/peers/to_gguf.py`). offplan decodes through the runtime's generation (each step "
                "replayed from a CUDA graph, as `plan apply` runs"
                + ("; rows marked compiled-graph compile the step with torch.compile first, as `plan apply --compile` "
                   "runs" if compiled else "") + ") with every routed expert on uva, or (the split rows, "
                "where the run has them) with its plan's share of them on cpu, computed by the host's cores beside "
                "the link (`backend: mixed`, `cpu_experts: true`, the all-uva plan's GPU footprint as the budget); "
                "llama.cpp computes the experts of `--n-cpu-moe` layers on the host's cores. Equal GPU memory: offplan's "
                "`mixed` plan gets the GPU bytes llama.cpp reports for its model"
                + (" and compute buffers, set up for a 512-token prompt (its weights and working memory; offplan's "
                   "budget counts its own working memory for that prompt too; neither counts the KV cache)"
                   if computed else "")
                + " at that `--n-cpu-moe` (and the host's cores, where its plan says `cpu_experts`). Rates: "
                f"steps/s for decode ({run['new_tokens']} new tokens), tokens/s for prefill.", ""]
        out += rows_table(records) + [""]
    return out
