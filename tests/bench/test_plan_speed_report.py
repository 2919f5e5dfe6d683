"""benchmarks/reporting/plan_speed.py: the planning-speed section of RESULTS.md, from synthetic records of
benchmarks/plan_speed.py in a scratch results folder; and the benchmark itself on a small checkpoint."""
from __future__ import annotations

import json
import sys

from decode_bench import ROOT

if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))

from reporting.plan_speed import plan_speed_tables  # noqa: E402


def timing(model, what, median, ratio, rss=None):
    return dict(kind="timing", model=model, what=what, median_s=median, runs_s=[median], ratio_to_scan=ratio,
                target={"build": 2.0, "check": 1.5}.get(what), peak_rss_mb=rss)


def profile(command, order, rank, function, cum, own, total=3.0):
    return dict(kind="profile", model="deepseek-v3", command=command, order=order, total_s=total, rank=rank,
                function=function, ncalls=1, tottime_s=own, cumtime_s=cum)


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_one_row_per_model_and_run_the_before_run_first_and_where_the_time_went(tmp_path):
    run = dict(kind="run", python="3.11.7", machine="x86_64", cpu="Some CPU", cpus=2, planner="/x/planner", repeat=3)
    write(tmp_path / "plan-speed-after.jsonl", [
        {**run, "label": "after", "note": "this tree"},
        timing("deepseek-v3", "header scan", 0.3, 1.0), timing("deepseek-v3", "build", 0.6, 2.0, 180),
        timing("deepseek-v3", "check", 0.45, 1.5, 190), timing("deepseek-v3", "show", 1.2, 4.0),
        timing("deepseek-v3", "diff", 2.7, 9.0)])
    write(tmp_path / "plan-speed-before.jsonl", [
        {**run, "label": "before", "note": "main at abc1234"},
        timing("deepseek-v3", "header scan", 0.3, 1.0), timing("deepseek-v3", "build", 9.0, 30.0, 230),
        timing("deepseek-v3", "check", 15.0, 50.0, 245),
        profile("build", "cumulative", 0, "cli.py:152(main)", 2.9, 0.0),
        profile("build", "cumulative", 1, "groups.py:163(whole_groups)", 1.5, 0.1),
        profile("build", "own", 0, "groups.py:166(<genexpr>)", 0.8, 0.8)])
    lines = plan_speed_tables(tmp_path)
    assert lines[0] == "## Planning speed: `plan build` and `plan check` against reading the headers"
    assert lines[4] == ("- `before` (`plan-speed-before.jsonl`): main at abc1234; Some CPU, 2 CPUs, Python 3.11.7, "
                        "3 repetitions")
    assert lines[5].startswith("- `after` (`plan-speed-after.jsonl`): this tree;")
    start = lines.index("|---|---|---|---|---|---|---|---|")
    assert lines[start + 1:start + 3] == [  # a run without show and diff timed shows none
        "| deepseek-v3 | before | 0.300 s | 9.000 s (30.00x) | 15.000 s (50.00x) | - | - | 230 / 245 MB |",
        "| deepseek-v3 | after | 0.300 s | 0.600 s (2.00x) | 0.450 s (1.50x) | 1.200 s (4.00x) | 2.700 s (9.00x) | "
        "180 / 190 MB |"]
    assert lines[start + 4:start + 6] == [
        "`before`: over target: deepseek-v3 build 30.00x (target 2.0x); deepseek-v3 check 50.00x (target 1.5x).",
        "`after`: every target met."]
    assert ("Where the time went, `before`, deepseek-v3, `plan build` (3.00 s under cProfile): "
            "`groups.py:163(whole_groups)` 1.50 s; by own time: `groups.py:166(<genexpr>)` 0.80 s") in lines


def test_no_records_no_section(tmp_path):
    assert plan_speed_tables(tmp_path) == []


def test_the_benchmark_writes_its_records(tmp_path, monkeypatch, capsys):
    """plan_speed.py end to end on a 4-layer DeepSeek-V3, one repetition: what the section reads."""
    import plan_speed
    import synthetic
    monkeypatch.setattr(synthetic, "small_deepseek", lambda: synthetic.deepseek_v3(
        layers=4, dense_layers=1, hidden=256, intermediate=512, experts=8, moe_intermediate=128, heads=4,
        q_lora=128, kv_lora=64, nope=32, rope=16, v_head=32, vocab=512), raising=False)
    monkeypatch.setitem(plan_speed.MODELS, "small", ("small_deepseek", 2**20,
                                                     {**plan_speed.MODELS["deepseek-v3"][2], "num_hidden_layers": 4}))
    assert plan_speed.main(["--dir", str(tmp_path / "ckpt"), "--models", "small", "-n", "1", "--profile",
                            "--out", str(tmp_path), "--label", "after", "--note", "a test"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "plan-speed-after.jsonl").read_text().splitlines()]
    assert rows[0]["kind"] == "run" and rows[0]["label"] == "after" and rows[0]["note"] == "a test"
    assert {r["what"] for r in rows if r["kind"] == "timing"} == {"header scan", "build", "check", "show", "diff"}
    assert {(r["command"], r["order"]) for r in rows if r["kind"] == "profile"} == {
        (c, o) for c in ("build", "check") for o in ("cumulative", "own")}
    assert "| small | after |" in "\n".join(plan_speed_tables(tmp_path))
