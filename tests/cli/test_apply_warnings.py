"""What `plan apply` says beside the tokens: a plan `plan check` calls stale while the runtime still loads it (its
checkpoint unchanged) is applied as it is, with one warning saying why, where a current plan gets none; a run past
the model's positions is warned of; the load line tells experts on cpu from uva; a replay that could not run
right is refused before it runs."""
from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from offplan.cli import main  # noqa: E402
from planner.planfile import load_plan  # noqa: E402
from planner.units import human  # noqa: E402
from tiny_models import make_plan, qwen3_moe_config, save_model  # noqa: E402


def test_a_stale_plan_that_still_loads_is_applied_with_a_warning(tmp_path, capsys):
    checkpoint = save_model(qwen3_moe_config(num_hidden_layers=2), tmp_path / "m")
    plan = make_plan(tmp_path, checkpoint, "prefetch: {group_size: 1, num_in_group: 1, step: 2}")
    assert main(["apply", str(plan), "--max-new-tokens", "2"]) == 0
    assert "warning" not in capsys.readouterr().err
    policy = plan.parent / load_plan(plan).policy_path
    policy.write_text(policy.read_text() + "# edited\n")
    assert main(["apply", str(plan), "--max-new-tokens", "2"]) == 0
    assert capsys.readouterr().err == (
        f"warning: {plan} is stale (the policy {policy} changed since the plan was built); applied as it is: rebuild "
        "it for what its inputs now ask (`plan check` says how)\n")


def test_a_plan_whose_policy_is_gone_is_applied_with_a_warning(tmp_path, capsys):
    """`plan check` calls it stale (its policy is gone): `plan apply` says so too, and applies it as it is."""
    checkpoint = save_model(qwen3_moe_config(num_hidden_layers=2), tmp_path / "m")
    plan = make_plan(tmp_path, checkpoint, "prefetch: {group_size: 1, num_in_group: 1, step: 2}")
    policy = plan.parent / load_plan(plan).policy_path
    policy.unlink()
    capsys.readouterr()  # the checkpoint writer's progress
    assert main(["apply", str(plan), "--max-new-tokens", "2"]) == 0
    assert capsys.readouterr().err == (
        f"warning: {plan} is stale (the policy {policy} named by the plan is gone); applied as it is: rebuild it "
        "for what its inputs now ask (`plan check` says how)\n")


def test_a_plan_whose_hardware_profile_is_gone_is_applied_with_a_warning(tmp_path, capsys):
    """The policy names a hardware profile that is gone: stale as `plan check` says, applied as it is."""
    from planner.inputs.hardware import H100, dumps_hardware

    checkpoint = save_model(qwen3_moe_config(num_hidden_layers=2), tmp_path / "m")
    (tmp_path / "hw.yaml").write_text(dumps_hardware(H100))
    plan = make_plan(tmp_path, checkpoint, "hardware: hw.yaml\nprefetch: {group_size: 1, num_in_group: 1, step: 2}")
    (tmp_path / "hw.yaml").unlink()
    capsys.readouterr()
    assert main(["apply", str(plan), "--max-new-tokens", "2"]) == 0
    assert capsys.readouterr().err == (
        f"warning: {plan} is stale (the hardware profile {tmp_path / 'hw.yaml'} named by the policy is gone); applied "
        "as it is: rebuild it for what its inputs now ask (`plan check` says how)\n")


def test_a_run_past_the_models_positions_is_warned_of(tmp_path, capsys):
    """The default prompt's 24 bytes (no tokenizer: one id each) and 2 new tokens, on a model of 16 positions."""
    checkpoint = save_model(qwen3_moe_config(num_hidden_layers=2, max_position_embeddings=16), tmp_path / "m")
    plan = make_plan(tmp_path, checkpoint, "prefetch: {group_size: 1, num_in_group: 1, step: 2}")
    capsys.readouterr()
    assert main(["apply", str(plan), "--max-new-tokens", "2"]) == 0
    assert capsys.readouterr().err == (
        "warning: 24 prompt tokens and --max-new-tokens 2 run past the model's 16 positions (max_position_embeddings "
        "in config.json): what it makes there is past what it was made for\n")


def test_the_load_line_tells_experts_on_cpu_from_uva(tmp_path, capsys):
    """Every routed expert on cpu: the load line does not call their bytes uva's alone, and gives the plan's
    figure for them."""
    from planner.inputs.hardware import H100, dumps_hardware

    checkpoint = save_model(qwen3_moe_config(num_hidden_layers=2), tmp_path / "m")
    (tmp_path / "hw.yaml").write_text(dumps_hardware(dataclasses.replace(H100, cpu_threads=1)))
    plan = make_plan(tmp_path, checkpoint, "hardware: hw.yaml\nrules:\n  - {match: [experts], place: cpu}")
    cpu = load_plan(plan).summary.cpu_bytes
    capsys.readouterr()
    assert main(["apply", str(plan), "--max-new-tokens", "2", "--device", "cpu"]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert line.startswith("  resident ") and (f", uva and cpu {human(cpu)} (the plan puts {human(cpu)} of the "
                                               "checkpoint's on cpu, computed by the host), prefetch 0 B") in line


def test_a_replay_past_a_sliding_window_or_a_refused_capture_is_one_error_naming_eager():
    """offplan/step_checks.py, what `plan apply` checks before it replays decode steps on a GPU: transformers' static
    sliding-window cache rolls by a Python count that a replay never advances (the window of 8 here), so a cache
    past it is refused, and within it (or with no sliding layer) it runs (runtime/execute/tokens.py counts those
    layers' length on the device for their masks); a capture torch refuses becomes one error."""
    from offplan.step_checks import capture_refused, check_replays
    from planner.errors import OffplanError
    from tiny_models import gpt_oss_config
    with pytest.raises(OffplanError, match=r"^GptOss: its sliding-window attention keeps 8 tokens, .* this call's "
                                           r"cache holds 128 .* \(`eager=True`, `plan apply --eager`\)$"):
        check_replays(gpt_oss_config(), 20, "GptOss")
    check_replays(gpt_oss_config(sliding_window=128), 100, "GptOss")
    check_replays(qwen3_moe_config(), 1000, "Qwen3Moe")
    with pytest.raises(OffplanError, match=r"could not be captured in a CUDA graph \(.*during CUDA graph capture.*\)"
                                           r": run with --eager"):
        with capture_refused():
            raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture")
    with pytest.raises(OffplanError, match=r"\(CUDA error: operation not permitted when stream is capturing\)"):
        with capture_refused():
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
    with pytest.raises(RuntimeError, match="out of memory"):  # anything else goes on as it was
        with capture_refused():
            raise RuntimeError("CUDA out of memory")


def test_plan_apply_refuses_a_replay_of_a_sliding_window_model_before_loading(tmp_path, capsys, monkeypatch):
    """Where the decode steps would be replayed (a CUDA device, no --eager), a Gemma 3 plan whose window (8) no cache
    fits is refused before its weights load, with one error naming --eager and exit 1; with --eager it loads and runs
    (here on the CPU). With a window of 128, --max-new-tokens past it is refused before loading too (with a prompt
    of one token at least), and within it the check lets the load begin."""
    import torch

    import offplan.running
    from tiny_models import gemma3_text_config
    plan = make_plan(tmp_path, save_model(gemma3_text_config(), tmp_path / "gemma"), "")
    capsys.readouterr()  # the checkpoint writer's progress
    loads = offplan.running.from_pretrained
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        m.setattr(offplan.running, "from_pretrained", lambda *a, **k: pytest.fail("loaded before refusing"))
        assert main(["apply", str(plan), "--max-new-tokens", "2"]) == 1
    assert capsys.readouterr().err.strip() == (
        "error: Gemma3ForCausalLM: its sliding-window attention keeps 8 tokens, and a decode step replayed from a CUDA "
        "graph cannot roll that window (transformers' static sliding-window cache counts in Python); this call's cache "
        "holds 128 (prompt and new tokens, rounded up to a multiple of 128): generate eagerly (`eager=True`, `plan "
        "apply --eager`)")
    assert offplan.running.from_pretrained is loads
    assert main(["apply", str(plan), "--max-new-tokens", "2", "--eager"]) == 0
    wide = make_plan(tmp_path, save_model(gemma3_text_config(sliding_window=128), tmp_path / "wide"), "", name="wide")
    capsys.readouterr()

    class Loaded(Exception):
        pass

    def load(*args, **kw):
        raise Loaded
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        m.setattr(offplan.running, "from_pretrained", load)
        assert main(["apply", str(wide), "--max-new-tokens", "200"]) == 1
        assert "keeps 128 tokens" in capsys.readouterr().err  # no load: `load` would have raised
        with pytest.raises(Loaded):
            main(["apply", str(wide), "--max-new-tokens", "8"])


def test_a_sliding_window_layers_python_count_sets_its_mask_so_a_replay_would_attend_wrongly():
    """Why runtime/execute/tokens.py `replayable` counts sliding layers on the device (transformers 5.17): a decode
    step of Gemma 3 whose sliding layers' Python count stands at another position (as a replay's stays at its
    capture's), all its tensors right, gives other logits. Once this holds no more, transformers counts on the
    device itself and the swap can go."""
    import torch
    from transformers import AutoModelForCausalLM, StaticCache
    from tiny_models import gemma3_text_config
    config = gemma3_text_config()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    logits = []
    for count in (None, 6):  # the count as the step's position (3), or as a capture at position 6 left it
        cache = StaticCache(config=config, max_cache_len=8)
        with torch.no_grad():
            model(torch.tensor([[5, 17, 99]]), past_key_values=cache, cache_position=torch.arange(3))
            for layer in cache.layers:
                if count is not None and hasattr(layer, "cumulative_length_int"):
                    layer.cumulative_length_int = count
            logits.append(model(torch.tensor([[41]]), past_key_values=cache, cache_position=torch.tensor([3])).logits)
    assert not torch.equal(*logits)
