"""What runs when (graph.py `Runs`): vision towers and MTP layers run in no decode step, so the cost
model counts them in none and a budget offloads them first; the prefetch schedule's copy edges."""
from __future__ import annotations

import json
import re

import pytest

from headeronly import write_policy
from planner.decide.build import build
from planner.errors import InconsistentPlanError, PolicyError
from planner.inputs.config import ModelFacts
from planner.inputs.policy import load_policy
from planner.layers.graph import build_graph, schedule_problems
from planner.plan import Placement, Runs, Transfer
from planner.planfile import dumps, loads
from synthetic import deepseek_v3, qwen2_vl, write_header_only

GPU, UVA = Placement.GPU, Placement.UVA


def small_deepseek():
    """61 decoder layers as in DeepSeek-V3 (3 dense, 58 MoE) plus its MTP layer 61, in small tensors."""
    return deepseek_v3(layers=61, dense_layers=3, hidden=64, intermediate=128, experts=4, moe_intermediate=32,
                       heads=2, q_lora=32, kv_lora=16, nope=8, rope=8, v_head=8, vocab=256)


def small_qwen2_vl():
    return qwen2_vl(layers=4, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=256, depth=4, vision=32,
                    vision_mlp=64, patch=2, temporal=1)


def checkpoint(tmp_path, tensors, config: dict):
    write_header_only(tmp_path / "ckpt", tensors, single=True)
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_deepseek_v3s_layer_61_is_multi_token_prediction():
    names = [n for n, _, _ in small_deepseek()]
    g = build_graph(names, facts=ModelFacts(top_k=8, layers=61, mtp_layers=1))
    runs = {l.name: l.runs for l in g.layers}
    assert runs["model.layers.61"] is Runs.MTP
    assert {l.name for l in g.rarely_run()} == {"model.layers.61"}
    assert all(runs[f"model.layers.{i}"] is Runs.STEP for i in range(61))
    # without config.json's facts, names cannot tell: every layer runs every step
    assert not build_graph(names).rarely_run()


def test_qwen2_vl_vision_tower_runs_only_with_images_and_its_merger_mlp_is_no_stack():
    names = [n for n, _, _ in small_qwen2_vl()]
    g = build_graph(names)
    assert g.stacks == ("visual.blocks", "model.layers")  # not visual.merger.mlp (items 0 and 2)
    rare = {l.name: l.runs for l in g.rarely_run()}
    assert rare == {"visual.patch_embed.proj": Runs.IMAGES, **{f"visual.blocks.{i}": Runs.IMAGES for i in range(4)},
                    "visual.merger.ln_q": Runs.IMAGES, "visual.merger.mlp.0": Runs.IMAGES,
                    "visual.merger.mlp.2": Runs.IMAGES}
    assert not g.tied_embeddings  # the patch embedding is no text embedding


def test_a_budget_offloads_the_mtp_layer_first_and_the_cost_model_ignores_it(tmp_path):
    root = checkpoint(tmp_path, small_deepseek(), {"num_hidden_layers": 61, "num_nextn_predict_layers": 1,
                                                   "num_experts_per_tok": 2})
    tensors = small_deepseek()
    mtp = sum(t[2][0] * (t[2][1] if len(t[2]) > 1 else 1) * (1 if t[1] == "F8_E4M3" else 4 if t[1] == "F32" else 2)
              for t in tensors if t[0].startswith("model.layers.61."))
    total = sum(t[2][0] * (t[2][1] if len(t[2]) > 1 else 1) * (1 if t[1] == "F8_E4M3" else 4 if t[1] == "F32" else 2)
                for t in tensors)
    # the footprint counts the experts' working memory: the FP8 experts' dequantized copies at a prefill, on the GPU
    # too (planner/decide/working.py); the MTP layer runs in no step, so it is the all-GPU plan's whatever it offloads
    head = "format_version: 1\ncheckpoint: ./ckpt\n"
    working = build(load_policy(write_policy(root, head=head)), root).summary.working_peak_bytes
    assert working > 0
    pol = load_policy(write_policy(root, f"budget_gib: {(total - mtp + working) / 2**30!r}\n", head=head))
    plan = build(pol, root)
    assert plan.summary.working_peak_bytes == working
    off = [n for n, p in plan.params.items() if p is not GPU]
    assert off and all(n.startswith("model.layers.61.") for n in off)  # exactly the MTP layer
    row = next(l for l in plan.layers if l.name == "model.layers.61")
    assert (row.runs, row.uva, row.h2d, row.us) == (Runs.MTP, mtp, 0, 0)
    assert plan.prefill is None  # it runs in no forward of plain generation: no staging slot for it
    assert plan.summary.predicted_h2d_bytes_per_step == 0  # it runs in no decode step
    assert any(n.startswith("not in a decode step, so the cost model counts them in none: 1 layer that predict "
                            "extra tokens (MTP)") for n in plan.notes)


def test_a_budget_offloads_the_vision_tower_first(tmp_path):
    root = checkpoint(tmp_path, small_qwen2_vl(), {"vision_config": {"depth": 4}, "num_hidden_layers": 4})
    plan = build(load_policy(write_policy(root, "backend: prefetch\nbudget_gib: 0.00026238\nprefetch: {step: 2}\n",
                                          head="format_version: 1\ncheckpoint: ./ckpt\n")), root)
    vision = [n for n in plan.params if n.startswith("visual.")]
    assert all(plan.params[n] is UVA for n in vision)  # before any text layer streams
    # a vision tower runs at prefill, over an image's tokens: staged, but its patch embedding (an EMBED) is not
    assert [l.layer for l in plan.prefill.layers] == [*(f"visual.blocks.{i}" for i in range(4)), "visual.merger.ln_q",
                                                      "visual.merger.mlp.0", "visual.merger.mlp.2"]
    assert plan.prefetch is not None and all(not t.layer.startswith("visual.") for t in plan.prefetch.schedule)
    assert [l.runs.value for l in plan.layers if l.name.startswith("visual.")] == ["images"] * 8
    assert "{name: visual.blocks.0, runs: images, " in dumps(plan)  # the plan file says so too


def test_schedule_copy_edges_are_checked_for_slot_overlap():
    g = build_graph([f"model.layers.{i}.w" for i in range(4)])
    names = [f"model.layers.{i}" for i in range(4)]
    good = [Transfer(n, n, 0, k % 2, names[(k - 2) % 4]) for k, n in enumerate(names)]  # 2 slots, vLLM's rule
    assert schedule_problems(g, good) == []
    assert g.graph["model.layers.1"]["model.layers.3"]["kind"] == "copy"  # the copy edges join the graph
    early = list(good)
    early[3] = Transfer(names[3], names[3], 0, 1, names[0])  # slot 1 is layer 1's until layer 1 has run
    assert schedule_problems(g, early) == [
        "model.layers.3: its copy into slot 1 starts after model.layers.0, while model.layers.1 still holds that slot"]
    late = list(good)
    late[2] = Transfer(names[2], names[2], 0, 0, names[3])  # layer 0 holds slot 0 until it runs, after layer 3
    assert schedule_problems(g, late) == [
        "model.layers.2: its copy into slot 0 starts after model.layers.3, while model.layers.0 still holds that slot"]
    assert schedule_problems(g, [Transfer(names[0], names[0], 0, 0, "lm_head")]) == [
        "model.layers.0: its copy starts after lm_head, which streams nothing"]


def test_prefetch_streams_only_layers_that_run_in_every_forward(tmp_path):
    """A text prompt skips the vision tower: streamed in the one slot rotation, it would break it. vLLM's
    group knobs count the decoder layers (vLLM streams nothing else), and a rule cannot prefetch it."""
    root = checkpoint(tmp_path, small_qwen2_vl(), {"vision_config": {"depth": 4}, "num_hidden_layers": 4})
    head = "format_version: 1\ncheckpoint: ./ckpt\n"
    plan = build(load_policy(write_policy(root, "prefetch: {group_size: 2, num_in_group: 1, step: 1}\n",
                                          head=head)), root)
    assert [t.layer for t in plan.prefetch.schedule] == ["model.layers.1", "model.layers.3"]
    assert not [n for n, p in plan.params.items() if n.startswith("visual.") and p is not GPU]
    with pytest.raises(PolicyError, match=r"group_size 5 is larger than the 4 layers of the layer stacks "
                                          r"\(visual.blocks, model.layers, 4 more run in no decode step\)"):
        build(load_policy(write_policy(root, "prefetch: {group_size: 5}\n", head=head)), root)
    policy = write_policy(root, "rules:\n  - {match: [merger, re:^model\\.layers\\.0\\.], place: prefetch}\n"
                                "prefetch: {step: 1}\n", head=head)
    with pytest.raises(PolicyError) as err:
        build(load_policy(policy), root)
    assert err.value.problems == [
        f"{policy}:4:14: rules[0] prefetches {n}, but {n.rpartition('.')[0]} runs only for prompts with images; "
        "place it on uva (prefill staging copies it ahead of use when it runs)"
        for n in ("visual.merger.ln_q.bias", "visual.merger.mlp.0.bias", "visual.merger.mlp.2.bias")]


def test_a_plan_that_prefetches_a_vision_layer_is_refused(tmp_path):
    """Such a plan (an older offplan's group rule counted vision layers) fails the consistency check."""
    root = checkpoint(tmp_path, small_qwen2_vl(), {"vision_config": {"depth": 4}, "num_hidden_layers": 4})
    text = dumps(build(load_policy(write_policy(root, "rules:\n  - {match: [re:^visual\\.blocks\\.1\\.], place: uva}\n"
                                                      "prefetch: {step: 1}\n",
                                                head="format_version: 1\ncheckpoint: ./ckpt\n")), root))
    edited = re.sub(r"(visual\.blocks\.1\.\S+): uva", r"\1: prefetch", text)
    assert edited != text
    with pytest.raises(InconsistentPlanError) as err:
        loads(edited)
    assert any(p.endswith("params.visual.blocks.1.attn.proj.bias: prefetch, but visual.blocks.1 runs only for prompts "
                          "with images, and a prefetched layer must run in every forward (a plan of an older "
                          "offplan? rebuild it)") for p in err.value.problems), err.value.problems


def test_a_plan_that_prefetches_the_mtp_layer_is_refused(tmp_path):
    """The plan's rows say which layer is MTP (config.json's facts); the check reads them."""
    root = checkpoint(tmp_path, small_deepseek(), {"num_hidden_layers": 61, "num_nextn_predict_layers": 1,
                                                   "num_experts_per_tok": 2})
    with pytest.raises(PolicyError, match=r"rules\[0\] prefetches model.layers.61.\S+, but model.layers.61 runs in "
                                          r"no forward of plain decoding; place it on uva"):
        build(load_policy(write_policy(root, "rules:\n  - {match: [re:^model\\.layers\\.6], place: prefetch}\n",
                                       head="format_version: 1\ncheckpoint: ./ckpt\n")), root)
    text = dumps(build(load_policy(write_policy(root, "rules:\n  - {match: [re:^model\\.layers\\.61\\.], place: uva}\n",
                                                head="format_version: 1\ncheckpoint: ./ckpt\n")), root))
    edited = re.sub(r"(model\.layers\.61\.\S+): uva", r"\1: prefetch", text)
    with pytest.raises(InconsistentPlanError, match=r"params.model.layers.61.\S+: prefetch, but model.layers.61 runs "
                                                    r"only for multi-token prediction"):
        loads(edited)
