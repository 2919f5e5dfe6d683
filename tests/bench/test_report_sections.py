"""benchmarks/reporting/front_door.py, parallel.py and memory.py: their RESULTS.md sections, from synthetic records in a
scratch results folder (each run's eager rows against its own all-GPU eager rate; batch-8 rows of plans with host
experts not set against a prediction that assumes other routing; each GPU count against the floor and one GPU; a
tensor-parallel memory run said to be per GPU); report.py's --help writes nothing."""
from __future__ import annotations

import json
import sys

import pytest

from decode_bench import ROOT

if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))

import reporting.front_door as front_door  # noqa: E402
import reporting.memory as memory  # noqa: E402
import reporting.parallel as parallel  # noqa: E402

RUN = dict(kind="run", model="qwen3-30b-a3b", layers=8, device="NVIDIA H200", torch="2.11.0", new_tokens=32,
           prompt="The capital", hardware={"uva_read_gbps": 50.0, "h2d_copy_gbps": 55.0})


def decode(strategy, path, batch, rate, loop, mode="graph", floor=None, predicted=None, uva=0, same=True, paired=None,
           prefetch=0):
    return dict(kind="decode", strategy=strategy, path=path, batch=batch, mode=mode, steps_per_s=rate,
                ratio_to_loop=rate / loop, same_tokens_as_loop=same, floor_steps_per_s=floor,
                predicted_steps_per_s=predicted, gpu_bytes=1, uva_bytes=uva, prefetch_bytes=prefetch,
                paired_eager_steps_per_s=paired)


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_each_front_door_run_is_its_own_table_with_its_own_bounds(tmp_path, monkeypatch):
    monkeypatch.setattr(front_door, "RESULTS", tmp_path)
    write(tmp_path / "front-door-qwen3-30b-a3b-a.jsonl", [
        RUN, decode("gpu", "generate --eager", 1, 80.0, 400.0, "eager", predicted=100.0),
        decode("experts-uva", "loop", 1, 78.0, 78.0, floor=84.0, predicted=75.0, uva=9),
        decode("experts-uva", "generate --eager", 1, 70.0, 78.0, "eager", floor=84.0, predicted=75.0, uva=9),
        decode("experts-uva", "apply", 8, 69.0, 70.0, predicted=12.6, uva=9, same=False)])
    write(tmp_path / "front-door-qwen3-30b-a3b-b.jsonl", [
        RUN, decode("gpu", "generate --eager", 1, 60.0, 400.0, "eager", predicted=100.0),
        decode("gpu-fp8", "generate --eager", 1, 50.0, 400.0, "eager"),
        decode("experts-uva-fp8", "generate --eager", 1, 45.0, 90.0, "eager", floor=140.0),
        decode("experts-uva", "generate --eager", 1, 36.0, 90.0, "eager", floor=140.0, paired={"gpu": 40.0}),
        decode("prefetch", "generate --eager", 8, 10.0, 10.5, "eager", paired={"gpu": 60.0}, prefetch=5 * 10**9)])
    lines = front_door.front_door_tables()
    assert [l for l in lines if l.startswith("## ")] == [
        "## qwen3-30b-a3b: through the front door (gpu, experts-uva)",
        "## qwen3-30b-a3b: through the front door (gpu, gpu-fp8, experts-uva-fp8, experts-uva, prefetch)"]
    rows = [l for l in lines if l.startswith("| ") and not l.startswith("| plan")]
    assert rows[0] == "| gpu | 1 | generate --eager | eager | 80.0 | 0.200 | 1.00 | - | - | 100.0 | 0.80 | True |"
    # run a's eager experts row against min(its all-GPU eager 80, the floor 84): 70 / 80
    assert rows[2] == ("| experts-uva | 1 | generate --eager | eager | 70.0 | 0.897 | 0.88 | - | 0.83 | 75.0 | 0.93 "
                       "| True |")
    # batch 8 of copies of one prompt: no measured / predicted
    assert rows[3] == "| experts-uva | 8 | apply | graph | 69.0 | 0.986 | - | - | - | 12.6 | - | False |"
    assert rows[4] == "| gpu | 1 | generate --eager | eager | 60.0 | 0.150 | 1.00 | - | - | 100.0 | 0.60 | True |"
    # FP8 rows against the FP8 all-GPU eager rate (45 / 50), and bf16's beside it (45 / 60)
    assert rows[5] == "| gpu-fp8 | 1 | generate --eager | eager | 50.0 | 0.125 | 1.00 | 0.83 | - | - | - | True |"
    assert rows[6] == ("| experts-uva-fp8 | 1 | generate --eager | eager | 45.0 | 0.500 | 0.90 | 0.75 | 0.32 | - | - "
                       "| True |")
    # measured alternating with the all-GPU plan's calls: against those (36 / 40), not its own row's 60
    assert rows[7] == ("| experts-uva | 1 | generate --eager | eager | 36.0 | 0.400 | 0.90 | - | 0.26 | - | - "
                       "| True |")
    # the prefetch plan's floor at any batch: its streamed bytes over the run's H2D rate (55 GB/s / 5 GB = 11/s)
    assert rows[8] == "| prefetch | 8 | generate --eager | eager | 10.0 | 0.952 | 0.91 | - | 0.91 | - | - | True |"


def test_the_parallel_section_sets_each_gpu_count_against_the_floor_and_one_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(parallel, "RESULTS", tmp_path)
    base = dict(kind="decode", batch=1, new_tokens=32, link="uva", footprint_bytes=2**30, h2d_copy_gbps=[55.0],
                tokens_equal_across_ranks=True)
    write(tmp_path / "parallel-qwen3-30b-a3b-x.jsonl", [
        dict(kind="run", model="qwen3-30b-a3b", layers=8, device="NVIDIA H200", gpus_on_host=4, torch="2.11.0"),
        {**base, "gpus": 1, "steps_per_s": 80.0, "ratio_to_floor": 0.95, "speedup": 1.0,
         "predicted_steps_per_s": 73.3, "uva_read_gbps": [50.6], "tokens_agree_steps": 32,
         "load_peak_bytes": [2**30 + 91 * 2**20], "load_seconds": 0.52},
        {**base, "gpus": 2, "steps_per_s": 145.0, "ratio_to_floor": 0.86, "speedup": 1.81,
         "predicted_steps_per_s": None, "uva_read_gbps": [51.1, 51.0], "tokens_agree_steps": 9,
         "load_peak_bytes": [2**30 + 45 * 2**20, 2**30 + 40 * 2**20], "load_seconds": 0.48}])
    lines = parallel.parallel_tables()
    assert lines[0] == "## qwen3-30b-a3b: tensor parallelism over 2 GPUs of one host"
    assert "Every routed expert in pinned memory (uva)" in lines[2]
    assert lines[-3:] == ["| 1 | 1 | 80.0 | 0.95 | 1.00 | 73.3 | 50.6 | 32 of 32 steps | +91 MiB | 0.52 |",
                          "| 2 | 1 | 145.0 | 0.86 | 1.81 | - | 51.1, 51.0 | 9 of 32 steps | +45 MiB | 0.48 |", ""]
    assert "FP8" not in lines[0] + lines[2]
    rows = [json.loads(line) for line in (tmp_path / "parallel-qwen3-30b-a3b-x.jsonl").read_text().splitlines()]
    write(tmp_path / "parallel-qwen3-30b-a3b-x.jsonl", [{**rows[0], "fp8": True}, *rows[1:]])
    lines = parallel.parallel_tables()
    assert lines[0] == "## qwen3-30b-a3b FP8: tensor parallelism over 2 GPUs of one host"
    assert "block-scaled FP8 (128 x 128 blocks)" in lines[2] and "the floor counts those bytes" in lines[2]
    write(tmp_path / "parallel-qwen3-30b-a3b-x.jsonl", [{**rows[0], "fp8": True, "fp8_block": 16}, *rows[1:]])
    assert "block-scaled FP8 (16 x 16 blocks)" in parallel.parallel_tables()[2]


def test_results_md_is_what_report_py_makes_of_the_committed_records():
    """RESULTS.md may not drift from benchmarks/results/: rerun `python benchmarks/report.py` after adding records."""
    import report
    from reporting.dense import load
    results = ROOT / "benchmarks" / "RESULTS.md"
    assert report.render(load(), (ROOT / "benchmarks" / "decode.png").is_file()) == results.read_text()


def test_the_memory_section_says_when_its_figures_are_each_gpus(tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "RESULTS", tmp_path)
    run = dict(kind="run", model="qwen3-30b-a3b", layers=8, device="NVIDIA H200", torch="2.11.0", prompt_tokens=8192,
               new_tokens=64)
    row = dict(kind="memory", strategy="mixed", footprint_bytes=2e9, working_buffer_bytes=1e7, working_decode_bytes=0,
               working_prefill_bytes=5e8, peak_bytes=4e9, offplan_peak_bytes=1.9e9, ratio_to_footprint=0.95)
    write(tmp_path / "memory-qwen3-30b-a3b.jsonl", [run, row])
    skipped = dict(kind="skipped", strategy="experts-cpu", reason="experts on cpu are one GPU's only")
    write(tmp_path / "memory-qwen3-30b-a3b-2gpu.jsonl", [{**run, "gpus": 2}, row, skipped])
    lines = memory.memory_tables()  # by file name: the 2-GPU run's first
    assert lines[0] == "## qwen3-30b-a3b: does the GPU budget hold on each of 2 GPUs?"
    assert "Tensor parallel over 2 GPUs (`gpus: 2`)" in lines[2] and "its fullest GPU's" in lines[2]
    assert lines[5:10] == ["|---|---|---|---|---|---|", "| mixed | 2.000 | 0.510 | 4.000 | 1.900 | 0.950 |", "",
                           "Not run: experts-cpu (experts on cpu are one GPU's only).", ""]
    assert lines[10] == "## qwen3-30b-a3b: does the GPU budget hold?" and "Tensor parallel" not in lines[12]
    assert not any(line.startswith("Not run") for line in lines[10:])


def test_report_py_help_prints_its_usage_and_writes_nothing(capsys, monkeypatch):
    import report
    written = []
    monkeypatch.setattr(report, "write_atomic", lambda *a, **k: written.append(a))
    with pytest.raises(SystemExit) as exit_:
        report.main(["--help"])
    assert exit_.value.code == 0 and "RESULTS.md" in capsys.readouterr().out and not written
