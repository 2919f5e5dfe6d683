"""The `plan` command through `main(argv)`: outputs, exit codes, and one clean error for bad input."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from headeronly import MiB, write_policy
from offplan.cli import main
from planner.inputs.checkpoint import open_checkpoint
from planner.planfile import load_plan

# 18.4 MiB: offload layer 0 (3 MiB) of 21 MiB; read in place at prefill too (staging slots: test_show_prefill)
UVA_POLICY = "budget_gib: 0.018\nuva: {stage_prefill: false}\n"
PREFETCH_POLICY = "prefetch:\n  group_size: 2\n"


@pytest.fixture
def work(tmp_path, toy_ckpt, monkeypatch):
    """cwd = tmp_path holding ckpt/, uva.policy.yaml and prefetch.policy.yaml."""
    monkeypatch.chdir(tmp_path)
    write_policy(tmp_path, UVA_POLICY, name="uva.policy.yaml")
    write_policy(tmp_path, PREFETCH_POLICY, name="prefetch.policy.yaml")
    return tmp_path


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_error(code, out, err, message):
    """Exit 1, a single `error:` line block on stderr, no traceback, nothing on stdout."""
    assert code == 1
    assert out == ""
    assert err.startswith("error: ") and err.count("error: ") == 1
    assert "Traceback" not in err
    assert message in err


def test_build_writes_the_plan_beside_the_policy(work, capsys):
    code, out, err = run(capsys, "build", "uva.policy.yaml")
    assert (code, err) == (0, "")
    assert out == ("wrote uva.plan.yaml: 11 tensors, backend uva; GPU 18.0 MiB, host 3.0 MiB; predicted step "
                   "0.420 ms, prefill of 512 tokens 3.20 ms\n"  # the step replayed; the prefill's launches (cost.py)
                   "note: backend uva (auto: budget_gib is set): 3.0 MiB on uva from 1 layer\n")
    plan = load_plan(work / "uva.plan.yaml")
    assert [n for n, p in plan.params.items() if p.value == "uva"] == [
        "model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.o_proj.weight"]


def test_build_output_options(work, capsys):
    code, out, _ = run(capsys, "build", "uva.policy.yaml", "-o", "-")
    assert code == 0 and out.startswith("# offplan plan") and not (work / "uva.plan.yaml").exists()
    code, out, _ = run(capsys, "build", "uva.policy.yaml", "-o", "x.yaml", "--json")
    data = json.loads(out)
    assert code == 0 and data["plan"] == "x.yaml" and data["backend"] == "uva"
    assert data["summary"]["gpu_footprint_bytes"] == 18 * MiB
    run(capsys, "build", "uva.policy.yaml", "-o", "y.yaml")
    assert (work / "x.yaml").read_bytes() == (work / "y.yaml").read_bytes()


def test_build_prints_policy_warnings(work, capsys):
    write_policy(work, "backend: uva\nuva:\n  offload_gib: 1\nprefetch:\n  group_size: 2\n", name="w.policy.yaml")
    code, out, err = run(capsys, "build", "w.policy.yaml")
    assert code == 0
    assert err == "warning: w.policy.yaml:6:1: prefetch.* is set but backend is uva; it is ignored\n"


SHOW_PREFETCH = """\
plan for ckpt: 11 tensors, 21.0 MiB, backend prefetch

layer                     gpu   uva   prefetch   slot   h2d/step   gpu ms
─────────────────────────────────────────────────────────────────────────
model.embed_tokens    4.0 MiB     -          -      -          -    0.001
model.layers.0        3.0 MiB     -          -      -          -    0.077
model.layers.1              -     -    3.0 MiB      0    3.0 MiB    0.077
model.layers.2        3.0 MiB     -          -      -          -    0.077
model.layers.3              -     -    3.0 MiB      0    3.0 MiB    0.077
model.norm            1.0 MiB     -          -      -          -    0.000
lm_head               4.0 MiB     -          -      -          -    0.001
─────────────────────────────────────────────────────────────────────────
total                15.0 MiB   0 B    6.0 MiB           6.0 MiB    0.359

prefetch: 2 layers, step 1, 1 slot x 3.0 MiB = 3.0 MiB of GPU buffers
GPU footprint: 15.0 MiB resident + 3.0 MiB prefetch buffers = 18.0 MiB (no budget set)
host (pinned): 6.0 MiB prefetch; offloading saves 3.0 MiB of GPU memory (50% of the offloaded bytes; the buffers and working memory above take the rest)
predicted at batch 1, CUDA graph replay, on NVIDIA H100 80GB HBM3 (PCIe Gen5 host link): 6.0 MiB over the link \
per step; step 0.359 ms = max(cpu 0.000 ms, gpu 0.359 ms, link 0.114 ms), bound by the GPU (its kernels and reads); \
eager, step 3.20 ms (launches 3.20 ms); time to first token (prefill of 512 tokens) 3.20 ms
note: backend prefetch (auto: prefetch.group_size is set): 6.0 MiB on prefetch from 2 layers
"""


def test_show(work, capsys):
    run(capsys, "build", "prefetch.policy.yaml")
    assert run(capsys, "show", "prefetch.plan.yaml") == (0, SHOW_PREFETCH, "")
    code, out, _ = run(capsys, "show", "prefetch.plan.yaml", "--json")
    data = json.loads(out)
    assert data["layers"][2] == {"name": "model.layers.1", "gpu": 0, "uva": 0, "prefetch": 3 * MiB, "slot": 0,
                                 "h2d_bytes_per_step": 3 * MiB, "gpu_us": 77, "why": None}
    assert data["prefetch"] == {"step": 1, "slots": 1, "slot_bytes": 3 * MiB, "layers": 2}


def test_show_against_the_budget(work, capsys):
    run(capsys, "build", "uva.policy.yaml")
    _, out, _ = run(capsys, "show", "uva.plan.yaml")
    assert out.splitlines()[-4:-1] == [
        "GPU footprint: 18.0 MiB (budget 18.4 MiB: fits, 442.4 KiB to spare)",
        "host (pinned): 3.0 MiB uva; offloading saves 3.0 MiB of GPU memory (100% of the offloaded bytes)",
        "predicted at batch 1, CUDA graph replay, on NVIDIA H100 80GB HBM3 (PCIe Gen5 host link): 3.0 MiB over the "
        "link per step; step 0.420 ms = max(cpu 0.000 ms, gpu 0.420 ms, link 0.062 ms), bound by the GPU (its kernels "
        "and reads); eager, step 3.20 ms (launches 3.20 ms); time to first token (prefill of 512 tokens) 3.20 ms"]


def test_show_tensors(work, capsys):
    run(capsys, "build", "uva.policy.yaml")
    code, out, err = run(capsys, "show", "uva.plan.yaml", "--tensors")
    assert (code, err) == (0, "")
    assert out == """\
plan for ckpt: 11 tensors, backend uva

layer                tensor                    placement     bytes
──────────────────────────────────────────────────────────────────
model.embed_tokens   weight                    gpu         4.0 MiB
model.layers.0       mlp.down_proj.weight      uva         2.0 MiB
                     self_attn.o_proj.weight   uva         1.0 MiB
model.layers.1       mlp.down_proj.weight      gpu         2.0 MiB
                     self_attn.o_proj.weight   gpu         1.0 MiB
model.layers.2       mlp.down_proj.weight      gpu         2.0 MiB
                     self_attn.o_proj.weight   gpu         1.0 MiB
model.layers.3       mlp.down_proj.weight      gpu         2.0 MiB
                     self_attn.o_proj.weight   gpu         1.0 MiB
model.norm           weight                    gpu         1.0 MiB
lm_head              weight                    gpu         4.0 MiB
"""
    data = json.loads(run(capsys, "show", "uva.plan.yaml", "--tensors", "--json")[1])
    assert data["units"][1] == {"layer": "model.layers.0", "name": "model.layers.0.mlp.down_proj.weight",
                                "tensors": 1, "placement": "uva", "bytes": 2 * MiB}
    # Without the checkpoint the placements still show, and the plan says why bytes do not.
    (work / "ckpt").rename(work / "gone")
    code, out, _ = run(capsys, "show", "uva.plan.yaml", "--tensors")
    lines = out.splitlines()
    assert lines[2].split() == ["layer", "tensor", "placement"]
    assert lines[-1] == "note: no bytes per tensor: its checkpoint ckpt is not at hand"
    _, out, _ = run(capsys, "show", "uva.plan.yaml")
    assert out.splitlines()[-1] == ("note: the layer table is the plan's own, not recomputed from tensor sizes: "
                                    "its checkpoint ckpt is not at hand")


def test_show_tensors_lists_a_fused_expert_group_as_one_unit(tmp_path, monkeypatch, capsys):
    from synthetic import qwen3_moe, write_header_only
    monkeypatch.chdir(tmp_path)
    write_header_only(tmp_path / "ckpt", qwen3_moe(layers=2, experts=4, hidden=64, moe_intermediate=32, heads=4,
                                                   kv_heads=2, head_dim=16, vocab=128), single=True)
    write_policy(tmp_path, "prefetch: {group_size: 2, params: [experts]}\n", name="moe.policy.yaml")
    run(capsys, "build", "moe.policy.yaml")
    lines = run(capsys, "show", "moe.plan.yaml", "--tensors")[1].splitlines()
    assert lines[0] == "plan for ckpt/model.safetensors: 45 tensors in 23 units (a fused expert group is one unit " \
        "per placement), backend prefetch"
    assert lines[6].split() == ["mlp.experts", "(fused:", "12", "tensors)", "gpu", "48.0", "KiB"]
    assert lines[15].split() == ["model.layers.1", "input_layernorm.weight", "gpu", "128", "B"]
    assert lines[16].split() == ["mlp.experts", "(fused:", "12", "tensors)", "prefetch", "48.0", "KiB"]


def test_show_tensors_and_diff_split_a_group_by_placement(tmp_path, monkeypatch, capsys):
    """A budget splits a fused group one expert at a time: show --tensors gives one row per placement, naming the
    experts, and diff moves exactly the experts that moved, with their bytes."""
    from synthetic import qwen3_moe, write_header_only
    monkeypatch.chdir(tmp_path)
    write_header_only(tmp_path / "ckpt", qwen3_moe(layers=2, experts=4, hidden=64, moe_intermediate=32, heads=4,
                                                   kv_heads=2, head_dim=16, vocab=128), single=True)
    total = sum(i.nbytes for i in open_checkpoint(tmp_path / "ckpt").tensors.values())
    expert = 3 * 64 * 32 * 2  # gate, up and down of one expert in bf16: 12 KiB
    for name, shed in (("two", 2), ("three", 3)):  # shed 2, then 3 experts' bytes (layer 0's come first)
        # without staging: its slot for the layer norm the walk moves first would cost one more expert; the
        # footprint counts the experts' working memory: the one expert a token touches at top 1 and a 1-token prompt
        write_policy(tmp_path, f"budget_gib: {(total - shed * expert + expert) / 2**30!r}\nuva: {{stage_prefill: "
                     "false}\nworkload: {experts_per_token: 1, prompt_tokens: 1}\n", name=f"{name}.policy.yaml")
        run(capsys, "build", f"{name}.policy.yaml")
        s = load_plan(tmp_path / f"{name}.plan.yaml").summary
        assert (s.working_decode_bytes, s.working_prefill_bytes, s.working_buffer_bytes) == (expert, expert, 0)
    lines = run(capsys, "show", "three.plan.yaml", "--tensors", "--json")[1]
    units = [u for u in json.loads(lines)["units"] if u["layer"] == "model.layers.0" and "experts" in u["name"]]
    assert [(u["name"], u["placement"], u["tensors"], u["bytes"]) for u in units] == [
        ("model.layers.0.mlp.experts [experts 0-2]", "uva", 9, 3 * expert),
        ("model.layers.0.mlp.experts [experts 3]", "gpu", 3, expert)]
    code, out, _ = run(capsys, "diff", "two.plan.yaml", "three.plan.yaml", "--json")
    moves = json.loads(out)["units"]
    assert [(m["layer"], m["from"], m["to"], m["units"], m["bytes"]) for m in moves] == [
        ("model.layers.0", "gpu", "uva", ["mlp.experts [experts 2]"], expert)]


def test_build_warns_on_stderr_when_a_plan_saves_little(work, capsys):
    write_policy(work, "prefetch: {group_size: 2, step: 2}\n", name="slots.policy.yaml")
    code, out, err = run(capsys, "build", "slots.policy.yaml")
    assert code == 0
    assert err == ("warning: the plan saves little GPU memory: nothing of the 6.0 MiB offloaded; the prefetch "
                   "buffers take 6.0 MiB (2 slots x 3.0 MiB): there are as many slots as prefetched layers (2), "
                   "so each prefetched layer has a slot of its own; lower prefetch.step or prefetch more layers\n")
    assert "warning" not in out
    _, out, _ = run(capsys, "show", "slots.plan.yaml")
    assert out.splitlines()[-1] == err.strip()  # a note of the plan, shown as a warning


def test_the_tiny_example_is_told_its_real_smallest_budget(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    examples = Path(__file__).resolve().parents[2] / "plans" / "examples"
    head = f"format_version: 1\ncheckpoint: {examples / 'tiny-moe'}\n"
    rules = "rules:\n  - match: [embed_tokens]\n    place: uva\n"
    write_policy(tmp_path, "budget_gib: 0.00001\n" + rules, name="small.policy.yaml", head=head)
    code, out, err = run(capsys, "build", "small.policy.yaml")
    assert code == 1
    need, text = re.search(r"needs \S+ KiB \(([\d,]+) bytes\).* is budget_gib: (\S+) \(", err).groups()
    need = int(need.replace(",", ""))
    # lm_head and the final norm stay on the GPU: 64.1 KiB, not the 0.01 GiB it once said; the layers'
    # attention and norms on uva are staged at prefill through 2 slots of 26.0 KiB; the experts' working memory
    # (8 experts of 12 KiB, top 2): the lookahead's 2, and a staged prefill's 8 gathered and the ring of 8
    assert (need, text) == (65664 + 2 * 26624 + (2 + 8 + 8) * 3 * 64 * 32 * 2, "0.00031674")
    write_policy(tmp_path, f"budget_gib: {text}\n" + rules, name="small.policy.yaml", head=head)
    assert run(capsys, "build", "small.policy.yaml")[0] == 0
    assert load_plan(tmp_path / "small.plan.yaml").summary.gpu_footprint_bytes == need
    write_policy(tmp_path, f"budget_gib: {(need - 1) / 2**30!r}\n" + rules, name="small.policy.yaml", head=head)
    assert run(capsys, "build", "small.policy.yaml")[0] == 1


DIFF = """\
backend: uva -> prefetch
policy: uva.policy.yaml -> prefetch.policy.yaml (a different file; its content differs)
budget: 18.4 MiB -> none
GPU footprint: 18.0 MiB (unchanged)
predicted step: 0.420 ms -> 0.359 ms (-0.061 ms, -14.5%)
predicted prefill: 3.20 ms (unchanged)
prefetch: new: streams 2 layers (model.layers.1, model.layers.3) with step 1, 1 slot x 3.0 MiB
moved: 6 tensors in 3 layers, 9.0 MiB
  uva -> gpu: 2 tensors, 3.0 MiB
  gpu -> prefetch: 4 tensors, 6.0 MiB

layer            moved                                                                         gpu        uva   prefetch
────────────────────────────────────────────────────────────────────────────────────────────────────────────────────────
model.layers.0   uva -> gpu 3.0 MiB: mlp.down_proj.weight, self_attn.o_proj.weight        +3.0 MiB   -3.0 MiB          0
model.layers.1   gpu -> prefetch 3.0 MiB: mlp.down_proj.weight, self_attn.o_proj.weight   -3.0 MiB          0   +3.0 MiB
model.layers.3   gpu -> prefetch 3.0 MiB: mlp.down_proj.weight, self_attn.o_proj.weight   -3.0 MiB          0   +3.0 MiB

notes:
  - backend uva (auto: budget_gib is set): 3.0 MiB on uva from 1 layer
  + backend prefetch (auto: prefetch.group_size is set): 6.0 MiB on prefetch from 2 layers
"""


def test_diff_says_when_the_prediction_changes_mode(work, capsys):
    write_policy(work, UVA_POLICY + "workload: {cuda_graphs: false}\n", name="eager.policy.yaml")
    run(capsys, "build", "uva.policy.yaml")
    run(capsys, "build", "eager.policy.yaml")
    out = run(capsys, "diff", "uva.plan.yaml", "eager.plan.yaml")[1]
    assert "predicted for: CUDA graph replay -> eager\n" in out


def test_diff_and_detailed_exitcode(work, capsys):
    run(capsys, "build", "uva.policy.yaml")
    run(capsys, "build", "prefetch.policy.yaml")
    run(capsys, "build", "uva.policy.yaml", "-o", "same.plan.yaml")
    assert run(capsys, "diff", "uva.plan.yaml", "same.plan.yaml", "--detailed-exitcode") == (
        0, "no changes: the plans place every tensor the same way\n", "")
    assert run(capsys, "diff", "uva.plan.yaml", "prefetch.plan.yaml", "--detailed-exitcode") == (2, DIFF, "")
    assert run(capsys, "diff", "uva.plan.yaml", "prefetch.plan.yaml")[0] == 0
    code, out, _ = run(capsys, "diff", "uva.plan.yaml", "prefetch.plan.yaml", "--json")
    d = json.loads(out)
    assert d["same"] is False and d["summary"]["prefetch_bytes"] == 6 * MiB
    assert d["moved"] == {
        "gpu->prefetch": [f"model.layers.{i}.{p}" for i in (1, 3) for p in ("mlp.down_proj.weight", "self_attn.o_proj.weight")],
        "uva->gpu": ["model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.o_proj.weight"]}
    assert d["layers"][0] == {"name": "model.layers.0", "gpu": 3 * MiB, "uva": -3 * MiB, "prefetch": 0}
    assert d["moved_bytes"] == {"gpu->prefetch": 6 * MiB, "uva->gpu": 3 * MiB}
    assert (d["checkpoint_changed"], d["policy_changed"], d["backend_changed"]) == (False, True, True)
    assert d["units"][0] == {"layer": "model.layers.0", "from": "uva", "to": "gpu", "tensors": 2, "bytes": 3 * MiB,
                             "units": ["mlp.down_proj.weight", "self_attn.o_proj.weight"], "sizes": [1, 1]}
    assert d["predicted_step_us"] == {"old": 420, "new": 359}
    assert d["predicted_prefill_us"] == {"old": 3200, "new": 3200}  # launch-bound (cost.py)
    assert (d["prefill"], d["staging_changed"]) == ({}, False)
    assert d["prefetch"] == {"added": {"step": 1, "slots": 1, "slot_bytes": 3 * MiB,
                                       "layers": ["model.layers.1", "model.layers.3"]}}
    code, out, err = run(capsys, "diff", "uva.plan.yaml", "nope.plan.yaml", "--detailed-exitcode")
    assert_one_error(code, out, err, "nope.plan.yaml: no such plan file")


def test_diff_names_schedule_changes_and_plans_elsewhere_compare_by_their_files(work, capsys):
    write_policy(work, "prefetch:\n  group_size: 1\n  step: 2\n", name="s2.policy.yaml")
    write_policy(work, "prefetch:\n  group_size: 2\n  num_in_group: 2\n  step: 3\n", name="s3.policy.yaml")
    run(capsys, "build", "s2.policy.yaml")
    run(capsys, "build", "s3.policy.yaml")
    out = run(capsys, "diff", "s2.plan.yaml", "s3.plan.yaml")[1].splitlines()
    assert out[4] == "prefetch: step 2 -> 3; slots 2 -> 3; 2 layers change slot (model.layers.2 0 -> 2, " \
        "model.layers.3 1 -> 0)"
    (work / "elsewhere").mkdir()
    run(capsys, "build", "s2.policy.yaml", "-o", "elsewhere/s2.plan.yaml")
    assert run(capsys, "diff", "s2.plan.yaml", "elsewhere/s2.plan.yaml", "--detailed-exitcode")[0] == 0
