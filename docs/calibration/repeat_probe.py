"""Raw data behind `plan calibrate`'s figures that moved most between calibrations (issue 25): every round of the
eager step timings and every call of the host kernel's fit, so that estimators can be compared afterwards on the
same numbers. Run it several times, each in its own process, as calibrate runs:

    for i in 1 2 3; do python docs/calibration/repeat_probe.py --out probe-$i.json; done

On a GPU machine, from the checkout's root (PYTHONPATH=.). It measures as runtime/measure/ did when it ran (rounds of
32 and 24 steps, before 64558f2 took the fastest of more, shorter rounds), keeping what those functions reduce to
one figure.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch
from transformers import StoppingCriteriaList

from runtime.execute.generation import PlainHandle
from runtime.execute.host import native
from runtime.measure import host, steps
from runtime.measure.bandwidth import warm_up


def llama_rounds(rounds: int, n_steps: int = 32) -> dict[int, list[list[float]]]:
    """layers -> per round, every decode step's wall time (us) of one eager `generate` (steps._median_step_us)."""
    models = {n: steps.tiny_llama(n) for n in steps.LAYER_COUNTS}
    for model in models.values():
        steps._median_step_us(model, 4)
    out = {n: [] for n in models}
    ids = torch.ones(1, 4, dtype=torch.long, device="cuda")
    for _ in range(rounds):
        for n, model in models.items():
            clock = steps._StepClock()
            with torch.no_grad():
                model.generate(ids, max_new_tokens=n_steps, min_new_tokens=n_steps, do_sample=False, pad_token_id=0,
                               stopping_criteria=StoppingCriteriaList([clock]))
            out[n].append([(b - a) * 1e6 for a, b in zip(clock.times, clock.times[1:])])
    return out


def moe_rounds(rounds: int, n_steps: int = 24) -> dict[int, list[float]]:
    """layers -> per round, the mean eager step (us) of the runtime's generation (steps.generator_step_us_by_layers)."""
    counts = steps.LAYER_COUNTS[:4]
    generators = {n: PlainHandle(steps.tiny_moe_offloaded(n)).generator(eager=True) for n in counts}
    prompt = [[1, 2, 3, 4]]
    for g in generators.values():
        g.prepare(prompt, n_steps + 1)
    out = {n: [] for n in counts}
    for _ in range(rounds):
        for n, g in generators.items():
            got = g(prompt, n_steps + 1)
            out[n].append(got.decode_s / got.decode_steps * 1e6)
    return out


def host_calls(calls: int = 24) -> dict:
    """host._rate's points with every call's time, beside UVA reads and alone, and host._handover's replays."""
    lib = native.library()
    if lib is None:
        return {"why_not": native.why_not}
    pool = native.Pool(lib, host.threads_here())
    try:
        out = {}
        for what, beside in (("beside", host._uva_reads()), ("alone", contextlib.nullcontext())):
            gate_up = torch.full((host.EXPERTS, 2 * host.INTER, host.HIDDEN), 0.01, dtype=torch.bfloat16)
            down = torch.full((host.EXPERTS, host.HIDDEN, host.INTER), 0.01, dtype=torch.bfloat16)
            on_cpu = torch.zeros(host.EXPERTS, dtype=torch.uint8)
            order = torch.randperm(host.EXPERTS, generator=torch.Generator().manual_seed(0))
            points = []
            with beside:
                for tokens, on in host.POINTS * 2:
                    x = torch.full((tokens, host.HIDDEN), 0.5, dtype=torch.bfloat16)
                    y = torch.empty((tokens * host.TOP_K, host.HIDDEN), dtype=torch.bfloat16)
                    ids = torch.empty(tokens * host.TOP_K, dtype=torch.long)
                    job = native.job(pool, gate_up, down, on_cpu, x, ids, y, tokens, host.TOP_K)
                    took = []
                    for c in range(calls):
                        first = c * tokens * host.TOP_K
                        ids.copy_(order[(torch.arange(tokens * host.TOP_K) + first) % host.EXPERTS])
                        on_cpu.zero_()[ids[:on]] = 1
                        start = time.perf_counter()
                        native.run(lib, job)
                        took.append((time.perf_counter() - start) * 1e6)
                    points.append({"tokens": tokens, "on": on, "bytes": on * (gate_up[0].nbytes + down[0].nbytes),
                                   "us": took})
            out[what] = points
        out["handover_us"] = [host._handover(lib, pool) for _ in range(5)]
        return out
    finally:
        pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=14)
    args = parser.parse_args()
    warm_up()
    t0 = time.perf_counter()
    record = {"device": torch.cuda.get_device_name(), "llama": llama_rounds(args.rounds),
              "moe": moe_rounds(args.rounds), "host": host_calls()}
    record["seconds"] = time.perf_counter() - t0
    with open(args.out, "w") as f:
        json.dump(record, f)
    print(f"wrote {args.out} in {record['seconds']:.0f} s")


if __name__ == "__main__":
    main()
