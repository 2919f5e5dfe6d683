"""Runtime on the CPU: every backend reproduces plain loading exactly; every error path."""
from __future__ import annotations

import dataclasses
import json
import re
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import runtime  # noqa: E402
import runtime.load_steps as load_steps  # noqa: E402
from offplan.cli import main  # noqa: E402
from planner.errors import InconsistentPlanError, ModelMismatchError, OffplanError, StalePlanError  # noqa: E402
from planner.plan import Placement  # noqa: E402
from planner.planfile import load_plan  # noqa: E402
from runtime.hf import build_meta_model, from_pretrained  # noqa: E402
from tiny_models import llama_config, logits, make_plan, reference, save_model, save_models  # noqa: E402

POLICIES = {
    "gpu": "",
    "uva-part": "uva: {offload_gib: 0.0002}",
    "uva-attn": "backend: uva\nuva: {offload_gib: 1, params: [self_attn]}",
    "prefetch-s1": "prefetch: {group_size: 2, num_in_group: 1, step: 1}",
    "prefetch-s2": "prefetch: {group_size: 1, num_in_group: 1, step: 2}",
    "prefetch-s3": "prefetch: {group_size: 4, num_in_group: 3, step: 3}",
    "prefetch-mlp": "prefetch: {group_size: 2, num_in_group: 2, step: 2, params: [mlp]}",
    "budget-prefetch": "backend: prefetch\nbudget_gib: 0.0004\nprefetch: {step: 2}",
    "rules": "rules:\n  - {match: [embed_tokens], place: uva}\n  - {match: [lm_head], place: prefetch}\n"
             "prefetch: {group_size: 2, num_in_group: 1, step: 2}",
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return save_models(tmp_path_factory.mktemp("models"), "llama", "moe", "tied")


@pytest.fixture(scope="module")
def expected(checkpoints):
    return {k: logits(reference(d)) for k, d in checkpoints.items()}


@pytest.mark.parametrize("kind", ["llama", "moe", "tied"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_backend_matches_plain_loading(tmp_path, checkpoints, expected, kind, policy):
    body = POLICIES[policy]
    if kind == "tied" and "lm_head" in body:
        body = body.replace("lm_head", "embed_tokens").replace("embed_tokens], place: uva", "norm], place: uva")
    if kind == "tied":  # 3 layers: a group of 4 would be larger than the stack; 3 / 2 streams the same layers 1, 2
        body = body.replace("group_size: 4, num_in_group: 3", "group_size: 3, num_in_group: 2")
    plan = make_plan(tmp_path, checkpoints[kind], body)
    model, handle = from_pretrained(plan, progress=False)
    assert torch.equal(logits(model), expected[kind])
    stats = handle.stats()
    placed = {p.value: 0 for p in Placement}
    for name, place in load_plan(plan).params.items():
        placed[place.value] += 1
    if placed["prefetch"]:
        assert stats.prefetch_copies > 0 and stats.gpu_buffer_bytes > 0
    handle.remove()
    assert torch.equal(logits(model), expected[kind])  # plain tensors again, same values


def test_uva_parameters_are_views_of_the_arena(tmp_path, checkpoints, expected):
    """The handle reads uva tensors through `arena.device_view`, on the CPU as on CUDA."""
    path = make_plan(tmp_path, checkpoints["llama"], "backend: uva\nuva: {offload_gib: 100}")
    model, handle = from_pretrained(path, progress=False)
    uva = [p for n, p in model.named_parameters() if load_plan(path).params.get(n) is Placement.UVA]
    lo, hi = handle.arena.base, handle.arena.base + handle.arena.nbytes
    assert len(uva) == 4 * 9 and all(lo <= p.data_ptr() < hi for p in uva)
    assert torch.equal(logits(model), expected["llama"])
    handle.remove()


def test_plan_exercises_all_placements(tmp_path, checkpoints):
    plan = load_plan(make_plan(tmp_path, checkpoints["moe"], POLICIES["rules"]))
    assert set(plan.params.values()) == {Placement.GPU, Placement.UVA, Placement.PREFETCH}
    assert plan.params["lm_head.weight"] is Placement.PREFETCH
    assert plan.params["model.embed_tokens.weight"] is Placement.UVA


def test_fused_experts_are_loaded_from_per_expert_tensors(tmp_path, checkpoints):
    plan = make_plan(tmp_path, checkpoints["moe"], POLICIES["prefetch-s2"])
    model, handle = from_pretrained(plan, progress=False)
    plain = reference(checkpoints["moe"])
    fused = dict(model.named_parameters())["model.layers.1.mlp.experts.gate_up_proj"]
    assert fused.shape == (4, 64, 64)  # [E, 2I, H], built from experts.{e}.gate_proj / up_proj
    handle.remove()
    assert torch.equal(dict(model.named_parameters())["model.layers.1.mlp.experts.gate_up_proj"],
                       dict(plain.named_parameters())["model.layers.1.mlp.experts.gate_up_proj"])


def test_wrong_slot_rotation_changes_outputs(tmp_path, checkpoints, expected):
    path = make_plan(tmp_path, checkpoints["llama"], POLICIES["prefetch-s2"])
    plan = load_plan(path)
    good = runtime.load(build_meta_model(checkpoints["llama"]), plan, checkpoint=checkpoints["llama"])
    assert torch.equal(logits(good.model), expected["llama"])
    # A rotation that ignores k mod step: every layer in slot 0, so a copy lands on a slot
    # whose layer has not run yet.
    wrong = tuple(dataclasses.replace(t, slot=0) for t in plan.prefetch.schedule)
    bad_plan = dataclasses.replace(plan, prefetch=dataclasses.replace(plan.prefetch, schedule=wrong))
    bad = runtime.load(build_meta_model(checkpoints["llama"]), bad_plan, checkpoint=checkpoints["llama"])
    assert not torch.equal(logits(bad.model), expected["llama"])


def test_a_forward_that_stops_part_way_does_not_poison_the_next(tmp_path, checkpoints, expected):
    plan = make_plan(tmp_path, checkpoints["llama"], POLICIES["prefetch-s2"])
    model, handle = from_pretrained(plan, progress=False)
    layer = model.get_submodule("model.layers.1")
    original = layer.forward

    def boom(*args, **kwargs):
        raise RuntimeError("out of memory, say")
    layer.forward = boom  # a test double for a failing layer
    with pytest.raises(RuntimeError, match="out of memory"):
        logits(model)
    layer.forward = original
    assert torch.equal(logits(model), expected["llama"])  # the slots were primed again
    assert handle.stats().prefetch_reprimes == 1
    assert torch.equal(logits(model), expected["llama"])
    with pytest.raises(OffplanError, match="ran out of order"):
        with torch.no_grad():
            model.get_submodule("model.layers.3")(torch.zeros(1, 1, 64, dtype=torch.bfloat16))
    handle.remove(restore=False)


def test_apply_moves_a_materialized_model(tmp_path, checkpoints, expected):
    plan = make_plan(tmp_path, checkpoints["moe"], POLICIES["rules"])
    model = reference(checkpoints["moe"])
    handle = runtime.apply(model, plan)
    assert torch.equal(logits(model), expected["moe"])
    assert handle.stats().uva_bytes > 0 and handle.stats().prefetch_bytes > 0
    handle.remove()
    assert torch.equal(logits(model), expected["moe"])


def test_stale_plan_is_refused(tmp_path, checkpoints):
    ckpt = save_model(llama_config(num_hidden_layers=2), tmp_path / "m")
    plan = make_plan(tmp_path, ckpt, POLICIES["uva-part"])
    save_model(llama_config(num_hidden_layers=2, intermediate_size=96), ckpt)  # same names, new shapes
    with pytest.raises(StalePlanError, match=r"stale: the checkpoint .* changed.*`plan build \S+\.policy\.yaml`"):
        runtime.load(build_meta_model(ckpt), plan)


def test_plan_for_another_model_lists_every_mismatch(tmp_path, checkpoints):
    plan = make_plan(tmp_path, checkpoints["llama"], "")
    with pytest.raises(ModelMismatchError) as err:
        runtime.load(build_meta_model(checkpoints["moe"]), plan, checkpoint=None)
    text = str(err.value)
    assert "plan does not match this model (Qwen3MoeForCausalLM)" in text
    assert "model tensor model.layers.*.mlp.experts.gate_up_proj (4 tensors, " in text
    assert "plan entry model.layers.*.mlp.gate_proj.weight (4 tensors, e.g. model.layers.0.mlp.gate_proj.weight)" \
        " is missing from the model" in text
    assert "more" not in text  # every name is accounted for


def test_fused_sources_placed_apart_are_refused(tmp_path, checkpoints):
    plan = load_plan(make_plan(tmp_path, checkpoints["moe"], ""))
    params = dict(plan.params)
    params["model.layers.0.mlp.experts.1.up_proj.weight"] = Placement.UVA
    bad = dataclasses.replace(plan, params=params)
    with pytest.raises(ModelMismatchError, match="gate_up_proj: expert 1's pieces are placed apart, but they are one row"):
        runtime.load(build_meta_model(checkpoints["moe"]), bad, checkpoint=checkpoints["moe"])


def test_plan_object_needs_a_checkpoint(tmp_path, checkpoints):
    plan = load_plan(make_plan(tmp_path, checkpoints["llama"], ""))
    with pytest.raises(OffplanError, match="pass checkpoint=DIR"):
        runtime.load(build_meta_model(checkpoints["llama"]), plan)


def test_failed_load_leaves_no_hooks(tmp_path, checkpoints, monkeypatch):
    plan = make_plan(tmp_path, checkpoints["llama"], POLICIES["prefetch-s2"])
    model = build_meta_model(checkpoints["llama"])

    def boom(*a, **k):
        raise RuntimeError("disk on fire")
    monkeypatch.setattr(load_steps, "materialize_buffers", boom)  # a load step after the hooks
    with pytest.raises(RuntimeError, match="disk on fire"):
        runtime.load(model, plan)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_cli_apply_generates(tmp_path, checkpoints, capsys):
    plan = make_plan(tmp_path, checkpoints["moe"], POLICIES["prefetch-s2"])
    assert main(["apply", str(plan), "--max-new-tokens", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [len(s["token_ids"]) for s in out["sequences"]] == [3] and out["stats"]["prefetch_bytes"] > 0
    assert (out["mode"], out["decode_steps"], out["predicted_mode"]) == ("eager", 2, "graph")
    assert out["predicted_step_us_as_run"] == load_plan(plan).cost.step_us_in(False) > 0  # the plan's eager step


def test_cli_apply_compiles_the_decode_step(capsys):
    """--compile: the step under torch.compile (no CUDA graph on the CPU), the bundled example's tokens unchanged."""
    example = "plans/examples/tiny-moe.plan.yaml"
    assert main(["apply", example, "--max-new-tokens", "4", "--device", "cpu", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(["apply", example, "--max-new-tokens", "4", "--device", "cpu", "--json", "--compile"]) == 0
    compiled = json.loads(capsys.readouterr().out)
    assert (plain["mode"], compiled["mode"]) == ("eager", "compiled")
    assert compiled["sequences"][0]["token_ids"] == plain["sequences"][0]["token_ids"]
    torch._dynamo.reset()


def test_cli_apply_generates_for_a_batch_of_prompts(tmp_path, checkpoints, capsys):
    """Several prompts, taken in turn up to --batch sequences: each sequence's tokens are those it would get
    alone (one prompt length: no padding, the same arithmetic; an MoE model: offplan's experts implementation
    gives each pair its own GEMV, as batched_mm does)."""
    plan = make_plan(tmp_path, checkpoints["moe"], POLICIES["prefetch-s2"])
    assert main(["apply", str(plan), "--max-new-tokens", "4", "--json", "--prompt", "abcd", "--prompt", "wxyz",
                 "--batch", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [s["prompt"] for s in out["sequences"]] == ["abcd", "wxyz", "abcd"]
    alone = []
    for prompt in ("abcd", "wxyz"):
        assert main(["apply", str(plan), "--max-new-tokens", "4", "--json", "--prompt", prompt]) == 0
        alone.append(json.loads(capsys.readouterr().out)["sequences"][0]["token_ids"])
    assert [s["token_ids"] for s in out["sequences"]] == [alone[0], alone[1], alone[0]]


def test_cli_apply_reports_the_bundled_example(capsys):
    """The bundled example on the CPU: what was loaded, its random weights, no tokenizer, the predicted step."""
    assert main(["apply", "plans/examples/tiny-moe.plan.yaml", "--max-new-tokens", "2", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert err == ""  # not a terminal: no bar, and apply reports the load itself
    lines = out.splitlines()
    assert re.fullmatch(r"loaded plans/examples/tiny-moe.plan.yaml on cpu in \d+\.\d\d s "
                        r"\(856\.0 KiB, [\d.]+ (KiB|MiB|GiB)/s\)", lines[0])
    assert lines[1] == ("  resident 408.0 KiB, uva 64.0 KiB, prefetch 384.0 KiB (+192.0 KiB buffers), on the "
                        "CPU (no CUDA: uva stays in host memory, prefetch copies synchronously)")
    assert lines[2:4] == [
        'note: the weights are random (its config.json says "offplan_random_weights": true): the generated tokens '
        "mean nothing; the run shows that the plan loads and runs",
        "note: no tokenizer beside the weights (tokenizer.json, tokenizer_config.json, tokenizer.model are missing "
        "from plans/examples/tiny-moe): the prompt's UTF-8 bytes are the input ids, and the output is token ids"]
    assert lines[4] == "generated 1 sequence of up to 2 tokens, greedily, each decode step eager (cpu)"
    assert re.fullmatch(r"  time to first token [\d.]+ ms \(prefill of 24 prompt tokens\)", lines[5])
    assert re.fullmatch(r"  decode [\d.]+ tokens/s per sequence: [\d.]+ ms per step over 1 step at batch 1", lines[6])
    assert lines[7] == ("  predicted 0.772 ms per decode step by the plan, for batch 1, CUDA graph replay, on NVIDIA H100 80GB "
                        "HBM3 (PCIe Gen5 host link); this run is on the CPU: they do not compare")
    assert re.fullmatch(r"  token ids \[\d+, \d+\]", lines[8]) and len(lines) == 9


def test_random_weights_need_a_declaration(tmp_path):
    from offplan.running import declares_random_weights
    assert not declares_random_weights(tmp_path)  # no config.json
    (tmp_path / "config.json").write_text('{"offplan_random_weights": "yes"}')
    assert not declares_random_weights(tmp_path)
    (tmp_path / "config.json").write_text('{"offplan_random_weights": true}')
    assert declares_random_weights(tmp_path)


def test_apply_refuses_a_plan_whose_params_disagree_with_its_layers(tmp_path, checkpoints, capsys):
    plan = make_plan(tmp_path, checkpoints["llama"], POLICIES["prefetch-s1"])
    text = plan.read_text()
    name = "  model.layers.1.mlp.down_proj.weight: "
    edited = text.replace(name + "prefetch", name + "gpu")
    assert edited != text
    plan.write_text(edited)
    with pytest.raises(InconsistentPlanError, match=r"layers\[2\]: model.layers.1 has gpu"):
        from_pretrained(plan, progress=False)
    capsys.readouterr()
    assert main(["apply", str(plan)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {plan}: the plan is inconsistent (edited by hand?)") and "Traceback" not in err


def test_progress_is_a_summary_line_in_logs_and_quiet_when_told(capsys):
    from runtime.place.loader import Progress
    bar = Progress(3 * 2**30)  # stderr is not a terminal here
    for _ in range(3):
        bar.update(2**30)
    assert bar.close() >= 0
    err = capsys.readouterr().err
    assert re.fullmatch(r"loading: 3\.00 GiB in \d+\.\d\d s \([\d.]+ (MiB|GiB)/s\)\n", err)
    bar = Progress(2**20, False)
    bar.update(2**20)
    bar.close()
    assert capsys.readouterr().err == ""
    bar = Progress(3 * 2**30, True)  # forced: rich draws the bar once, in binary units
    for _ in range(3):
        time.sleep(0.01)
        bar.update(2**30)
    bar.close()
    err = capsys.readouterr().err
    assert "3.0/3.0 GiB" in err and "GiB/s" in err and "GB" not in err.replace("GiB", "")


def test_cli_apply_stale_is_one_error(tmp_path, checkpoints, capsys):
    ckpt = save_model(llama_config(num_hidden_layers=2), tmp_path / "m")
    plan = make_plan(tmp_path, ckpt, "")
    save_model(llama_config(num_hidden_layers=3), ckpt)
    capsys.readouterr()
    assert main(["apply", str(plan)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: the plan is stale") and "Traceback" not in err
