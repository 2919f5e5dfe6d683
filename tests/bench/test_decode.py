"""benchmarks/decode.py on the CPU: every offplan strategy decodes the all-GPU model's greedy tokens."""
from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from decode_bench import load_benchmark, run_decode  # noqa: E402


def test_decode_benchmark_runs_on_the_cpu(tmp_path):
    code, records = run_decode(tmp_path, "--device", "cpu", "--batches", "1", "2",
                               "--strategies", "uva", "uva-64b", "prefetch", "mixed")
    assert code == 0
    assert {(r["name"], r["batch"]) for r in records} == {
        (name, b) for name in ("gpu", "uva-0.5", "uva-64b-0.5", "prefetch-0.5", "mixed-0.5", "gpu-end") for b in (1, 2)}
    assert all(r["same_tokens"] and r["steps_per_s"] > 0 for r in records)


def test_moe_benchmark_runs_on_the_cpu(tmp_path):
    import json
    moe = load_benchmark("moe")  # with benchmarks/ on sys.path: moe.py imports benchmarks/harness/
    code = moe.main(["--model", "tiny", "--layers", "2", "--device", "cpu", "--batches", "1", "2",
                     "--new-tokens", "2", "--modes", "eager", "--dir", str(tmp_path / "work"),
                     "--out", str(tmp_path / "out"), "--skew", "0.7", "--resident", "0.5", "--budget-batches", "1",
                     "--spread", "2"])
    assert code == 0
    rows = [json.loads(l) for l in (tmp_path / "out" / "moe-tiny-skew0.7-spread2.jsonl").read_text().splitlines()]
    assert {"kind": "spread", "strength": 2.0, "seed": 11} in rows
    # skewed routing: the profile (other prompts than the timed ones) says so, and the budget plans keep
    # the same bytes resident, per expert or per layer, with the same tokens as the all-GPU model
    profile = next(r for r in rows if r["kind"] == "profile")
    assert profile["layers"] == 2 and profile["top_quarter_share"] > 0.25 + 0.1
    budget = {r["name"]: r for r in rows if r["kind"] == "decode" and "resident_fraction" in r}
    assert set(budget) == {"budget-per-expert-0.5", "budget-per-expert-cpu-0.5", "whole-layers-uva-0.5"}
    per_expert, whole = budget["budget-per-expert-0.5"], budget["whole-layers-uva-0.5"]
    # the budget also holds the experts' working memory, which at a prefill is a whole layer's experts and their
    # ring: more than this tiny model saves by offloading, so the mixed plan keeps every expert on the GPU
    # (on Qwen3-30B-A3B's shapes it keeps the most-hit ones: RESULTS.md)
    assert whole["uva_bytes"] > 0 and whole["observed_h2d_bytes_per_step"] > 0
    assert per_expert["uva_bytes"] == per_expert["prefetch_bytes"] == per_expert["observed_h2d_bytes_per_step"] == 0
    assert budget["budget-per-expert-cpu-0.5"]["cpu_bytes"] == 0  # no expert on uva: none to try on cpu
    runs = {(r["name"], r["implementation"], r["batch"]) for r in rows if r["kind"] == "decode"}
    assert ("experts-host-offplan", "offplan", 2) in runs and ("gpu-grouped_mm", "grouped_mm", 1) in runs
    assert all(r["same_tokens"] for r in rows if r["kind"] == "decode" and r["implementation"] != "eager")
    assert {r["batch"] for r in rows if r["kind"] == "floor"} == {1, 2}


def test_prefill_benchmark_runs_on_the_cpu(tmp_path):
    """prefill.py on the tiny MoE with a staging threshold of 8 tokens and the routers spread: a 16-token prompt
    is staged under the uva plans (experts too, or not), a 4-token one is not; every plan gives all-GPU's logits
    and tokens, beside the planner's prediction."""
    import dataclasses
    import json

    from planner.inputs.hardware import H100, dumps_hardware
    hw = tmp_path / "hw.yaml"
    # launch overheads of 1 us: the tiny layers' predicted prefill is then their reads, not their launches
    hw.write_text(dumps_hardware(dataclasses.replace(H100, stage_above_tokens=8, cpu_threads=1, layer_overhead_us=1.0,
                                                     moe_layer_overhead_us=1.0)))
    code = load_benchmark("prefill").main([
        "--model", "tiny", "--layers", "4", "--device", "cpu", "--tokens", "4", "16", "--new-tokens", "2",
        "--hardware", str(hw), "--dir", str(tmp_path / "work"), "--out", str(tmp_path / "out"), "--spread", "2"])
    assert code == 0
    rows = [json.loads(l) for l in (tmp_path / "out" / "prefill-tiny-spread2.jsonl").read_text().splitlines()]
    assert {"kind": "spread", "strength": 2.0, "seed": 11} in rows
    pre = {(r["strategy"], r["tokens"]): r for r in rows if r["kind"] == "prefill"}
    assert {s for s, _ in pre} == {"gpu", "uva", "uva-gathered", "uva-in-place", "prefetch", "mixed", "experts-host",
                                   "experts-host-gathered", "experts-cpu"}
    assert {s: r["staged_experts"] for (s, t), r in pre.items() if t == 16 and s.startswith(("uva", "experts"))} == {
        "uva": True, "uva-gathered": False, "uva-in-place": False, "experts-host": True, "experts-host-gathered": False,
        "experts-cpu": True}
    # experts on cpu: 16 tokens staged through the ring (all-GPU's logits), 4 computed by the host (which sums in
    # another order: not compared), and the link floor counts the touched ones, as for experts-host
    assert pre["experts-cpu", 16]["link_bytes"] == pre["experts-host", 16]["link_bytes"] > 0
    host = {("experts-cpu", 4)}
    # the experts of layers 2 and 3 stream through the ring, which the slots (and the footprint) do not hold
    assert pre["uva", 16]["stage_buffer_bytes"] == pre["uva-gathered", 16]["stage_buffer_bytes"] > 0
    assert pre["uva", 16]["ring_bytes"] > 0 == pre["uva-gathered", 16]["ring_bytes"]
    assert all(r["same_logits"] and r["predicted_ms"] is not None for k, r in pre.items() if k not in host)
    assert (pre["uva", 16]["staged_layers"], pre["uva", 4]["staged_layers"]) == (2, 0)  # layers 2 and 3 of 4
    assert pre["uva-in-place", 16]["staged_layers"] == 0 and pre["uva", 16]["stage_buffer_bytes"] > 0
    # read in place, 16 tokens re-read each weight twice (ceil(16 / 8)); staged, they are copied once
    assert pre["uva-in-place", 16]["predicted_ms"] > pre["uva", 16]["predicted_ms"]
    assert all(r["same_tokens"] for r in rows if r["kind"] == "decode" and r["strategy"] != "experts-cpu")


def test_moe_predict_benchmark_runs_on_the_cpu(tmp_path):
    """moe_predict.py on the tiny MoE: one record per number of predicted experts, over every decode step of
    every prompt (the prompt's own forward is not a decode step), each a share between 0 and 1."""
    import json
    code = load_benchmark("moe_predict").main([
        "--model", "tiny", "--layers", "3", "--device", "cpu", "--prompts", "2", "--new-tokens", "4", "--skew", "0.7",
        "--dir", str(tmp_path / "work"), "--out", str(tmp_path / "out")])
    assert code == 0
    rows = [json.loads(l) for l in (tmp_path / "out" / "moe-predict-tiny-skew0.7.jsonl").read_text().splitlines()]
    assert [r["predicted"] for r in rows] == [1, 2, 4]  # the tiny model routes top-2 of 8
    assert all(r["decode_steps"] == 2 * 3 and 0 <= r["precision"] <= 1 for r in rows)


def test_a_benchmark_checkpoint_is_reused_only_at_the_depth_asked_for(tmp_path):
    """A run with `--layers 8` over a `--dir` that holds a 48-layer checkpoint measured the 48 layers, saying 8."""
    import json
    load_benchmark("front_door")  # benchmarks/ on the path
    from harness.checkpoints import make_checkpoint
    directory = make_checkpoint("tiny", 2, tmp_path / "ckpt", "cpu")
    index = (directory / "model.safetensors.index.json").stat().st_mtime_ns
    assert make_checkpoint("tiny", 2, directory, "cpu") == directory
    assert (directory / "model.safetensors.index.json").stat().st_mtime_ns == index  # reused
    make_checkpoint("tiny", 3, directory, "cpu")
    assert json.loads((directory / "config.json").read_text())["num_hidden_layers"] == 3
    assert len(list(directory.glob("*.safetensors"))) == 4  # a shard per layer and one for the rest
