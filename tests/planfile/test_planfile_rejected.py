"""Plans the reader refuses: schema violations located, an old format, and hand edits whose parts disagree,
each named by its lines."""
from __future__ import annotations

import pytest

from headeronly import write_policy
from planner.decide.build import build
from planner.errors import PlanFileError
from planner.inputs.checkpoint import open_checkpoint
from planner.inputs.policy import load_policy
from planner.planfile import dumps, load_plan, loads
from synthetic import write_header_only
from test_planfile import built  # noqa: F401 (the fixture)


def plan_error(text) -> PlanFileError:
    with pytest.raises(PlanFileError) as e:
        loads(text, "p.plan.yaml")
    return e.value


def test_schema_violations_are_located(built):
    _, text = built["uva"]
    bad = text.replace("backend: uva\n", "backend: gpu\n").replace(
        "model.layers.2.mlp.down_proj.weight: gpu", "model.layers.2.mlp.down_proj.weight: disk")
    bad = bad.replace("format_version: 2\n", "format_version: 2\nextra: 1\n")
    e = plan_error(bad)
    assert e.headline == "p.plan.yaml: the plan is invalid"
    line = lambda s: bad[:bad.index(s)].count("\n") + 1  # noqa: E731
    assert e.problems == [
        f"p.plan.yaml:{line('extra')}:1: extra: unknown key (allowed: format_version, built, checkpoint, policy, "
        "routing, backend, budget_bytes, stacks, tied_embeddings, parallel, summary, cost, notes, layers, prefetch, prefill, "
        "params)",
        f"p.plan.yaml:{line('backend: gpu')}:10: backend: 'gpu' is not one of none, uva, prefetch, mixed",
        f"p.plan.yaml:{line(': disk')}:40: params.model.layers.2.mlp.down_proj.weight: 'disk' is not one "
        "of gpu, uva, prefetch, cpu",
    ]



def test_every_placement_is_checked_however_many_are_fine(built):
    """`params:` is checked in one pass where every value is a placement (schema.py): a value that is not, of any
    kind, anywhere among the many that are, is still reported at its line."""
    _, text = built["uva"]
    bad = text.replace("model.layers.2.mlp.down_proj.weight: gpu", "model.layers.2.mlp.down_proj.weight: [gpu]")
    bad = bad.replace("lm_head.weight: gpu", "lm_head.weight: 1")
    line = lambda s: bad[:bad.index(s)].count("\n") + 1  # noqa: E731
    assert plan_error(bad).problems == [
        f"p.plan.yaml:{line('lm_head.weight: 1')}:19: params.lm_head.weight: 1 is not one of gpu, uva, prefetch, cpu",
        f"p.plan.yaml:{line(': [gpu]')}:40: params.model.layers.2.mlp.down_proj.weight: a list is not one of gpu, "
        "uva, prefetch, cpu"]

def test_a_format_1_plan_says_to_rebuild(built):
    _, text = built["prefetch"]
    assert str(plan_error(text.replace("format_version: 2\n", "format_version: 1\n"))) == (
        "p.plan.yaml: a format 1 plan, from an offplan without slot layouts in plans; rebuild it with "
        "`plan build POLICY`")


def test_not_a_plan():
    assert str(plan_error("format_version: 1\n")) == (
        "p.plan.yaml: not an offplan plan (no `params:` mapping); build one with `plan build POLICY`")
    assert str(plan_error("params: [\n")).startswith("p.plan.yaml:2:1: invalid YAML: ")


def line(text: str, needle: str) -> int:
    assert text.count(needle) == 1, needle
    return text[:text.index(needle)].count("\n") + 1


HEADLINE = ("p.plan.yaml: the plan is inconsistent (edited by hand?): params: compared with layers:, summary:, "
            "prefetch: and prefill: ")


@pytest.mark.parametrize("name, edit, at, problem", [
    ("uva", ("  tensors: 11\n", "  tensors: 12\n"), ("tensors: 12", 12),
     "checkpoint.tensors is 12 but params lists 11"),
    ("uva", ("  uva_bytes: 6291456\n", "  uva_bytes: 6291457\n"), ("uva_bytes: 6291457", 14),
     "summary.uva_bytes is 6291457 but the layers add up to 6291456"),
    ("uva", ("  bytes: 22020096\n", "  bytes: 22020095\n"), ("bytes: 22020095", 10),
     "checkpoint.bytes is 22020095 but the layers add up to 22020096"),
    ("uva", ("  gpu_footprint_bytes: 22020096\n", "  gpu_footprint_bytes: 1\n"), ("gpu_footprint_bytes: 1\n", 24),
     "summary.gpu_footprint_bytes is 1 but the pools, gpu_bytes and the working memory's peak (plan.py Summary) add up "
     "to 22020096"),
    ("prefetch", ("  prefetch_buffer_bytes: 6291456\n", "  prefetch_buffer_bytes: 3145728\n"),
     ("prefetch_buffer_bytes: 3145728", 26),
     "summary.prefetch_buffer_bytes is 3145728 but the prefetch section sizes the pool at 6291456"),
    ("prefetch", ("  slot_bytes: 3145728\n", "  slot_bytes: 3145729\n"), ("slot_bytes: 3145729", 15),
     "prefetch.slot_bytes is 3145729 but the largest layout is 3145728"),
    ("prefetch", ("{layer: model.layers.3, module: model.layers.3, layout: 0, slot: 1, after: model.layers.3}",
                  "{layer: model.layers.3, module: model.layers.3, layout: 0, slot: 0, after: model.layers.1}"),
     ("{layer: model.layers.3", 7),
     "prefetch.schedule[1]: model.layers.3 must use slot 1 after model.layers.3, not slot 0 after "
     "model.layers.1"),
    ("prefetch", ("    - {layer: model.layers.3, module: model.layers.3, layout: 0, slot: 1, after: model.layers.3}\n",
                  ""), ("{layer: model.layers.1", 5),
     "prefetch.schedule: lists model.layers.1 but the layers with prefetched tensors in params: are "
     "model.layers.1, model.layers.3"),
    ("prefetch", ("  slots: 2\n", "  slots: 1\n"), ("slots: 1", 10),
     "prefetch.slots is 1 but step 2 over 2 layers gives 2"),
    ("prefetch", ("{name: mlp.down_proj.weight, ", "{name: mlp.up_proj.weight, "), ("{layer: model.layers.1", 7),
     "prefetch.schedule[0]: layout 0 of model.layers.1 lacks mlp.down_proj.weight, which params: prefetch; it "
     "has mlp.up_proj.weight, which params: does not prefetch"),
    ("prefetch", ("{layer: model.layers.3, module: model.layers.3, ", "{layer: model.layers.3, module: model.layers.2, "),
     ("{layer: model.layers.3", 7),
     "prefetch.schedule[1]: model.layers.3 runs in module model.layers.3, not model.layers.2"),
    # Both tensors of layer 0 moved back to the GPU: the uva bytes of its row have no tensor.
    ("uva", ("model.layers.0.mlp.down_proj.weight: uva\n  model.layers.0.self_attn.o_proj.weight: uva",
             "model.layers.0.mlp.down_proj.weight: gpu\n  model.layers.0.self_attn.o_proj.weight: gpu"),
     ("{name: model.layers.0,", 41),
     "layers[1].uva: model.layers.0 has 3145728 bytes on uva but params: place none of its tensors on uva"),
    ("uva", ("  - {name: model.norm, ", "  - {name: model.final_norm, "), ("{name: model.final_norm", 5),
     "layers[5]: lists model.final_norm where the tensors of params: (with stacks: ['model.layers']) "
     "make model.norm"),
    ("uva", ("  - {name: model.norm, gpu: 1048576, uva: 0, prefetch: 0, h2d: 0, us: 0}\n", ""),
     ("{name: lm_head", 5),
     "layers[5]: lists lm_head where the tensors of params: (with stacks: ['model.layers']) make model.norm "
     "(6 layers; params: make 7)"),
])
def test_hand_edited_inconsistent_plans_are_rejected(built, name, edit, at, problem):
    _, text = built[name]
    assert edit[0] in text
    bad = text.replace(*edit)
    e = plan_error(bad)
    assert e.headline == (HEADLINE + "by tensor names only: no checkpoint given; rebuild it: plan build "
                          f"{name}.policy.yaml -o p.plan.yaml")
    assert f"p.plan.yaml:{line(bad, at[0])}:{at[1]}: {problem}" in e.problems


def test_one_flipped_placement_is_caught_with_the_checkpoint_and_names_the_lines(tmp_path, built):
    _, text = built["uva"]
    tensors = open_checkpoint(tmp_path / "ckpt").tensors
    name = "  model.layers.0.self_attn.o_proj.weight: "
    bad = text.replace(name + "uva\n", name + "gpu\n")
    assert loads(bad, "p.plan.yaml") is not None  # the names alone cannot tell
    with pytest.raises(PlanFileError) as e:
        loads(bad, "p.plan.yaml", tensors)
    row = line(bad, "{name: model.layers.0,")
    param = line(bad, "model.layers.0.self_attn.o_proj.weight: gpu")
    staged = line(bad, "{layer: model.layers.0,")
    assert e.value.headline == (HEADLINE + "with the tensor sizes in its checkpoint's headers; rebuild it: plan "
                                "build uva.policy.yaml -o p.plan.yaml")
    assert e.value.problems == [
        f"p.plan.yaml:{row}:5: layers[1]: model.layers.0 has gpu 0, uva 3,145,728, prefetch 0; its tensors in "
        f"params: have gpu 1,048,576, uva 2,097,152, prefetch 0 (p.plan.yaml:{param}:43: "
        "params.model.layers.0.self_attn.o_proj.weight: gpu)",
        f"p.plan.yaml:{staged}:62: prefill.layers[0].bytes is 3145728 but the staged tensors of model.layers.0 "
        "take 2097152 (each rounded up to 256 bytes)"]


def test_a_split_fused_group_and_wrong_buffers_are_caught(tmp_path):
    from synthetic import qwen3_moe
    write_header_only(tmp_path / "moe", qwen3_moe(layers=2, experts=4, hidden=64, moe_intermediate=32, heads=4,
                                                  kv_heads=2, head_dim=16, vocab=128), single=True)
    pol = load_policy(write_policy(tmp_path, "prefetch: {group_size: 2}\n",
                                   head="format_version: 1\ncheckpoint: ./moe\n"))
    text = dumps(build(pol, tmp_path))
    tensors = open_checkpoint(tmp_path / "moe").tensors
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    bad = text.replace(f"  {name}: prefetch\n", f"  {name}: gpu\n")
    with pytest.raises(PlanFileError) as e:
        loads(bad, "p.plan.yaml")
    assert f"p.plan.yaml:{line(bad, name + ': gpu')}:{len(name) + 5}: params.{name}: gpu, but fused group " \
        "model.layers.1.mlp.experts is prefetched, so all of it must be (its parameters are views of one slot): " \
        "11 prefetch, 1 gpu" in e.value.problems
    gate = "mlp.experts.0.gate_proj.weight, dtype: BF16, shape: "
    bad = text.replace(gate + "[32, 64]", gate + "[64, 32]")
    with pytest.raises(PlanFileError) as e:
        loads(bad, "p.plan.yaml", tensors)
    assert e.value.problems == [
        f"p.plan.yaml:{line(bad, '- bytes: 75264')}:7: prefetch.layouts[0]: the layout of model.layers.1 is not "
        "the one its prefetched tensors need (73.5 KiB; it lacks or misplaces mlp.experts.0.gate_proj.weight "
        "at 16640 (4096 bytes))"]


def test_load_plan_errors(tmp_path):
    with pytest.raises(PlanFileError, match="no such plan file"):
        load_plan(tmp_path / "missing.plan.yaml")
