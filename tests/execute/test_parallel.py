"""Tensor parallelism on the CPU (gloo, two processes): each process loads its share of the plan and the pair
computes what one process computes with the whole model.

Tolerance, and why: each GPU's share of a rowwise projection (o_proj, down_proj, the experts' down) sums
half of the input features, rounds to the model's dtype, and the all-reduce adds the shares (in that dtype
again), where one process sums all of them before its one rounding. In bf16 a reduced output differs from
the one-process output by a rounding or two, and the logits, through the tiny models' layers, by under 2% of
their largest magnitude (measured 0.7-0.8%); that is enough to flip a near-tie of these random models'
flat logits (one measured exact tie in bf16), so greedy tokens are compared in float32, where the same
checkpoints' logits agree within 1e-5 of their largest. The two processes' logits are bitwise equal to
each other in both (the all-reduce hands every process the same sum).
"""
from __future__ import annotations

import dataclasses
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from offplan.cli import main  # noqa: E402
from planner.errors import OffplanError, StalePlanError  # noqa: E402
from planner.inputs.hardware import H100, dumps_hardware  # noqa: E402
from runtime.execute.host import native  # noqa: E402
from runtime.execute.generation import PlainHandle  # noqa: E402
from runtime.distributed.launch import run_ranks  # noqa: E402

from parallel_ranks import PROMPT, load_and_run, load_with  # noqa: E402
from quantized_models import write_fp8  # noqa: E402
from tiny_models import (deepseek_v3_config, glm4_moe_config, llama_config, logits, make_plan,  # noqa: E402
                         qwen3_moe_config, reference, save_family, save_model)

# each GPU's share of the experts' intermediate features is 32, as one GPU's whole is in the other tests: at 16,
# torch's grouped_mm (transformers' default experts implementation) failed in a CUDA graph capture on the H200
# ("Cannot copy between CPU and CUDA tensors during CUDA graph capture")
MOE = qwen3_moe_config(moe_intermediate_size=64)
TOLERANCE = {torch.bfloat16: 0.02, torch.float32: 1e-5}  # of the largest logit's magnitude (module doc)
POLICIES = {"gpu": "gpus: 2", "uva": "gpus: 2\nuva: {offload_gib: 0.0002}",
            "prefetch": "gpus: 2\nprefetch: {group_size: 2, num_in_group: 1, step: 2}",
            "experts": "gpus: 2\nrules:\n  - {match: [experts], place: uva}",
            # each process computes its share of the experts on the host with 1 thread (hw.yaml: 2 for 2 processes)
            "cpu": "gpus: 2\nhardware: hw.yaml\nrules:\n  - {match: [experts], place: cpu}"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    made = {"llama": save_model(llama_config(), root / "llama"), "moe": save_model(MOE, root / "moe")}
    made["llama32"] = save_model(llama_config(), root / "llama32", dtype=torch.float32)
    made["moe32"] = save_model(MOE, root / "moe32", dtype=torch.float32)
    return made


def _hardware(tmp_path):
    """The profile the "cpu" policy names: 2 host threads, 1 for each process."""
    (tmp_path / "hw.yaml").write_text(dumps_hardware(dataclasses.replace(H100, cpu_threads=2)))


def _plans(tmp_path, checkpoints):
    _hardware(tmp_path)
    plans = {}
    for kind in ("llama", "moe", "llama32", "moe32"):
        for name, body in POLICIES.items():
            if name in ("experts", "cpu") and kind.startswith("llama") or kind.endswith("32") and name == "gpu":
                continue
            plans[kind, name] = str(make_plan(tmp_path, checkpoints[kind], body, name=f"{kind}-{name}"))
    return plans


def test_two_processes_compute_what_one_does(tmp_path, checkpoints):
    plans = _plans(tmp_path, checkpoints)
    ranks = run_ranks(load_and_run, 2, list(plans.values()), "cpu", device="cpu")
    for (kind, name), zero, one in zip(plans, *ranks):
        dtype = torch.float32 if kind.endswith("32") else torch.bfloat16
        ref = reference(checkpoints[kind], dtype=dtype)
        want = logits(ref)
        assert torch.equal(zero["logits"], one["logits"]), (kind, name)
        err = (zero["logits"].float() - want.float()).abs().max().item()
        assert err <= TOLERANCE[dtype] * want.float().abs().max().item(), (kind, name, err)
        assert zero["tokens"] == one["tokens"]
        if dtype is torch.float32:
            assert zero["tokens"] == PlainHandle(ref).generate(torch.tensor(PROMPT), 8).tokens, (kind, name)
        # each process holds half of every split tensor, the whole of the rest
        full = {n: tuple(p.shape) for n, p in ref.named_parameters()}
        q = "model.layers.0.self_attn.q_proj.weight"
        assert zero["shapes"][q] == (full[q][0] // 2, full[q][1])
        assert zero["shapes"]["model.layers.0.self_attn.o_proj.weight"] == (full[q][1], full[q][0] // 2)
        assert zero["shapes"]["model.embed_tokens.weight"] == full["model.embed_tokens.weight"]
        assert zero["shapes"]["lm_head.weight"] == (full["lm_head.weight"][0] // 2, full["lm_head.weight"][1])
        if kind == "moe":
            gu = "model.layers.0.mlp.experts.gate_up_proj"
            assert zero["shapes"][gu] == (full[gu][0], full[gu][1] // 2, full[gu][2])
        layers = ref.config.num_hidden_layers
        assert zero["hooks"] == (2 * layers, 1)  # o_proj and the MLP or experts of each layer; the head
        assert zero["bytes"] == one["bytes"] and sum(zero["bytes"]) < sum(p.nbytes for p in ref.parameters())


# per family with shared experts: its config, and (parameter of layer 1, the dim each process holds half of; None:
# whole on every process)
SHARED = {"deepseek_v3": (deepseek_v3_config, (("self_attn.q_b_proj.weight", None), ("mlp.experts.gate_up_proj", 1),
                                               ("mlp.experts.down_proj", 2),
                                               ("mlp.shared_experts.down_proj.weight", 1))),
          "glm4_moe": (glm4_moe_config, (("self_attn.q_proj.bias", 0), ("self_attn.o_proj.weight", 1),
                                         ("mlp.experts.gate_up_proj", 1), ("mlp.shared_experts.up_proj.weight", 0)))}


@pytest.mark.parametrize("family", list(SHARED))
def test_shared_experts_families_share_what_one_process_computes(tmp_path, family):
    """DeepSeek-V3 (tiny: MLA, whose attention transformers' plan leaves whole on every process) and GLM-4.5
    (attention split by heads, its q, k and v biases with their weights), each with a dense first layer, then
    routed experts and a shared one, on uva, on cpu or on the GPU's side. Against transformers in one process,
    within TOLERANCE (module doc); float32 tokens equal."""
    make_config, params = SHARED[family]
    _hardware(tmp_path)
    plans, checkpoints = {}, {}
    for dtype in (torch.bfloat16, torch.float32):
        kind = str(dtype).removeprefix("torch.")
        checkpoints[dtype] = save_family(make_config(), tmp_path / kind, dtype=dtype)  # the routers' biases too
        for name in ("uva", "experts", "cpu"):
            plans[dtype, name] = str(make_plan(tmp_path, checkpoints[dtype], POLICIES[name], name=f"{kind}-{name}"))
    zero, one = run_ranks(load_and_run, 2, list(plans.values()), "cpu", device="cpu")
    for (dtype, name), a, b in zip(plans, zero, one):
        ref = reference(checkpoints[dtype], dtype=dtype)
        want = logits(ref)
        assert torch.equal(a["logits"], b["logits"]) and a["tokens"] == b["tokens"], (dtype, name)
        err = (a["logits"].float() - want.float()).abs().max().item()
        assert err <= TOLERANCE[dtype] * want.float().abs().max().item(), (dtype, name, err)
        if dtype is torch.float32:
            assert a["tokens"] == PlainHandle(ref).generate(torch.tensor(PROMPT), 8).tokens, name
        full = {n: tuple(p.shape) for n, p in ref.named_parameters()}
        for param, dim in params:
            shape = list(full[f"model.layers.1.{param}"])
            if dim is not None:
                shape[dim] //= 2
            assert a["shapes"][f"model.layers.1.{param}"] == tuple(shape), (name, param)


def host_share(rank: int, plan: str) -> tuple[int, int]:
    """One process of test_each_process_computes_its_share_of_the_experts_on_its_own_host_threads: its host
    engine's threads, and the forwards it computed experts in over a short greedy decode."""
    from runtime.hf import from_pretrained
    model, handle = from_pretrained(plan, device="cpu", progress=False)
    try:
        handle.generate(torch.tensor(PROMPT), 4, eager=True)
        return handle.host_experts.threads, handle.host_experts.host_calls
    finally:
        handle.remove(restore=False)


def test_each_process_computes_its_share_of_the_experts_on_its_own_host_threads(tmp_path, checkpoints):
    """A plan for 2 GPUs names each process's host threads (half the profile's 2); each process's host computes
    its share of the experts on cpu, in every forward of the prompt and the decode."""
    _hardware(tmp_path)
    plan = make_plan(tmp_path, checkpoints["moe"], POLICIES["cpu"], name="host")
    for threads, calls in run_ranks(host_share, 2, str(plan), device="cpu"):
        assert threads == 1 and calls >= 2 * MOE.num_hidden_layers  # the prompt's and at least one step's layers


def load_error(rank: int, plan: str) -> str:
    """One process of the test below: the error its load gives ("" if none)."""
    from runtime.hf import from_pretrained
    try:
        from_pretrained(plan, device="cpu", progress=False)[1].remove(restore=False)
    except OffplanError as e:
        return str(e)
    return ""


def test_more_threads_in_all_than_the_host_has_is_refused_by_every_process(tmp_path, checkpoints):
    """Each process's share of the profile's threads fits the cores it may run on, but together they would
    oversubscribe the host: every process refuses the load, naming both counts."""
    host, cores = os.cpu_count(), len(os.sched_getaffinity(0))
    each = (host + 2) // 2
    if each > cores:
        pytest.skip(f"this process may run on {cores} of the host's {host} cores: fewer than half")
    (tmp_path / "hw.yaml").write_text(dumps_hardware(dataclasses.replace(H100, cpu_threads=host + 2)))
    plan = make_plan(tmp_path, checkpoints["moe"], POLICIES["cpu"], name="oversubscribed")
    want = (f"the plan computes experts on cpu with {each} host threads (cost.cpu_threads) in each of its 2 processes,"
            f" {2 * each} in all, but this host has {host} cores: rebuild it with a hardware profile measured at "
            f"`plan calibrate --cpu-threads {host}`")
    assert run_ranks(load_error, 2, str(plan), device="cpu") == [want, want]


def test_fp8_shares_compute_what_one_process_does(tmp_path, checkpoints):
    """Block-scaled FP8 (16 x 16 blocks: the tiny model's shares hold whole blocks): each process dequantizes its
    share of the weights with its share of the scales. Against the same FP8 checkpoint in one process: float32
    tokens equal, bf16 logits within TOLERANCE (module doc)."""
    plans, single = {}, {}
    _hardware(tmp_path)
    for kind in ("moe", "moe32"):
        fp8 = write_fp8(checkpoints[kind], tmp_path / f"{kind}-fp8", block=16)
        # the host's native kernel (where built: `pip install -e .`) computes FP8 experts, in bf16
        for name in ("uva", "experts") + (("cpu",) if kind == "moe" and native.library() is not None else ()):
            plans[kind, name] = str(make_plan(tmp_path, fp8, POLICIES[name], name=f"{kind}-fp8-{name}"))
        single[kind] = str(make_plan(tmp_path, fp8, "rules:\n  - {match: [experts], place: uva}",
                                     name=f"{kind}-fp8-one"))
    zero, one = run_ranks(load_and_run, 2, list(plans.values()), "cpu", device="cpu")
    alone = {kind: load_and_run(0, [path], "cpu")[0] for kind, path in single.items()}
    for (kind, name), a, b in zip(plans, zero, one):
        want = alone[kind]
        assert torch.equal(a["logits"], b["logits"]), (kind, name)
        err = (a["logits"].float() - want["logits"].float()).abs().max().item()
        tolerance = TOLERANCE[torch.float32 if kind.endswith("32") else torch.bfloat16]
        assert err <= tolerance * want["logits"].float().abs().max().item(), (kind, name, err)
        if kind.endswith("32"):
            assert a["tokens"] == want["tokens"], (kind, name)
        # each holds half of each split FP8 weight and of its scales, as stored
        q = "model.layers.0.self_attn.q_proj.weight"
        assert (a["shapes"][q], a["dtypes"][q]) == ((32, 64), torch.float8_e4m3fn)
        assert a["buffers"][q + "_scale_inv"] == (2, 4)
        assert a["bytes"] == b["bytes"] and sum(a["bytes"]) < sum(want["bytes"])


def test_a_split_transformers_does_not_make_is_refused(tmp_path, checkpoints):
    plan = make_plan(tmp_path, checkpoints["llama"], "gpus: 2", name="odd")
    odd = (("model.layers.*.input_layernorm.weight", 0), ("model.layers.*.self_attn.q_proj.weight", 0))
    message, _ = run_ranks(load_with, 2, str(plan), odd, "cpu", device="cpu")
    assert "model.layers.0.input_layernorm.weight: the plan splits it along dim 0" in message
    assert "transformers' plan says nothing for it" in message


def test_outside_torch_distributed_or_at_another_world_size(tmp_path, checkpoints):
    import torch.distributed as dist
    from runtime.hf import from_pretrained
    plan = make_plan(tmp_path, checkpoints["llama"], "gpus: 2", name="two")
    with pytest.raises(OffplanError, match="runs one process per GPU under torch.distributed"):
        from_pretrained(plan, device="cpu", progress=False)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        with pytest.raises(StalePlanError, match=r"built for 2 GPUs \(parallel.gpus: 2\) but torch.distributed's "
                                                 r"world size is 1"):
            from_pretrained(plan, device="cpu", progress=False)
    finally:
        dist.destroy_process_group()


def test_plan_apply_starts_the_processes(tmp_path, checkpoints, capsys):
    two = make_plan(tmp_path, checkpoints["moe"], POLICIES["experts"], name="apply2")
    one = make_plan(tmp_path, checkpoints["moe"], "rules:\n  - {match: [experts], place: uva}", name="apply1")
    assert main(["apply", str(one), "--device", "cpu", "--max-new-tokens", "4"]) == 0
    single = capsys.readouterr().out.splitlines()[-1]
    assert main(["apply", str(two), "--device", "cpu", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallel over 2 processes" in out
    assert out.splitlines()[-1] == single  # the same token ids
    assert main(["apply", str(two), "--device", "cpu", "--gpus", "3"]) == 1
    err = capsys.readouterr().err
    assert "--gpus 3: the plan was built for 2 GPUs (parallel.gpus: 2)" in err and "Traceback" not in err
    assert main(["apply", str(one), "--device", "cpu", "--gpus", "2"]) == 1
    assert "the plan was built for one GPU" in capsys.readouterr().err
    assert main(["apply", str(two), "--device", "cpu", "--compile"]) == 1
    err = capsys.readouterr().err
    assert "--compile: not with a tensor-parallel plan" in err and "runs on 2 GPUs" in err and "Traceback" not in err


def test_each_rank_takes_its_share_of_the_cores(monkeypatch):
    """Ranks that each started one thread per core would spin against each other in the load's copies."""
    from runtime.distributed.launch import threads_per_rank
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert [threads_per_rank(n) for n in (1, 2, 4, 32)] == [16, 8, 4, 1]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads_per_rank(2) == 3
