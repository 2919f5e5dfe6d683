"""A tensor-parallel plan (`gpus: 2`) of a header-only checkpoint: one GPU's share in every byte count, its
`parallel:` section round-tripped and checked against the rest of the plan, the per-GPU budget held, and the
collectives the cost model adds, by hand."""
from __future__ import annotations

import pytest

from headeronly import tp_checkpoint, write_policy
from offplan.cli import main
from planner.decide.build import build
from planner.errors import BudgetError, PlanFileError
from planner.inputs.checkpoint import open_checkpoint
from planner.inputs.hardware import load_hardware
from planner.inputs.policy import load_policy
from planner.layers.shards import local_tensors
from planner.plan import Parallel
from planner.planfile import dumps, loads

HEAD = "format_version: 1\ncheckpoint: ./ckpt\n"
BUDGET = 100000 / 2**30  # 100,000 bytes on each GPU: layer 0's experts (20.1 KiB of each GPU's share) go to uva
ATTN, EXPERTS = "model.layers.*.self_attn", "model.layers.*.mlp.experts"
SPLIT = ((f"{ATTN}.q_proj.weight", 0), (f"{ATTN}.k_proj.weight", 0), (f"{ATTN}.v_proj.weight", 0),
         (f"{ATTN}.o_proj.weight", 1), (f"{EXPERTS}.*.gate_proj.weight", 0), (f"{EXPERTS}.*.up_proj.weight", 0),
         (f"{EXPERTS}.*.down_proj.weight", 1), ("lm_head.weight", 0))


@pytest.fixture
def tp(tmp_path):
    """build(body) -> (plan, its text): a policy over the 2-layer Qwen3-MoE of headeronly.TP_MOE, at tmp_path."""
    tp_checkpoint(tmp_path / "ckpt")

    def make(body: str, name: str = "tp"):
        plan = build(load_policy(write_policy(tmp_path, body, name=f"{name}.policy.yaml", head=HEAD)), tmp_path)
        return plan, dumps(plan)
    return make


def test_a_plan_for_two_gpus_is_one_gpus_share(tmp_path, tp):
    plan, text = tp(f"gpus: 2\nbudget_gib: {BUDGET!r}\n")
    assert plan.parallel == Parallel(2, SPLIT, (f"{ATTN}.o_proj", EXPERTS), ("lm_head",), None, 5, 49)
    assert ("parallel:\n  layout: tensor\n  gpus: 2\n  budgets: null\n  collectives: {per_step: 5, us: 49}\n"
            "  split:\n" + "".join(f'    "{t}": {d}\n' for t, d in SPLIT[:-1]) + "    lm_head.weight: 0\n"
            f'  reduce:\n    - "{ATTN}.o_proj"\n    - "{EXPERTS}"\n  gather: [lm_head]\nsummary:\n') in text
    assert dumps(loads(text, "p.plan.yaml")) == text  # byte for byte, the section too
    # the checkpoint whole, the layers one GPU's share: a layer 37,696 of its 74,560 bytes, the head half of its
    assert (plan.tensors, plan.total_bytes) == (45, 182016)
    assert [(l.name, l.gpu + l.uva + l.prefetch) for l in plan.layers] == [
        ("model.embed_tokens", 16384), ("model.layers.0", 37696), ("model.layers.1", 37696), ("model.norm", 128),
        ("lm_head", 8192)]
    share = local_tensors(open_checkpoint(tmp_path / "ckpt").tensors, plan.parallel.dims, 2)
    assert sum(l.uva for l in plan.layers) == sum(share[n].nbytes for n, p in plan.params.items() if p.value == "uva")
    assert plan.summary.gpu_footprint_bytes <= plan.budget_bytes == 100000
    # the experts' working memory is each GPU's: one expert's share is 6,144 of its 12,288 bytes; a decode step
    # stages a token's 2 experts, a 512-token prefill all 4, the lookahead reads 2 ahead (working.py)
    s = plan.summary
    assert (s.working_decode_bytes, s.working_prefill_bytes, s.working_buffer_bytes) == (2 * 6144, 4 * 6144, 2 * 6144)
    assert plan.notes[0] == ("tensor parallel over 2 GPUs (transformers' plan for model_type qwen3_moe): every figure "
                             "is one GPU's share; each GPU reads its share over its own host link (H2D predicted at "
                             "49 GB/s each)")


def test_per_gpu_budgets_fit_the_smallest_and_a_budget_too_small_is_refused(tmp_path, tp):
    plan, text = tp(f"gpus: [{BUDGET!r}, {2 * BUDGET!r}]\n")
    assert (plan.budget_bytes, plan.parallel.budgets) == (100000, (100000, 200000))
    assert "  budgets: [100000, 200000]\n" in text and dumps(loads(text, "p.plan.yaml")) == text
    assert plan.summary.gpu_footprint_bytes <= 100000
    assert plan.notes[1] == ("the GPUs' budgets differ (GPU 0 97.7 KiB, GPU 1 195.3 KiB): the plan fits the "
                             "smallest, 97.7 KiB, on every GPU, since each GPU applies the same share; the larger "
                             "budgets' spare memory goes unused")
    with pytest.raises(BudgetError):
        tp(f"gpus: 2\nbudget_gib: {10000 / 2**30!r}\n")  # less than the embedding alone (16 KiB)


def test_plan_check_says_a_built_plan_is_up_to_date(tmp_path, tp, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    tp(f"gpus: 2\nbudget_gib: {BUDGET!r}\n")
    assert main(["build", "tp.policy.yaml"]) == 0
    capsys.readouterr()
    assert main(["check", "tp.plan.yaml"]) == 0
    assert "up to date" in capsys.readouterr().out


def line(text: str, needle: str) -> int:
    assert text.count(needle) == 1, needle
    return text[:text.index(needle)].count("\n") + 1


@pytest.mark.parametrize("edit, at, problem", [
    ("    lm_head.weight: 0\n", ("    lm_head.weight: 0\n    model.norm.nothing: 0\n", "model.norm.nothing", 25),
     "parallel.split.model.norm.nothing: names no tensor of params:"),
    (f'    - "{ATTN}.o_proj"\n', ("", f'"{ATTN}.o_proj.weight": 1', 47),
     f"parallel.split.{ATTN}.o_proj.weight: split along its input features (dim 1), but no module of "
     "parallel.reduce holds it: its partial outputs would never be summed"),
    ("  gather: [lm_head]\n", ("  gather: [lm_head, model.norm]\n", "gather: [lm_head, model.norm]", 21),
     "parallel.gather[1]: model.norm holds no split tensor"),
    ("  budgets: null\n", ("  budgets: [1, 2, 3]\n", "budgets: [1, 2, 3]", 12),
     "parallel.budgets: lists 3 budgets for 2 GPUs"),
    ("  budgets: null\n", ("  budgets: [110000, 200000]\n", "budgets: [110000, 200000]", 12),
     "parallel.budgets: the smallest is 110000 but budget_bytes is 100000: every GPU applies the same share, so the "
     "plan fits the smallest"),
])
def test_hand_edits_of_the_parallel_section_are_located(tp, edit, at, problem):
    _, text = tp(f"gpus: 2\nbudget_gib: {BUDGET!r}\n")
    assert edit in text
    bad = text.replace(edit, at[0])
    with pytest.raises(PlanFileError) as e:
        loads(bad, "p.plan.yaml")
    assert f"p.plan.yaml:{line(bad, at[1])}:{at[2]}: {problem}" in e.value.problems


def test_a_plan_whose_bytes_are_not_one_gpus_share_is_caught_with_the_checkpoint(tmp_path, tp):
    _, text = tp(f"gpus: 2\nbudget_gib: {BUDGET!r}\n")
    tensors = open_checkpoint(tmp_path / "ckpt").tensors
    bad = text.replace("  gpus: 2\n", "  gpus: 4\n")
    assert loads(bad, "p.plan.yaml") is not None  # the names alone cannot tell
    with pytest.raises(PlanFileError) as e:
        loads(bad, "p.plan.yaml", tensors)
    rows = bad.splitlines().index("layers:") + 2  # the first row: where the section's value starts
    assert e.value.problems[0] == (f"p.plan.yaml:{rows}:3: layers: add up to 100096 bytes, but one GPU's share of "
                                   "the checkpoint (parallel.split over 4 GPUs) is 59136")
    assert (f"p.plan.yaml:{rows + 4}:5: layers[4]: lm_head has gpu 8,192, uva 0, prefetch 0; its tensors in params: "
            "have gpu 4,096, uva 0, prefetch 0") in e.value.problems


def test_the_collectives_cost_their_latency_and_their_bytes_by_hand(tmp_path, tp):
    """Per layer two all-reduces (o_proj and the experts) of 64 bf16 activations, the head one all-gather of
    128 logits: 128 + 128 and 256 bytes per token. At 10 us each and 128 bytes per us, batch 4: a layer waits
    2 x 10 + 4 x 256 / 128 = 28 us, the head 10 + 4 x 256 / 128 = 18 us; 74 us in all. The 512 tokens of the
    prefill: 2 x 10 + 512 x 256 / 128 = 1,044 us a layer, 1,034 the head."""
    (tmp_path / "hw.yaml").write_text(
        "format_version: 1\nname: test\nh2d_copy_gbps: 10\nuva_read_gbps: 5\nhbm_read_gbps: 1000\n"
        "layer_overhead_us: 1\nallreduce_us: 10\nallreduce_gbps: 0.128\n")  # a prefill of reads, not launches
    one, _ = tp("budget_gib: 1\nhardware: hw.yaml\nworkload: {batch_size: 4}\n", name="one")
    two, _ = tp("gpus: 2\nbudget_gib: 1\nhardware: hw.yaml\nworkload: {batch_size: 4}\n", name="two")
    assert (two.parallel.collectives_per_step, two.parallel.collectives_us) == (5, 74)
    # a profile without parallel_h2d_copy_gbps shares its own link as the built-in figures do (49 of 55 GB/s)
    assert load_hardware(tmp_path / "hw.yaml").parallel_h2d_copy_gbps == pytest.approx(10 * 49 / 55)
    assert "(H2D predicted at 8.91 GB/s each)" in two.notes[0]
    assert (one.parallel, one.notes[0].startswith("the whole checkpoint")) == (None, True)
    # every tensor on the GPU either way: the GPU time of a layer is its HBM reads (half of them on 2 GPUs) plus
    # its collectives
    us = {l.name: l.us for l in one.layers}
    hbm = lambda nbytes: nbytes / 1e6  # noqa: E731 (1000 GB/s: a byte in 1e-6 us)
    assert [(l.name, l.us) for l in two.layers if l.name in ("model.layers.0", "lm_head")] == [
        ("model.layers.0", round(us["model.layers.0"] - hbm(74560 - 37696) + 28)),
        ("lm_head", round(us["lm_head"] - hbm(8192) + 18))]
    assert two.cost.prefill_us - one.cost.prefill_us == pytest.approx(2 * 1044 + 1034, abs=2)
