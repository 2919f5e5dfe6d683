"""`plan build`, `show` and `diff` of tensor-parallel plans (`gpus:`) through `main(argv)`: one clear error for a
model offplan cannot split, every figure said to be one GPU's share, each GPU's budget, the links, the split
tensors, and what a change of GPUs, split or collectives shows in a diff."""
from __future__ import annotations

import dataclasses
import json

import pytest

from headeronly import tp_checkpoint, write_policy
from planner.inputs.hardware import H100
from planner.plan import Placement
from planner.planfile import load_plan
from planner.planfile.diff import diff_data, diff_text
from test_cli import assert_one_error, run

HEAD = "format_version: 1\ncheckpoint: ./ckpt\n"
# bytes as GiB: each GPU's share of the checkpoint is 100,096 bytes; 80,000 of it on the GPU, and the share's
# experts' working memory (the one expert a token touches, 6 KiB of each GPU's share)
B = (80000 + 6144) / 2**30
ATTN = "model.layers.*.self_attn"


@pytest.fixture
def work(tmp_path, monkeypatch, capsys):
    """cwd = tmp_path holding ckpt/ (headeronly.TP_MOE) and, built: one.plan.yaml (one GPU: layer 0's norm and
    experts 0-1 on uva) and two.plan.yaml (2 GPUs, 86,144 and 172,288 bytes; the same workload)."""
    monkeypatch.chdir(tmp_path)
    tp_checkpoint(tmp_path / "ckpt")
    # 182,016 bytes less the norm (128 B) and 2 experts (12 KiB each), plus the norm's staging slot (256 B) and the
    # experts' working memory on one GPU: the one expert a token touches at top 1 and a one-token prompt
    one = (182016 - 128 - 2 * 12288 + 256 + 12288) / 2**30
    write_policy(tmp_path, f"budget_gib: {one!r}\nworkload: {{experts_per_token: 1, prompt_tokens: 1}}\n",
                 name="one.policy.yaml", head=HEAD)
    write_policy(tmp_path, f"gpus: [{B!r}, {2 * B!r}]\nworkload: {{experts_per_token: 1, prompt_tokens: 1}}\n",
                 name="two.policy.yaml", head=HEAD)
    for name in ("one", "two"):
        assert run(capsys, "build", f"{name}.policy.yaml")[0] == 0
    return tmp_path


def build_refused(capsys, folder, body: str, name: str, error: str) -> None:
    """`plan build NAME.policy.yaml` (in `folder`, the cwd) of `body`: exit 1, `error` alone, no plan written."""
    write_policy(folder, body, name=f"{name}.policy.yaml", head=HEAD)
    assert_one_error(*run(capsys, "build", f"{name}.policy.yaml"), error)
    assert not (folder / f"{name}.plan.yaml").exists()


def test_build_of_a_model_type_offplan_cannot_split_is_one_error_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    tp_checkpoint(tmp_path / "ckpt", model_type="gpt2")
    build_refused(capsys, tmp_path, "gpus: 2\n", "gpt2",
                  "error: gpt2.policy.yaml:3:7: gpus: 2: tensor parallelism cannot split ckpt\n"
                  "  - config.json: model_type 'gpt2': offplan knows transformers' tensor-parallel plan of "
                  "deepseek_v3, glm4_moe, llama, mistral, mixtral, qwen2, qwen3, qwen3_moe only; plan this model on "
                  "one GPU (`gpus: 1`)\n")


def test_show_says_every_figure_is_one_gpus_share(work, capsys):
    code, out, err = run(capsys, "show", "two.plan.yaml")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[:2] == [
        "plan for ckpt/model.safetensors: 45 tensors, 177.8 KiB (97.8 KiB on each GPU), backend uva",
        "tensor parallel over 2 GPUs: each GPU holds 1/2 of 8 kinds of tensor (split), sums the outputs of 2 kinds "
        "of module and gathers lm_head's; 5 collectives per decode step, predicted 0.049 ms (in the GPU time); every "
        "figure below is one GPU's share"]
    assert lines[14:18] == [
        "GPU footprint per GPU: 77.6 KiB resident + 256 B prefill staging buffers + 6.0 KiB experts' working memory = "
        "83.9 KiB (GPU 0 budget 84.1 KiB: fits, 256 B to spare; GPU 1 budget 168.2 KiB: fits, 84.4 KiB to spare)",
        "experts' working memory per GPU: a decode step at batch 1 6.0 KiB, a prefill 6.0 KiB; the footprint counts "
        "the buffers and the larger phase",
        "host (pinned) per GPU: 20.1 KiB uva; offloading saves 13.9 KiB of GPU memory (69% of the offloaded bytes; the "
        "buffers and working memory above take the rest)",
        "predicted at batch 1, CUDA graph replay, on NVIDIA H100 80GB HBM3 (PCIe Gen5 host link): each of the 2 "
        "host links carries 5.1 KiB per step; step 0.336 ms = max(cpu 0.000 ms, gpu 0.336 ms, link 0.000 ms), bound "
        "by the GPU (its kernels and reads); eager, step 3.80 ms (launches 3.80 ms); time to first token (prefill "
        "of 1 token) 3.80 ms"]
    assert lines[18:20] == [
        "note: tensor parallel over 2 GPUs (transformers' plan for model_type qwen3_moe): every figure is one GPU's "
        "share; each GPU reads its share over its own host link (H2D predicted at 49 GB/s each)",
        "note: the GPUs' budgets differ (GPU 0 84.1 KiB, GPU 1 168.2 KiB): the plan fits the smallest, 84.1 KiB, on "
        "every GPU, since each GPU applies the same share; the larger budgets' spare memory goes unused"]
    data = json.loads(run(capsys, "show", "two.plan.yaml", "--json")[1])
    assert data["parallel"] == {
        "layout": "tensor", "gpus": 2, "budgets": [86144, 172288], "collectives_per_step": 5, "collectives_us": 49,
        "split": {f"{ATTN}.q_proj.weight": 0, f"{ATTN}.k_proj.weight": 0, f"{ATTN}.v_proj.weight": 0,
                  f"{ATTN}.o_proj.weight": 1, "model.layers.*.mlp.experts.*.gate_proj.weight": 0,
                  "model.layers.*.mlp.experts.*.up_proj.weight": 0, "model.layers.*.mlp.experts.*.down_proj.weight": 1,
                  "lm_head.weight": 0},
        "reduce": [f"{ATTN}.o_proj", "model.layers.*.mlp.experts"], "gather": ["lm_head"]}
    assert json.loads(run(capsys, "show", "one.plan.yaml", "--json")[1])["parallel"] is None


def test_show_tensors_marks_the_split_ones_and_gives_one_gpus_bytes(work, capsys):
    lines = run(capsys, "show", "two.plan.yaml", "--tensors")[1].splitlines()
    assert lines[0] == ("plan for ckpt/model.safetensors: 45 tensors in 24 units (a fused expert group is one unit per "
                        "placement), backend uva; tensor parallel over 2 GPUs: bytes are one GPU's share, split the "
                        "dim each GPU holds 1/2 of")
    assert lines[2].split() == ["layer", "tensor", "placement", "bytes", "split"]
    assert lines[4:8] == [
        "model.embed_tokens   weight                                          gpu         16.0 KiB   -",
        "model.layers.0       input_layernorm.weight                          uva            128 B   -",
        "                     mlp.experts [experts 0-3] (fused: 10 tensors)   uva         20.0 KiB   dim 0 (gate_proj, "
        "up_proj), dim 1 (down_proj)",
        "                     mlp.experts [experts 3] (fused: 2 tensors)      gpu          4.0 KiB   dim 0 (gate_proj, "
        "up_proj)"]
    assert lines[-1] == ("lm_head              weight                                          gpu          8.0 KiB   "
                         "dim 0")
    units = json.loads(run(capsys, "show", "two.plan.yaml", "--tensors", "--json")[1])["units"]
    assert units[2] == {"layer": "model.layers.0", "name": "model.layers.0.mlp.experts [experts 0-3]", "tensors": 10,
                        "placement": "uva", "bytes": 20480,
                        "split": {"gate_proj.weight": 0, "down_proj.weight": 1, "up_proj.weight": 0}}
    assert (units[0]["split"], units[-1]["split"]) == (None, 0)
    assert "split" not in json.loads(run(capsys, "show", "one.plan.yaml", "--tensors", "--json")[1])["units"][0]


def test_diff_reports_the_gpus_the_split_and_the_collectives(work, capsys):
    code, out, _ = run(capsys, "diff", "one.plan.yaml", "two.plan.yaml", "--detailed-exitcode")
    assert code == 2
    assert out.splitlines()[2:8] == [
        "GPUs: 1 -> 2 (tensor parallel: the new plan's figures are one GPU's share)",
        f"split: now splits 8 kinds of tensor ({ATTN}.q_proj.weight, {ATTN}.k_proj.weight, {ATTN}.v_proj.weight, "
        f"{ATTN}.o_proj.weight and 4 more)",
        f"reduce: now sums the outputs of {ATTN}.o_proj, model.layers.*.mlp.experts",
        "gather: now gathers the outputs of lm_head",
        "collectives per step: 0 -> 5, predicted 0.000 ms -> 0.049 ms",
        "per-GPU budgets: none -> 84.1 KiB, 168.2 KiB"]
    assert "moved: 1 unit (4 tensors) in 1 layer, 8.0 KiB" in out  # the new plan's share of what moved
    d = json.loads(run(capsys, "diff", "one.plan.yaml", "two.plan.yaml", "--json")[1])
    assert d["parallel_changed"] is True
    assert {k: v for k, v in d["parallel"].items() if k != "split"} == {
        "gpus": {"old": 1, "new": 2}, "reduce": {"added": [f"{ATTN}.o_proj", "model.layers.*.mlp.experts"]},
        "gather": {"added": ["lm_head"]}, "budgets": {"old": None, "new": [86144, 172288]},
        "collectives": {"old": {"per_step": 0, "us": 0}, "new": {"per_step": 5, "us": 49}}}
    assert list(d["parallel"]["split"]) == ["added"] and len(d["parallel"]["split"]["added"]) == 8
    assert run(capsys, "diff", "two.plan.yaml", "two.plan.yaml", "--detailed-exitcode")[0] == 0


def test_diff_of_another_split_or_only_other_collectives_is_a_difference(work, capsys):
    """Plain data: the same plan with its head no longer split and its o_proj split along dim 0; then the same
    plan predicted with slower all-reduces. Each differs for --detailed-exitcode."""
    two = load_plan(work / "two.plan.yaml")
    par = two.parallel
    split = tuple((t, 0 if t == f"{ATTN}.o_proj.weight" else d) for t, d in par.split if t != "lm_head.weight")
    other = dataclasses.replace(two, parallel=dataclasses.replace(par, split=split, gather=()))
    d = diff_data(two, other)
    assert (d["same"], d["parallel"]) == (False, {
        "split": {"removed": {"lm_head.weight": 0}, "changed": {f"{ATTN}.o_proj.weight": {"old": 1, "new": 0}}},
        "gather": {"removed": ["lm_head"]}})
    assert diff_text(d)[:2] == [
        f"split: no longer splits 1 kind of tensor (lm_head.weight); splits another dim of {ATTN}.o_proj.weight "
        "(1 -> 0)", "gather: no longer gathers the outputs of lm_head"]
    slower = dataclasses.replace(two, parallel=dataclasses.replace(par, collectives_us=98))
    d = diff_data(two, slower)
    assert (d["same"], d["parallel"]) == (False, {"collectives": {"old": {"per_step": 5, "us": 49},
                                                                  "new": {"per_step": 5, "us": 98}}})
    assert diff_text(d)[0] == "collectives per step: 5 (unchanged), predicted 0.049 ms -> 0.098 ms"


def test_experts_on_cpu_are_planned_as_each_gpus_share_with_its_share_of_the_host(work, capsys):
    """Each GPU's process computes its share of the routed experts on cpu with its share of the host's cores
    (hardware.py `one_of`): the plan names each process's threads, half the profile's on 2 GPUs, counts one GPU's
    share of the experts on cpu, and every reader takes it."""
    write_policy(work, "gpus: 2\nrules:\n  - {match: [experts], place: cpu}\n"
                 "workload: {experts_per_token: 1, prompt_tokens: 1}\n", name="cpu.policy.yaml", head=HEAD)
    assert run(capsys, "build", "cpu.policy.yaml")[0] == 0
    assert run(capsys, "check", "cpu.plan.yaml")[0] == 0
    plan, two = load_plan(work / "cpu.plan.yaml"), load_plan(work / "two.plan.yaml")
    assert plan.cost.cpu_threads == H100.cpu_threads // 2
    experts = [n for n in plan.params if ".experts." in n]
    assert [n for n, p in plan.params.items() if p is Placement.CPU] == experts
    assert plan.summary.cpu_bytes == sum(l.cpu for l in plan.layers) == 4 * 3 * 4096  # 4 experts x 3 x 4 KiB each
    assert plan.summary.cpu_bytes + plan.summary.gpu_bytes == two.summary.gpu_bytes + two.summary.uva_bytes
    out = run(capsys, "show", "cpu.plan.yaml")[1]
    assert out.startswith("plan for ckpt/model.safetensors: 45 tensors, 177.8 KiB (97.8 KiB on each GPU)")
    assert "host CPU per GPU: computes 48.0 KiB of routed experts with 7 threads (assumed: 35 GB/s and 100 us a " \
           "call)" in out


def test_experts_on_cpu_over_more_gpus_than_host_threads_is_one_error(work, capsys):
    """Each GPU's process would get no host thread for its share of the experts on cpu."""
    (work / "one.yaml").write_text("format_version: 1\nname: one core\ncpu_threads: 1\n")
    build_refused(capsys, work, "gpus: 2\nhardware: one.yaml\nrules:\n  - {match: [experts], place: cpu}\n", "few",
                  "error: few.policy.yaml: experts on cpu over 2 GPUs, but the hardware profile's cpu_threads is 1: "
                  "each GPU's process computes its share of the experts with its share of those threads, and would "
                  "get none; use fewer GPUs, a profile of a host with more cores (`plan calibrate`), or leave the "
                  "experts on uva\n  - few.policy.yaml:6:14: rules[0] (place: cpu)\n")
