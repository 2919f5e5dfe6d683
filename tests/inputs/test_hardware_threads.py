"""A hardware profile's host rates keep the threads they were measured with (`cpu_rates_threads`), and a plan with
experts on cpu whose profile runs other threads says so: the cost model reads the rates as they are, and a host's
rate is not proportional to its threads (docs/host-experts/, run5)."""
from __future__ import annotations

import dataclasses

from headeronly import moe_toy, tp_checkpoint, write_policy
from offplan.cli import main
from planner.decide.build import build
from planner.inputs.hardware import H100, dumps_hardware, load_hardware
from planner.inputs.policy import load_policy
from synthetic import write_header_only

CPU_RULE = "rules:\n  - match: [experts]\n    place: cpu\n"
UVA_RULE = "rules:\n  - match: [experts]\n    place: uva\n"
WARNS = ("warning: experts on cpu with 2 host threads (the hardware profile's cpu_threads), predicted with host "
         "rates measured with 15 (75 GB/s beside UVA reads): a host's rate is not proportional to its threads (8 "
         "took 1.39-1.63x the time of 15 on an H200 machine's host, docs/host-experts/), so the plan's figures for "
         "them may not hold; calibrate with the threads the plan will run (`plan calibrate --cpu-threads 2`), or "
         "give cpu_threads: 15 where the host has the cores")


def test_a_profile_keeps_the_threads_its_host_rates_were_measured_with(tmp_path):
    assert H100.cpu_rates_threads == H100.cpu_threads == 15
    calibrated = dataclasses.replace(H100, cpu_threads=7, cpu_rates_threads=7)  # as `plan calibrate` makes it
    text = dumps_hardware(calibrated)
    assert "cpu_threads: 7\n" in text and "cpu_rates_threads: 7\n" in text  # in every profile written
    (tmp_path / "hw.yaml").write_text(text)
    assert load_hardware(tmp_path / "hw.yaml") == calibrated
    (tmp_path / "hw.yaml").write_text(text.replace("cpu_threads: 7\n", "cpu_threads: 3\n"))  # edited by hand
    assert (load_hardware(tmp_path / "hw.yaml").cpu_threads, load_hardware(tmp_path / "hw.yaml").cpu_rates_threads) \
        == (3, 7)
    (tmp_path / "hw.yaml").write_text(text.replace("cpu_rates_threads: 7\n", ""))  # written before the key
    assert load_hardware(tmp_path / "hw.yaml").cpu_rates_threads == 7  # its cpu_threads, whose rate it gives
    edited = dataclasses.replace(H100, cpu_threads=8)  # as benchmarks/harness/host_rows.py copies a profile
    assert (edited.cpu_threads, edited.cpu_rates_threads) == (8, 15)
    (tmp_path / "hw.yaml").write_text(dumps_hardware(edited))
    assert load_hardware(tmp_path / "hw.yaml") == edited
    # by hand: without cpu_expert_gbps, the built-in rate's 15; with it, the threads given beside it
    core = "h2d_copy_gbps: 50\nuva_read_gbps: 45\nhbm_read_gbps: 3000\nlayer_overhead_us: 500\n"
    for body, want in (("cpu_threads: 2\n", (2, 15)), ("cpu_threads: 2\ncpu_expert_gbps: 20\n", (2, 2)),
                       ("cpu_expert_gbps: 20\n", (15, 15)), ("cpu_threads: 4\ncpu_expert_sync_us: 40\n", (4, 15)),
                       ("cpu_threads: 4\ncpu_expert_alone_gbps: 30\n", (4, 15)),
                       ("cpu_threads: 2\ncpu_rates_threads: 4\n", (2, 4)), (core + "cpu_threads: 4\n", (4, 15)),
                       (core + "cpu_threads: 4\ncpu_expert_gbps: 20\n", (4, 4))):
        (tmp_path / "hand.yaml").write_text("format_version: 1\nname: a host\n" + body)
        hw = load_hardware(tmp_path / "hand.yaml")
        assert (hw.cpu_threads, hw.cpu_rates_threads) == want, body
    two = H100.one_of(2)  # each process its share of the threads, at its share of the rates
    assert (two.cpu_threads, two.cpu_rates_threads) == (7, 7)


def test_a_plan_with_experts_on_cpu_warns_when_its_threads_are_not_its_rates(tmp_path, capsys):
    write_header_only(tmp_path / "ckpt", moe_toy(3))
    (tmp_path / "two.yaml").write_text("format_version: 1\nname: two cores\ncpu_threads: 2\n")
    (tmp_path / "measured.yaml").write_text("format_version: 1\nname: two cores\ncpu_threads: 2\n"
                                            "cpu_expert_gbps: 20\n")
    notes = {}
    for hw in ("two", "measured"):
        for rule in (CPU_RULE, UVA_RULE):
            name = f"{hw}-{rule.split()[-1]}"
            policy = write_policy(tmp_path, f"hardware: {hw}.yaml\n" + rule, name=f"{name}.policy.yaml")
            notes[name] = build(load_policy(policy), tmp_path).notes
    assert notes["two-cpu"][-1] == WARNS
    assert not any(WARNS[:40] in n for key in ("two-uva", "measured-cpu", "measured-uva") for n in notes[key])
    # the CLI: the plan is written (exit 0), the warning on stderr once
    assert main(["build", str(tmp_path / "two-cpu.policy.yaml"), "-o", str(tmp_path / "p.plan.yaml")]) == 0
    err = capsys.readouterr().err
    assert err.count(WARNS) == 1 and (tmp_path / "p.plan.yaml").is_file()


def test_over_several_gpus_the_warning_is_of_the_whole_hosts_profile(tmp_path):
    """Each GPU's process gets its share of the threads and rates (hardware.py `one_of`, made alike): the warning
    is of the profile as given, before the share."""
    tp_checkpoint(tmp_path / "ckpt")
    (tmp_path / "hw.yaml").write_text("format_version: 1\nname: four cores\ncpu_threads: 4\n")
    plan = build(load_policy(write_policy(tmp_path, "gpus: 2\nhardware: hw.yaml\n" + CPU_RULE)), tmp_path)
    assert plan.cost.cpu_threads == 2
    assert [n for n in plan.notes if n.startswith("warning: experts on cpu with 4 host threads")] == [
        WARNS.replace("with 2 host", "with 4 host").replace("--cpu-threads 2", "--cpu-threads 4")]

