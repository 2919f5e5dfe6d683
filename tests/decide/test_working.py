"""The experts' working memory (planner/decide/working.py): sized from the headers per phase, written in the plan's
summary, and counted in the GPU footprint that the budget holds."""
from __future__ import annotations

import re

import pytest

from offplan.cli import main
from planner.decide.staging import RING_BYTES
from planner.decide.working import LOOKAHEAD, Working, working
from planner.inputs.checkpoint import open_checkpoint
from planner.inputs.shard_header import TensorInfo
from planner.plan import Placement
from planner.planfile import load_plan
from synthetic import qwen3_moe, write_header_only

GPU, UVA, PREFETCH, CPU = Placement.GPU, Placement.UVA, Placement.PREFETCH, Placement.CPU
EXPERT = 3 * 768 * 2048 * 2  # one Qwen3-30B-A3B expert's bf16 weights: gate, up, down


def _group(experts: int, fp8: bool = False) -> dict[str, TensorInfo]:
    """One experts module's per-expert tensors: 64 x 32 projections, FP8 with 1 x 1 block scales if `fp8`."""
    out = {}
    for e in range(experts):
        for p, shape in (("gate_proj", (64, 32)), ("up_proj", (64, 32)), ("down_proj", (32, 64))):
            name = f"model.layers.0.mlp.experts.{e}.{p}.weight"
            out[name] = TensorInfo(name, "F8_E4M3" if fp8 else "BF16", shape, 2048 * (1 if fp8 else 2), "s", 0)
            if fp8:
                out[name + "_scale_inv"] = TensorInfo(name + "_scale_inv", "F32", (1, 1), 4, "s", 0)
    return out


def _working(tensors, place, top_k=2, batch=1, prompt=512, staged=None, host_tokens=0):
    group = "model.layers.0.mlp.experts"
    return working({group: tuple(tensors)}, {group: 4}, tensors, dict.fromkeys(tensors, place),
                   top_k, batch, prompt, staged or {}, host_tokens)


def test_a_bf16_module_stages_k_experts_at_batch_1_and_every_touched_one_above():
    t = _group(4)
    expert = 3 * 4096
    assert _working(t, UVA) == Working(2 * expert, 4 * expert, 0)  # one module: no lookahead
    assert _working(t, UVA, batch=2) == Working(4 * expert, 4 * expert, 0)  # min(E, 2 x 2)
    # a prefill of one token a prompt: its pairs, batch x 1 x k, stage min(E, 2 batch x 2 k) at batch 2
    assert _working(t, UVA, prompt=1) == Working(2 * expert, 2 * expert, 0)
    assert _working(t, UVA, batch=2, prompt=1) == Working(4 * expert, 4 * expert, 0)
    assert _working(t, UVA, prompt=1, staged={"model.layers.0.mlp.experts": 1000}) == Working(
        2 * expert, 4 * expert + 1000, 0)  # a staged layer: every expert, and the ring
    assert _working(t, GPU) == Working()  # transformers' own implementation: nothing staged
    assert _working(t, PREFETCH) == Working()


def test_fp8_experts_add_their_dequantized_copy_except_at_batch_1():
    t = _group(4, fp8=True)
    stored, dequantized = 3 * (2048 + 4), 3 * 2048 * 2
    assert _working(t, UVA) == Working(2 * stored, 4 * (stored + dequantized), 0)  # batch 1: multiplied in place
    assert _working(t, UVA, batch=2) == Working(4 * (stored + dequantized), 4 * (stored + dequantized), 0)
    assert _working(t, GPU, batch=2).decode_bytes == 4 * (stored + dequantized)  # quantized: staged even on the GPU
    assert _working(t, GPU).decode_bytes == 0  # batch 1, every expert in HBM: multiplied in place


def test_mxfp4_experts_add_their_dequantized_copy_except_at_batch_1():
    """gpt-oss's fused MXFP4 experts: [E, out, in/32, 16] blocks (4 bf16 bytes a stored byte dequantized) and
    [E, out, in/32] scales; at batch 1 gemv.py multiplies them from the stored bytes, as FP8's."""
    group = "model.layers.0.mlp.experts"
    t = {f"{group}.{p}_{kind}": TensorInfo(f"{group}.{p}_{kind}", "U8", shape, nbytes, "s", 0)
         for p, rows in (("gate_up_proj", 64), ("down_proj", 32))
         for kind, shape, nbytes in (("blocks", (4, rows, 1, 16), 4 * rows * 16), ("scales", (4, rows, 1), 4 * rows))}
    stored, dequantized = (64 + 32) * 17, (64 + 32) * 16 * 4  # one expert's
    assert _working(t, UVA) == Working(2 * stored, 4 * (stored + dequantized), 0)  # batch 1: multiplied as stored
    assert _working(t, UVA, batch=2) == Working(4 * (stored + dequantized), 4 * (stored + dequantized), 0)
    assert _working(t, GPU).decode_bytes == 0


def test_the_lookahead_is_the_runtimes():
    pytest.importorskip("torch")
    from runtime.execute import lookahead
    assert LOOKAHEAD == lookahead.LOOKAHEAD


def test_experts_on_cpu_add_the_host_engines_outputs_to_the_buffers():
    """The host engine's output buffer: host_tokens x k rows of the hidden size (down_proj is [H 32, I 64]) in
    bf16, for experts the host computes; none for experts on uva, nor with no tokens for the host."""
    t = _group(4)
    assert _working(t, CPU, host_tokens=192).buffer_bytes == 192 * 2 * 32 * 2
    assert _working(t, CPU, top_k=3, host_tokens=10).buffer_bytes == 10 * 3 * 32 * 2
    assert _working(t, CPU).buffer_bytes == 0
    assert _working(t, UVA, host_tokens=192).buffer_bytes == 0


@pytest.mark.parametrize("batch, decode", [(1, 8 * EXPERT), (8, 64 * EXPERT)])
def test_qwen3_30b_a3b_experts_on_uva_count_their_working_memory_against_the_budget(tmp_path, capsys, batch, decode):
    """Every expert on uva (a rule), nothing else to offload that saves memory: a budget of 1.5 GiB cannot hold
    the working memory, so the build fails naming it; the smallest budget it suggests builds, one byte less not."""
    write_header_only(tmp_path / "ckpt", qwen3_moe(layers=2))
    # a staged prefill gathers a layer's 128 experts and streams through a ring of 1 GiB (of the layer's 1.13 GiB);
    # a decode step's `decode` is smaller; the lookahead reads 2 experts ahead
    peak = LOOKAHEAD * EXPERT + 128 * EXPERT + RING_BYTES
    resident = open_checkpoint(tmp_path / "ckpt").total_bytes - 2 * 128 * EXPERT  # all but the experts

    def build(budget: str) -> int:
        (tmp_path / "p.policy.yaml").write_text(
            f"format_version: 1\ncheckpoint: ./ckpt\nbudget_gib: {budget}\nrules:\n  - match: [experts]\n"
            f"    place: uva\nworkload: {{batch_size: {batch}, experts_per_token: 8}}\n")
        return main(["build", str(tmp_path / "p.policy.yaml"), "-o", str(tmp_path / "p.plan.yaml")])

    assert build("1.5") == 1
    err = " ".join(capsys.readouterr().err.split())
    assert f"the plan needs 3.37 GiB ({resident + peak:,} bytes) of GPU memory but budget_gib 1.5" in err
    assert ("2.14 GiB of it are the experts' working memory as the model runs (their touched rows at a decode step "
            f"of batch {batch} or a prefill of {batch} x 512 tokens): a smaller workload.batch_size") in err
    smallest = re.search(r"is budget_gib: (\S+) \(", err)[1]
    assert build(smallest) == 0
    s = load_plan(tmp_path / "p.plan.yaml").summary
    assert (s.working_decode_bytes, s.working_prefill_bytes, s.working_buffer_bytes) == (
        decode, 128 * EXPERT + RING_BYTES, LOOKAHEAD * EXPERT)
    assert s.gpu_footprint_bytes == s.gpu_bytes + s.working_peak_bytes == resident + peak == int(float(smallest) * 2**30)
    capsys.readouterr()
    assert main(["show", str(tmp_path / "p.plan.yaml")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert ("GPU footprint: 1.23 GiB resident + 2.14 GiB experts' working memory = 3.37 GiB (budget 3.37 GiB: fits"
            in out)
    assert (f"experts' working memory: a decode step at batch {batch} {'72.0' if batch == 1 else '576.0'} MiB, a "
            "prefill 2.12 GiB, buffers 18.0 MiB; the footprint counts the buffers and the larger phase") in out
    assert build(repr((resident + peak - 1) / 2**30)) == 1


@pytest.mark.parametrize("seed", range(4))
def test_groups_read_once_per_kind_of_layer_size_what_each_group_read_alone_sizes(seed):
    """working.py `GroupFacts` reads the groups of layers alike once (alike.py): the same bytes as reading each."""
    import random

    from headeronly import infos
    from planner.decide.working import GroupFacts
    from planner.layers.alike import Shapes
    from planner.layers.graph import build_graph
    from planner.layers.groups import FusedGroups
    from synthetic import deepseek_v3

    t = infos(deepseek_v3(layers=6, dense_layers=1, hidden=256, intermediate=384, experts=6, moe_intermediate=128,
                          heads=2, q_lora=128, kv_lora=128, nope=16, rope=8, v_head=16, vocab=64))
    stack = build_graph(list(t)).stack_layers()
    groups = FusedGroups.of_layers(stack, t)
    moe = {g: groups.experts(g) for g in groups.members}
    facts = GroupFacts(groups.members, t, stack, Shapes(t))
    assert len(facts.kinds) == len(moe) == 6 and len(set(facts.kinds.values())) == 2  # layer 6 (MTP): its own
    rng = random.Random(seed)
    for _ in range(5):
        place = {n: rng.choice([GPU, UVA, CPU, PREFETCH]) if rng.random() < 0.3 else GPU for n in t}
        for batch in (1, 4):
            assert working(groups.members, moe, t, place, 2, batch, 512, {}, 64, facts) == working(
                groups.members, moe, t, place, 2, batch, 512, {}, 64)
