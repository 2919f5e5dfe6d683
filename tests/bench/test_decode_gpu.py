"""benchmarks/decode.py, moe.py, moe_kernels.py, prefill.py, front_door.py and memory.py on CUDA (marked `gpu`): every
eager and graph replay, same tokens as all-GPU."""
from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from decode_bench import load_benchmark, run_decode  # noqa: E402
from planner.inputs.hardware import H100, dumps_hardware, load_hardware  # noqa: E402

pytestmark = pytest.mark.gpu


def test_decode_benchmark_runs_every_strategy_on_cuda(tmp_path):
    profile = tmp_path / "h100.yaml"
    profile.write_text(dumps_hardware(H100))  # calibration has a test of its own
    code, records = run_decode(tmp_path, "--device", "cuda", "--batches", "1", "4", "--accelerate-batches", "1",
                               "--modes", "eager", "graph", "--hardware", str(profile),
                               "--strategies", "accelerate", "uva", "uva-64b", "prefetch", "mixed")
    assert code == 0
    eager = {(r["name"], r["batch"]) for r in records if r.get("mode", "eager") == "eager"}
    graph = {r["name"] for r in records if r.get("mode") == "graph"}
    assert eager == {(n, b) for n in ("gpu", "uva-0.5", "uva-64b-0.5", "prefetch-0.5", "mixed-0.5", "gpu-end")
                     for b in (1, 4)} | {("accelerate-0.5", 1)}
    assert graph == {"gpu", "uva-0.5", "uva-64b-0.5", "prefetch-0.5", "mixed-0.5", "gpu-end"}
    assert all(r["same_tokens"] for r in records), [r["name"] for r in records if not r["same_tokens"]]


def test_moe_benchmark_runs_on_cuda(tmp_path):
    """moe.py on a tiny Qwen3-MoE: every baseline, experts in pinned memory, the skewed budget plans, in graph
    replay and eagerly; the bytes it counts from pinned memory are the plan's uva experts actually touched."""
    import json
    profile = tmp_path / "h100.yaml"
    profile.write_text(dumps_hardware(H100))
    moe = load_benchmark("moe")
    code = moe.main(["--model", "tiny", "--layers", "4", "--batches", "1", "8", "--new-tokens", "4",
                     "--hardware", str(profile), "--dir", str(tmp_path / "work"), "--out", str(tmp_path / "out"),
                     "--modes", "graph", "eager", "--skew", "0.7", "--resident", "0.5", "--budget-batches", "1", "8",
                     "--profile-prompts", "8"])
    # batch 1 under torch.compile and graph replay: transformers alone, the plan applied, experts on host
    compiled = moe.main(["--model", "tiny", "--layers", "2", "--batches", "1", "--new-tokens", "4",
                         "--hardware", str(profile), "--dir", str(tmp_path / "work2"), "--out", str(tmp_path / "out2"),
                         "--modes", "compiled-graph", "--baselines", "batched_mm", "--transformers-baselines",
                         "batched_mm", "--host-implementations", "offplan"])
    assert code == 0
    rows = [json.loads(l) for l in (tmp_path / "out" / "moe-tiny-skew0.7.jsonl").read_text().splitlines()]
    decoded = [r for r in rows if r["kind"] == "decode"]
    assert {(r["name"], r["mode"]) for r in decoded} >= {
        ("transformers-batched_mm", "graph"), ("gpu-batched_mm", "graph"), ("experts-host-offplan", "graph"),
        ("experts-host-offplan", "eager"), ("budget-per-expert-0.5", "graph"), ("whole-layers-uva-0.5", "graph")}
    assert all(r["same_tokens"] for r in decoded if r["implementation"] != "eager")
    whole = [r for r in decoded if r["name"] == "whole-layers-uva-0.5"]
    assert all(r["observed_h2d_bytes_per_step"] > 0 for r in whole)
    assert compiled == 0
    rows = [json.loads(l) for l in (tmp_path / "out2" / "moe-tiny.jsonl").read_text().splitlines()]
    decoded = {r["name"]: r for r in rows if r["kind"] == "decode"}
    assert set(decoded) == {"transformers-batched_mm", "gpu-batched_mm", "experts-host-offplan"}
    assert all(r["mode"] == "compiled-graph" and r["same_tokens"] for r in decoded.values())


def test_moe_kernels_benchmark_runs_on_cuda(tmp_path, capsys):
    """moe_kernels.py on a tiny Qwen3-MoE: every placement's replayed step is profiled, its kernels add up to
    at most the step, and with experts in pinned memory the gather is among them."""
    import json
    code = load_benchmark("moe_kernels").main([
        "--model", "tiny", "--layers", "2", "--steps", "5", "--skew", "0.7", "--resident", "0.5", "--compiled", "--top", "1000",
        "--dir", str(tmp_path / "work"), "--out", str(tmp_path / "out")])
    assert code == 0
    rows = [json.loads(l) for l in (tmp_path / "out" / "moe-kernels-tiny.jsonl").read_text().splitlines()]
    steps = {r["name"]: r for r in rows if r["kind"] == "step"}
    assert set(steps) == {"gpu-batched_mm", "experts-host-offplan", "budget-per-expert-0.5",
                          "gpu-batched_mm-compiled", "experts-host-offplan-compiled"}
    assert all(0 < r["kernel_us"] <= r["step_us"] * 1.05 and r["kernels"] > 0 for r in steps.values())
    assert steps["experts-host-offplan"]["host_bytes_per_step"] > 0
    assert any(r["kind"] == "kernel" and r["name"] == "experts-host-offplan"
               and r["kernel"] in ("_gather_kernel", "_gather_many_kernel") for r in rows)


def test_prefill_benchmark_runs_on_cuda(tmp_path):
    """prefill.py on the tiny MoE on CUDA, with a staging threshold of 8 tokens: every plan's prefill gives all-GPU's
    logits, the uva plan stages its layers above the threshold only, and decode (eager and graph replay) matches."""
    import dataclasses
    import json
    profile = tmp_path / "h100.yaml"
    profile.write_text(dumps_hardware(dataclasses.replace(H100, stage_above_tokens=8)))
    code = load_benchmark("prefill").main([
        "--model", "tiny", "--layers", "4", "--tokens", "4", "64", "--new-tokens", "4", "--hardware", str(profile),
        "--dir", str(tmp_path / "work"), "--out", str(tmp_path / "out")])
    assert code == 0
    rows = [json.loads(l) for l in (tmp_path / "out" / "prefill-tiny.jsonl").read_text().splitlines()]
    pre = {(r["strategy"], r["tokens"]): r for r in rows if r["kind"] == "prefill"}
    # experts on cpu: 64 tokens staged through the ring (all-GPU's logits); 4 computed by the host, and its decode
    # steps (another order of summation: not compared)
    assert all(r["same_logits"] for k, r in pre.items() if k != ("experts-cpu", 4))
    assert (pre["uva", 64]["staged_layers"], pre["uva", 4]["staged_layers"]) == (2, 0)
    assert pre["experts-cpu", 64]["staged_experts"] and pre["experts-cpu", 64]["cpu_bytes"] > 0
    decoded = [r for r in rows if r["kind"] == "decode"]
    assert {r["mode"] for r in decoded} == {"eager", "graph"}
    assert all(r["same_tokens"] for r in decoded if r["strategy"] != "experts-cpu")


def test_front_door_benchmark_runs_on_cuda(tmp_path):
    """front_door.py on a tiny Qwen3-MoE: for every strategy, plan apply (its own process), handle.generate
    replayed and eager, and the benchmark loop, against the loop, with the plan's predictions; transformers'
    generate for the experts-on-uva plan; offplan's rows give the loop's tokens."""
    import json
    profile = tmp_path / "h100.yaml"
    profile.write_text(dumps_hardware(H100))  # calibration has a test of its own
    code = load_benchmark("front_door").main(["--model", "tiny", "--layers", "2", "--new-tokens", "6",
                                              "--batches", "1", "--apply-calls", "1", "--hardware", str(profile),
                                              "--dir", str(tmp_path / "work"), "--out", str(tmp_path / "out")])
    assert code == 0
    rows = [json.loads(l) for l in (tmp_path / "out" / "front-door-tiny.jsonl").read_text().splitlines()]
    assert rows[0]["kind"] == "run" and rows[0]["hardware"]["uva_read_gbps"] == H100.uva_read_gbps
    assert rows[0]["prompts"] == ["The capital of France is"]  # the first B of the distinct prompts
    decoded = {(r["strategy"], r["path"]): r for r in rows[1:]}
    strategies = ("gpu", "gpu-fp8", "uva", "prefetch", "mixed", "experts-uva", "experts-uva-fp8", "experts-split")
    assert set(decoded) == {(s, p) for s in strategies for p in ("loop", "generate", "generate --eager", "apply")} \
        | {("experts-uva", "transformers")}
    assert all(r["steps_per_s"] > 0 and r["batch"] == 1 for r in decoded.values())
    assert all(r["same_tokens_as_loop"] for (s, p), r in decoded.items() if p != "transformers")
    assert all(decoded[s, "generate"]["predicted_steps_per_s"] > 0 for s in strategies)  # the plan's own workload
    assert all(decoded[s, "generate --eager"]["predicted_steps_per_s"] > 0 for s in strategies  # an eager plan's,
               if s not in ("mixed", "experts-split"))  # none where it places otherwise, as mixed's may
    assert decoded["experts-uva", "apply"]["floor_steps_per_s"] > 0
    assert decoded["experts-uva-fp8", "loop"]["uva_bytes"] < decoded["experts-uva", "loop"]["uva_bytes"]


def test_moe_benchmark_measures_experts_on_cpu_replayed_and_eager(tmp_path):
    """moe.py --cpu-fractions and --cpu-split (harness/host_rows.py) on a tiny Qwen3-MoE: rows with half and all of
    every layer's experts on cpu, in graph replay (plain and compiled) and eagerly, each with the host's time per
    module forward, every call by native.cpp; and the plan's own split at each batch."""
    import json
    profile = tmp_path / "h100.yaml"
    profile.write_text(dumps_hardware(H100))
    modes = ("graph", "compiled-graph", "eager")
    code = load_benchmark("moe").main([
        "--model", "tiny", "--layers", "2", "--batches", "1", "4", "--new-tokens", "4", "--hardware", str(profile),
        "--dir", str(tmp_path / "work"), "--out", str(tmp_path / "out"), "--modes", *modes,
        "--baselines", "batched_mm", "--transformers-baselines", "--host-implementations", "offplan",
        "--cpu-fractions", "0.5", "1", "--cpu-threads", "2", "--cpu-split"])
    assert code == 0
    rows = [json.loads(l) for l in (tmp_path / "out" / "moe-tiny.jsonl").read_text().splitlines()]
    host = {(r["name"], r["mode"], r["batch"]): r for r in rows if r["kind"] == "decode" and "cpu_fraction" in r
            and not r.get("split_by_plan")}
    assert set(host) == {(f"experts-cpu{f}-t2", m, b) for f in ("0.5", "1") for m in modes for b in (1, 4)}
    split = {(r["name"], r["mode"], r["batch"]) for r in rows if r.get("split_by_plan")}
    assert split == {(f"experts-split-b{b}", m, b) for m in modes for b in (1, 4)}
    assert all(r["steps_per_s"] > 0 and r["host_mean_us"] > 0 and r["host_kernel"].startswith("native ")
               and r["kernel_misses"] == 0 and r["cpu_threads"] == 2 for r in host.values())
    assert all(r["host_decode_calls"] >= 2 * 3 for r in host.values())  # 2 layers x the 3 timed steps at least
    # the 2 threads' rows are predicted from the host's figures measured with 2 threads, once in the run
    calibrated = [r for r in rows if r["kind"] == "host-calibration"]
    assert [(r["cpu_threads"], r["cpu_rates_threads"]) for r in calibrated] == [(2, 2)]
    assert calibrated[0]["cpu_expert_gbps"] > 0 and calibrated[0]["rounds"] == 4
    hw2 = load_hardware(tmp_path / "work" / "moe-tiny" / "hw-t2.yaml")
    assert (hw2.cpu_threads, hw2.cpu_rates_threads, hw2.cpu_expert_gbps) == (2, 2, calibrated[0]["cpu_expert_gbps"])


def test_memory_benchmark_measures_every_plan_against_its_footprint(tmp_path):
    """memory.py on a tiny Qwen3-MoE, a prompt above the staging threshold: every strategy loaded and generated
    from, its peak recorded beside a footprint that holds its experts' working memory (the 1% target is judged on
    the real shapes of RESULTS.md: at this size the allocator's workspaces outweigh every plan's bytes)."""
    import json
    code = load_benchmark("memory").main(["--model", "tiny", "--layers", "4", "--prompt-tokens", "200",
                                          "--new-tokens", "4", "--dir", str(tmp_path / "work"),
                                          "--out", str(tmp_path / "out")])
    rows = [json.loads(l) for l in (tmp_path / "out" / "memory-tiny.jsonl").read_text().splitlines()]
    assert code == (1 if any(r.get("ratio_to_footprint", 0) > 1.01 for r in rows) else 0)
    memory = {r["strategy"]: r for r in rows if r["kind"] == "memory"}
    assert set(memory) == set(load_benchmark("memory").STRATEGIES)
    for name, r in memory.items():
        working = r["working_buffer_bytes"] + max(r["working_decode_bytes"], r["working_prefill_bytes"])
        assert r["footprint_bytes"] == r["gpu_bytes"] + r["pool_bytes"] + working and r["peak_bytes"] > 0
        if name != "mixed":  # its placement is the cost model's (graph replay: this tiny model's layers streamed)
            assert (working > 0) == (name not in ("gpu", "prefetch")), name
        assert r["mode"] == "graph" and r["load_peak_bytes"] <= r["peak_bytes"]
