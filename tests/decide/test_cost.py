"""The cost model and the mixed backend, on plain data with round-number hardware."""
from __future__ import annotations

import dataclasses

import pytest

from headeronly import GPU, PREFETCH, UVA, infos, policy
from planner.decide.cost import CostModel
from planner.decide.placement import decide
from planner.errors import HardwareProfileError, PolicyError
from planner.inputs.hardware import H100, Hardware, dumps_hardware, load_hardware
from planner.inputs.patterns import compile_pattern
from planner.inputs.policy import Rule, Workload, load_policy
from planner.layers.graph import build_graph
from planner.layers.groups import FusedGroups
from planner.plan import Role

# 1 MB/us copy, 0.5 MB/us UVA, 10 MB/us HBM, 100 us per layer: easy arithmetic.
HW = Hardware("test", h2d_copy_gbps=1.0, uva_read_gbps=0.5, hbm_read_gbps=10.0, layer_overhead_us=100.0,
              prefill_token_ns=0.0, moe_prefill_token_ns=0.0)  # prefill: GEMMs and bytes (test_cost_prefill.py: more)


def moe(layers=4, experts=8) -> list:
    """Per layer: a dense 1 MB attention tensor and `experts` experts of 3 x 1 MB (1000 x 1000 bytes: the host
    engine sizes its outputs by down_proj's rows, planner/decide/working.py); embedding 1000 x 500 BF16."""
    out = [("model.embed_tokens.weight", "BF16", (1000, 500))]  # 1 MB
    for i in range(layers):
        out.append((f"model.layers.{i}.self_attn.o_proj.weight", "U8", (10**6,)))
        for e in range(experts):
            for proj in ("down_proj", "gate_proj", "up_proj"):
                out.append((f"model.layers.{i}.mlp.experts.{e}.{proj}.weight", "U8", (1000, 1000)))
    out.append(("lm_head.weight", "U8", (10**6,)))
    return out


def model_for(tensors, batch=1, top_k=2, roles=None):
    t = infos(tensors)
    g = build_graph(t)
    groups = FusedGroups.find(n for l in g.stack_layers() for n in l.params)
    return CostModel(g, t, HW, batch, groups, top_k, roles), g, t


@pytest.mark.parametrize("batch, expert", [(1, 0.25), (2, 1 - 0.75 ** 2), (8, 1 - 0.75 ** 8)])
def test_touched_fractions(batch, expert):
    m, _, _ = model_for(moe(), batch=batch)
    assert m.frac["model.layers.0.mlp.experts.3.up_proj.weight"] == pytest.approx(expert)
    assert m.frac["model.embed_tokens.weight"] == pytest.approx(batch / 1000)
    assert m.frac["model.layers.0.self_attn.o_proj.weight"] == 1.0
    assert m.role["model.layers.0.mlp.experts.3.up_proj.weight"] is Role.EXPERT
    assert m.role["model.embed_tokens.weight"] is Role.EMBEDDING


def test_unknown_top_k_reads_every_expert_and_rules_override_roles():
    m, _, _ = model_for(moe(), top_k=None, roles={"lm_head.weight": Role.EMBEDDING})
    assert m.frac["model.layers.0.mlp.experts.3.up_proj.weight"] == 1.0
    assert m.frac["lm_head.weight"] == 1e-6  # as an embedding: 1 of its 10^6 rows per step


def test_prediction_arithmetic():
    m, g, t = model_for(moe(layers=2, experts=4), batch=1, top_k=1)  # experts: 1/4 touched
    place = {n: GPU for n in t}
    for e in range(4):
        for proj in ("down_proj", "gate_proj", "up_proj"):
            place[f"model.layers.0.mlp.experts.{e}.{proj}.weight"] = UVA       # 12 MB, 3 MB touched
    place["model.layers.1.self_attn.o_proj.weight"] = PREFETCH                 # 1 MB copied
    p = m.predict(place)
    layers = {l.name: l for l in p.layers}
    # 1 (token, expert) pair: batched_mm's arithmetic, so every experts forward stages its touched experts
    # (written to HBM and read back: twice their bytes more over HBM, at half the rate where gathered from HBM)
    # layer 0: 1 MB from HBM (100 us) + the 3 MB touched through UVA at 0.5 MB/us (6000 us) + staging 6 MB
    # (600 us); link 6 ms
    assert (layers["model.layers.0"].gpu_us, layers["model.layers.0"].link_us) == (6700, 6000)
    assert layers["model.layers.0"].h2d_bytes == 3 * 10**6
    # layer 1: (1 MB from its slot + 3 MB touched experts + 6 MB staging at half the rate, as 12 MB) from HBM;
    # link: 1 MB copy = 1000 us
    assert (layers["model.layers.1"].gpu_us, layers["model.layers.1"].link_us) == (1600, 1000)
    assert p.h2d_bytes == 4 * 10**6
    assert p.cpu_us == 200  # 2 layers x 100 us, overlapping the GPU
    assert p.gpu_us == 8400  # + lm_head 100 us (+ 1 embedding row, rounds away)
    assert p.step_us == max(p.cpu_us, p.gpu_us, p.link_us) == 8400


def two_layers_on_the_gpu():
    """Two layers, everything on the GPU: layer 0 dense (2 MB), layer 1 with 4 routed experts of 3 MB; (tensors,
    graph, fused groups, placement)."""
    tensors = [t for t in moe(layers=2, experts=4) if not t[0].startswith("model.layers.0.mlp.")]
    tensors.append(("model.layers.0.mlp.down_proj.weight", "U8", (10**6,)))  # layer 0: dense
    t = infos(tensors)
    g = build_graph(t)
    return t, g, FusedGroups.find(n for l in g.stack_layers() for n in l.params), {n: GPU for n in t}


def test_layer_gpu_time_and_staging_by_batch():
    """Kernel latency per layer (dense or with routed experts) and per step counts as GPU time; above
    BATCHED_PAIRS pairs an all-resident experts forward reads in place (grouped_mm), nothing staged."""
    t, g, groups, place = two_layers_on_the_gpu()
    hw = dataclasses.replace(HW, layer_gpu_us=50.0, moe_layer_gpu_us=70.0, step_gpu_us=30.0)
    for batch, staged in ((1, 12 * 10**6), (32, 0)):  # gathered from HBM: twice 3 MB, at half the rate
        p = CostModel(g, t, hw, batch, groups, 1, graphs=True).predict(place)
        layers = {l.name: l for l in p.layers}
        touched = 12 * 10**6 * (1 - 0.75 ** batch)
        assert layers["model.layers.0"].gpu_us == 50 + 200  # 2 MB dense from HBM
        assert layers["model.layers.1"].gpu_us == round(70 + (10**6 + touched + staged) / 10**4)
        assert p.cpu_us == 0  # replayed from a CUDA graph
        assert p.gpu_us == round(30 + 250 + 70 + (10**6 + touched + staged) / 10**4 + 100 + batch / 10)


def test_the_prefill_takes_at_least_its_layers_launches():
    """The prefill runs eagerly, even where decode steps replay a graph: at least the decoder layers' CPU overheads
    (a layer with routed experts its own figure), not the step's own; above them, its reads and FLOPs."""
    t, g, groups, place = two_layers_on_the_gpu()
    launches = dict(layer_overhead_us=100.0, moe_layer_overhead_us=300.0, step_overhead_us=5000.0)
    fast = dataclasses.replace(HW, hbm_read_gbps=1e6, matmul_tflops=1e6, **launches)  # reads, FLOPs: ~0 us
    for graphs in (False, True):
        assert CostModel(g, t, fast, 1, groups, 1, graphs=graphs).predict(place).prefill_us == 100 + 300
    p = CostModel(g, t, dataclasses.replace(HW, **launches), 1, groups, 1).predict(place)  # 10 MB/us HBM
    assert p.prefill_us > 400
    assert p.prefill_us == pytest.approx(sum(l.prefill_us for l in p.layers), abs=len(p.layers))


def test_eager_cpu_time_per_layer_dense_or_with_routed_experts(tmp_path):
    """Eagerly, a layer with routed experts costs its own CPU figure (moe_layer_overhead_us), a dense one
    layer_overhead_us; without the MoE figure, a MoE layer costs a dense one's. A profile of a calibration's
    fastest rounds says how much slower its median round was (eager_median_ratio): a typical step's launches."""
    t, g, groups, place = two_layers_on_the_gpu()
    for moe_us, ratio, cpu in ((0.0, 1.0, 40 + 100 + 100), (300.0, 1.0, 40 + 100 + 300), (300.0, 1.25, 550)):
        hw = dataclasses.replace(HW, step_overhead_us=40.0, moe_layer_overhead_us=moe_us, eager_median_ratio=ratio)
        (tmp_path / "hw.yaml").write_text(dumps_hardware(hw))
        assert load_hardware(tmp_path / "hw.yaml") == hw
        assert CostModel(g, t, hw, 1, groups, 1).predict(place).cpu_us == cpu
        replayed = CostModel(g, t, hw, 1, groups, 1, graphs=True).predict(place)
        assert (replayed.cpu_us, replayed.eager_cpu_us) == (0, cpu)  # a graph prediction keeps the eager launches


def mixed(tensors, budget_mb, batch=1, step=2, top_k=2, rules=(), stage=True, stage_experts=None):
    pol = dataclasses.replace(policy("mixed", budget_gib=budget_mb * 10**6 / 2**30, step=step, rules=rules,
                                     stage_prefill=stage, stage_experts=stage_experts), workload=Workload(batch))
    t = infos(tensors)
    return decide(build_graph(t), t, pol, HW, top_k)


def test_mixed_puts_sparse_experts_on_uva_at_batch_1():
    d = mixed(moe(), budget_mb=84, stage_experts=True)  # 102 MB in all; experts are 3 MB each, 24 MB a layer
    uva = {n for n, p in d.params.items() if p is UVA}
    # Experts on uva cost working memory (planner/decide/working.py): a decode step's 2 (6 MB), a staged prefill's
    # whole layer (24 MB) and its ring of the layer's host experts, the lookahead's 2 (6 MB). Each walk is repeated
    # with the room the last one needed kept free, the last keeping the most any placement needs (every expert on
    # uva: 6 + 24 + a 24 MB ring = 54 MB): 30 MB for the tensors. Least read first, one expert of one fused
    # parameter at a time: the embedding rows, then the experts, read alike, round the layers (each layer's first
    # unit, then its second...) until 29 MB are left: lm_head, the attention, and 2 experts in each layer
    assert uva == {"model.embed_tokens.weight"} | {n for n in d.params if ".experts." in n and int(n.split(".")[5]) < 6}
    assert PREFETCH not in d.params.values()
    # their working memory: the lookahead's 6 MB and a prefill's 24 MB layer and ring of 6 host experts (18 MB)
    assert (d.summary.uva_bytes, d.summary.working_peak_bytes, d.summary.gpu_footprint_bytes) == (
        73 * 10**6, 48 * 10**6, 77 * 10**6)
    # the same step as taking layers 0-2's experts whole (43.102 ms), but a faster prefill: each layer's copy of
    # its host experts hides behind other layers' compute (75.635 ms against 78.146)
    assert d.notes[1].startswith("mixed chose 'sparse round the layers->uva, dense->prefetch': predicted step "
                                 "43.102 ms, prefill 75.635 ms, request 11109.747 ms")
    assert "sparse->uva, dense->prefetch: step 43.102 ms, prefill 78.146 ms" in d.notes[1]
    rows = {l.name: l for l in d.layers}
    assert rows["model.layers.0"].why == "expert -> uva (25.0% read per step)"
    assert [rows[f"model.layers.{i}"].experts for i in range(4)] == ["mlp.experts: gpu 6-7, uva 0-5"] * 4


def test_mixed_weighs_the_expert_ring_against_the_experts_its_memory_would_hold():
    """The same budget with the planner left to decide: without a ring of host experts at prefill (18 MB) the plan
    holds 24 MB more on the GPU (two layers' experts whole) and predicts a faster step and request; the note says
    both."""
    staged, free = mixed(moe(), budget_mb=84, stage_experts=True), mixed(moe(), budget_mb=84)
    assert staged.prefill.experts and free.prefill is None  # nothing else on uva is staged either
    assert (free.summary.uva_bytes, free.summary.working_peak_bytes) == (49 * 10**6, 30 * 10**6)
    assert free.summary.gpu_footprint_bytes <= 84 * 10**6
    assert free.summary.predicted_step_us < staged.summary.predicted_step_us
    assert ("routed experts not staged at prefill: predicted request 8525.279 ms, against 11109.747 ms staged through "
            "their ring, whose GPU memory holds experts instead") in free.notes
    assert mixed(moe(), budget_mb=84, stage_experts=False).params == free.params
    # a budget neither fits: the error names the smallest that does, without the ring (with it: 49.6 MiB)
    from planner.errors import BudgetError
    with pytest.raises(BudgetError, match=r"the smallest budget that fits this policy is budget_gib: 0\.030734003 "
                                          r"\(31\.5 MiB\)"):
        mixed(moe(), budget_mb=20)
    assert mixed(moe(), budget_mb=34).summary.gpu_footprint_bytes <= 34 * 10**6


def test_mixed_at_batch_64_offloads_no_more_than_it_must():
    # At batch 64 nearly every expert is touched: experts on uva would gather all a step touches into HBM (24 MB a
    # layer), a prefill a layer and its ring (48 MB), and the lookahead 6 MB: 54 MB of working memory, more than the
    # 2 slots of 25 MB that streaming whole layers costs. So the uva strategies must offload nearly all (every
    # expert read through UVA each step: 211.828 ms) and 'prefetch only' is predicted fastest: the fewest layers
    # that fit, all 4 (lm_head and the embedding stay: 2 MB), copied at 1 MB/us (100 ms a step; the prefill's
    # copies back to back, then the last layer's compute)
    d = mixed(moe(), budget_mb=60, batch=64)
    assert d.notes[1].startswith(
        "mixed chose 'prefetch only': predicted step 100.000 ms, prefill 102.611 ms, request 25702.611 ms (prefill "
        "of 512 tokens + 256 steps at batch 64); others: sparse->uva, dense->prefetch: step 211.828 ms")
    assert (d.summary.uva_bytes, d.summary.prefetch_bytes, d.summary.working_peak_bytes) == (0, 100 * 10**6, 0)
    assert (d.prefetch.slots, d.summary.gpu_footprint_bytes) == (2, 2 * 10**6 + 2 * (25 * 10**6 + 192))  # 256-aligned
    assert d.prefill is None  # nothing on uva to stage


def test_mixed_respects_rules_and_budget_check():
    rules = [(["lm_head"], "uva")]
    d = mixed(moe(), budget_mb=60, rules=rules)
    assert d.params["lm_head.weight"] is UVA
    from planner.errors import BudgetError
    # lm_head (1 MB) stays on the GPU unless a rule moves it, with the working memory of every expert on uva read in
    # place: a decode step's 2 experts (6 MB), a prefill's whole layer (24 MB: 512 tokens touch all 8), the
    # lookahead's 2 (6 MB): 30 MB
    with pytest.raises(BudgetError, match=r"the plan needs 29.6 MiB \(31,000,000 bytes\) of GPU memory(.|\n)*28.6 MiB of "
                                          r"it are the experts' working memory"):
        mixed(moe(), budget_mb=0.5, stage=False)
    # staged at prefill, the uva plans would add 2 slots of 1 MB and a 24 MB ring: streaming whole layers (2 slots
    # of 25 MB, 256-aligned; the embedding and lm_head stay) needs the least of those, and no working memory
    with pytest.raises(BudgetError, match=r"the plan needs 49.6 MiB \(52,000,384 bytes\) of GPU memory") as e:
        mixed(moe(), budget_mb=0.5, stage_experts=True)
    assert "working memory" not in str(e.value)
    # left to the planner, the experts unstaged (no ring; the embedding's slots stay) need less: that is the answer
    with pytest.raises(BudgetError, match=r"the plan needs 31.5 MiB \(33,000,384 bytes\) of GPU memory(.|\n)*28.6 MiB "
                                          r"of it are the experts' working memory"):
        mixed(moe(), budget_mb=0.5)


def test_rule_roles_feed_the_model():
    pol = dataclasses.replace(policy("mixed", budget_gib=60e6 / 2**30),
                              rules=(Rule((compile_pattern("self_attn"),), None, Role.EXPERT),))
    t = infos(moe())
    d = decide(build_graph(t), t, pol, HW, 2)
    # as "experts" outside a group the attention tensors are read whole: no change in prediction
    assert d.cost.step_us > 0


def test_policy_mixed_needs_a_budget_and_reads_workload(tmp_path):
    (tmp_path / "a.policy.yaml").write_text("format_version: 1\ncheckpoint: c\nbackend: mixed\n")
    with pytest.raises(PolicyError, match="backend: mixed needs budget_gib"):
        load_policy(tmp_path / "a.policy.yaml")
    (tmp_path / "b.policy.yaml").write_text(
        "format_version: 1\ncheckpoint: c\nbackend: mixed\nbudget_gib: 1\nworkload: {batch_size: 8, "
        "experts_per_token: 4}\nhardware: h.yaml\n")
    with pytest.raises(PolicyError, match="hardware: no such file .*plan calibrate -o FILE"):
        load_policy(tmp_path / "b.policy.yaml")
    (tmp_path / "h.yaml").write_text(dumps_hardware(HW))
    pol = load_policy(tmp_path / "b.policy.yaml")
    assert pol.workload == Workload(8, 4)
    assert load_hardware(pol.hardware) == HW


def test_a_tied_embedding_is_dense_because_the_head_reads_it_whole():
    tied = [t for t in moe() if t[0] != "lm_head.weight"]
    m, g, _ = model_for(tied)
    assert g.tied_embeddings
    assert (m.role["model.embed_tokens.weight"], m.frac["model.embed_tokens.weight"]) == (Role.DENSE, 1.0)


def test_graph_replay_costs_no_launch_time():
    """workload.cuda_graphs: a replayed step launches nothing from the CPU, so a step the eager model
    calls CPU-bound is GPU-bound under graphs; the plan records the mode."""
    eager, g, i = model_for(moe(layers=2, experts=4), batch=1, top_k=1)
    place = {n: GPU for n in i}
    graphs = CostModel(g, i, HW, 1, FusedGroups.find(n for l in g.stack_layers() for n in l.params), 1, graphs=True)
    assert eager.predict(place).cpu_us == 200 and graphs.predict(place).cpu_us == 0
    assert graphs.predict(place).gpu_us == eager.predict(place).gpu_us



def test_a_graph_plan_predicts_the_eager_step_too(tmp_path):
    """The two modes differ only in the launches: a plan predicting replayed steps records the eager launches
    (cost.eager_cpu_us), so `plan apply --eager` has a prediction of its own; an eager plan's are its cpu_us."""
    from planner.plan import Cost
    graph = Cost("h", 1, 0, 700, 300, cuda_graphs=True, eager_cpu_us=2000)
    assert (graph.step_us_in(True), graph.step_us_in(False)) == (700, 2000)
    eager = Cost("h", 1, 2000, 700, 300)
    assert (eager.step_us_in(True), eager.step_us_in(False)) == (700, 2000)
    assert Cost("h", 1, 0, 700, 300, cuda_graphs=True).step_us_in(False) is None  # written before eager_cpu_us
    assert Cost("h", 1, 0, 700, 300, cuda_graphs=True, eager_cpu_us=0).step_us_in(False) == 700  # no launches


def test_a_hand_written_profile_may_hold_a_few_figures_the_rest_the_builtin_ones(tmp_path, capsys):
    """A machine without a GPU to calibrate gives its own cores (`cpu_threads`) and keeps the H100's other
    figures; `plan validate` knows the file for a hardware profile; a name is still asked for."""
    from offplan.cli import main

    path = tmp_path / "two-cores.yaml"
    path.write_text("format_version: 1\nname: two cores\ncpu_threads: 2\n")
    assert load_hardware(path) == dataclasses.replace(H100, name="two cores", cpu_threads=2, measured=(
        f"two-cores.yaml: cpu_threads; the rest {H100.measured}"))
    (tmp_path / "h2d.yaml").write_text("format_version: 1\nname: slower link\nh2d_copy_gbps: 27.5\n"
                                       "layer_overhead_us: 600\n")
    partial = load_hardware(tmp_path / "h2d.yaml")  # what goes with a given figure goes as in a calibrated profile
    assert partial.parallel_h2d_copy_gbps == H100.parallel_h2d_copy_gbps / 2 and partial.moe_layer_overhead_us == 0
    (tmp_path / "ci.yml").write_text("name: CI\non: [push]\njobs: {}\n")  # a name alone is no profile
    assert main(["validate", str(tmp_path / "ci.yml")]) == 1
    assert "hardware profile" not in capsys.readouterr().err
    assert main(["validate", str(path)]) == 0
    assert capsys.readouterr().out == f"{path}: valid hardware profile (two cores)\n"
    path.write_text("format_version: 1\ncpu_threads: 2\n")
    with pytest.raises(HardwareProfileError, match="'name' is required"):
        load_hardware(path)
