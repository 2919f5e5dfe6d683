"""The cost model's prefill (time to first token) on plain data with round-number hardware, and mixed weighing
the whole request: prefill and decode steps."""
from __future__ import annotations

import dataclasses

import pytest

from headeronly import GPU, PREFETCH, UVA, infos, policy
from planner.decide.cost import CostModel
from planner.decide.placement import decide
from planner.inputs.hardware import Hardware
from planner.inputs.policy import Workload
from planner.layers.graph import build_graph
from planner.decide.schedule import pipelined
from planner.layers.groups import FusedGroups
from test_cost import HW, moe

# 1 MB/us copy, 0.5 MB/us UVA, 10 MB/us HBM, 10^6 FLOP/us (1 TFLOP/s); staging above 64 tokens; an MoE decoder
# layer's kernels besides GEMMs and attention 1 us per token (a dense one's 0.5)
HW_PREFILL = dataclasses.replace(HW, matmul_tflops=1.0, stage_above_tokens=64, prefill_token_ns=500.0,
                                 moe_prefill_token_ns=1000.0)


def prefill_placement(t):
    """Layer 0: attention and every expert on uva; layer 1: attention prefetched, experts resident; the
    embedding on uva (it reads rows), the head resident."""
    place = {n: GPU for n in t}
    for n in t:
        if n.startswith("model.layers.0.") or n == "model.embed_tokens.weight":
            place[n] = UVA
    place["model.layers.1.self_attn.o_proj.weight"] = PREFETCH
    return place


@pytest.mark.parametrize("tokens, stage, want", [
    # T = 100 > 64: layer 0's attention is staged (a 1 MB copy), and its experts too: 100 tokens touch
    # 1 - (3/4)^100 = all of them, over the 0.5 UVA / 1 copy bandwidths it takes to favour copying them whole
    # (12 MB more). Copies overlap compute, reads in place add to it. T x 2 FLOP per element, and a decoder
    # layer's other kernels 1 us per token (100):
    # Each layer's share is when it ends less when the one before it did; the link reads in place and copies in
    # turn (schedule.py `pipelined`):
    #   embedding: 100 of 1000 rows through UVA, in place                          0.1 MB / 0.5    =   200
    #   layer 0: 13 MB copied once the link is free (200 to 13200), then 2e8 FLOP (attention) + 12 x 2e8 x 1/4
    #            (each expert computes a quarter of the tokens) 800 + 13 MB staged / HBM 1300 + 100      = 15200
    #   layer 1: 1 MB prefetched after layer 0's copy (in by 14200), then 800 + 1300 + 100           =  2200
    #   head:    the last position's logits: 2 + 1 MB / HBM 100, not a decoder layer               =   102
    (100, True, (200, 15200, 2200, 102)),
    # not staged: a GEMM reads the attention in place ceil(100 / 64) = 2 times, the experts gather the 12 MB
    # touched once: 800 + 100 + 14 MB / 0.5 28000; layer 1's copy follows those reads on the link (28200 to
    # 29200), 100 after layer 0 ends
    (100, False, (200, 28900, 2300, 102)),
    # T = 64 is not above the threshold: 64 of 1000 rows; 2 x 64 FLOP per element; layer 0: 128 + 384 of
    # GEMMs + 64 + the attention read in place once (2000) and the touched experts (24000); layer 1's copy after
    # those reads (26128 to 27128), 424 after layer 0 ends, then its 1876; the head as above
    (64, True, (128, 26576, 2300, 102)),
])
def test_prefill_prediction_by_hand(tokens, stage, want):
    t = infos(moe(layers=2, experts=4))
    g = build_graph(t)
    groups = FusedGroups.find(n for l in g.stack_layers() for n in l.params)
    m = CostModel(g, t, HW_PREFILL, 1, groups, 1, prompt_tokens=tokens, stage=stage)
    p = m.predict(prefill_placement(t))
    assert tuple(l.prefill_us for l in p.layers) == want
    assert (p.prompt_tokens, p.prefill_us) == (tokens, sum(want))
    assert p.request_us(10) == sum(want) + 10 * p.step_us


def test_prefill_of_a_layer_at_rest_is_its_compute():
    """Everything resident: each layer's GEMMs and HBM reads; more tokens, more FLOPs (the link is idle)."""
    t = infos(moe(layers=2, experts=4))
    g = build_graph(t)
    groups = FusedGroups.find(n for l in g.stack_layers() for n in l.params)
    place = {n: GPU for n in t}
    # per layer at T=100: 800 us of GEMMs + 13 MB from HBM 1300 us + 100 us of its other kernels; the head the last
    # position's logits, 2 us + 1 MB from HBM 100 us; the embedding 100 rows 10 us
    for tokens, want in ((100, 10 + 2 * 2200 + 102), (1000, 100 + 2 * (8000 + 1300 + 1000) + 102)):
        m = CostModel(g, t, HW_PREFILL, 1, groups, 1, prompt_tokens=tokens)
        assert m.predict(place).prefill_us == want



def test_prefill_flops_count_causal_attention_and_the_last_logits_only():
    """A query projection carries its layer's causal attention (2 x T^2 x its output features) besides its GEMM; the
    head computes the last position's logits, as the runtime's generation asks (reads.py)."""
    width, tokens = 64, 100
    tensors = [("model.embed_tokens.weight", "BF16", (1000, 500))]
    for i in range(2):
        tensors += [(f"model.layers.{i}.self_attn.{p}_proj.weight", "BF16", (width, 500)) for p in "qk"]
    t = infos(tensors + [("lm_head.weight", "BF16", (1000, 500))])
    g = build_graph(t)
    m = CostModel(g, t, HW_PREFILL, 1, FusedGroups.find([]), None, prompt_tokens=tokens)
    gemm = 2 * tokens * width * 500
    for i in range(2):
        assert m.flops[f"model.layers.{i}.self_attn.k_proj.weight"] == gemm
        assert m.flops[f"model.layers.{i}.self_attn.q_proj.weight"] == gemm + 2 * tokens ** 2 * width
    assert (m.flops["lm_head.weight"], m.flops["model.embed_tokens.weight"]) == (2 * 1000 * 500, 0)
    tied = infos(tensors)  # the embedding is the head: the last position's logits
    m = CostModel(build_graph(tied), tied, HW_PREFILL, 1, FusedGroups.find([]), None, prompt_tokens=tokens)
    assert m.flops["model.embed_tokens.weight"] == 2 * 1000 * 500

def dense(layers=8):
    """A 1 MB embedding (1000 rows), `layers` dense layers of 1 MB, a 1 MB head: 10 MB in all."""
    return ([("model.embed_tokens.weight", "U8", (1000, 1000))]
            + [(f"model.layers.{i}.mlp.w", "U8", (10**6,)) for i in range(layers)] + [("lm_head.weight", "U8", (10**6,))])


def test_mixed_minimises_the_request_not_the_step():
    """With staging off, reading a dense layer in place costs a decode step what copying it does, but a
    prefill of 1024 tokens reads it ceil(1024 / 256) = 4 times. UVA, which moves just the 3 MB to shed,
    has the fastest step; streaming must move 4 layers (and pay 2 slots), but its prefill copies each
    once. Few new tokens: the prefill decides; more: the step."""
    hw = Hardware("test", h2d_copy_gbps=1.0, uva_read_gbps=1.0, hbm_read_gbps=10.0, layer_overhead_us=0.0,
                  matmul_tflops=10.0, stage_above_tokens=256, prefill_token_ns=0.0, moe_prefill_token_ns=0.0)
    t = infos(dense())  # 10 MB; the budget, 7.1 MB
    # per layer at rest: 2 x 1024 x 10^6 FLOP at 10^7 FLOP/us = 204.8 us, + 1 MB from HBM 100 us
    # uva (the embedding, layers 0 and 1): step = gpu: 7 MB from HBM 700 + 2.001 MB through UVA 2001 = 2701;
    #   prefill: the embedding's 1000 rows 1000 + 2 x (4 reads of 1 MB 4000 in place, after 204.8 of GEMMs)
    #   + 6 x 304.8 + the head (the last position's logits: 0.2 us + 1 MB from HBM) 100.2
    # sparse->uva, dense->prefetch (the embedding; layers 1, 3, 5, 7 through 2 slots of 1,000,192 bytes):
    #   step = link: 4 MB copied + 1 embedding row = 4001; prefill: the link reads the embedding's 1000 rows in
    #   place, then the 4 copies back to back (1000 each; a slot is free again once its layer has run, long before)
    #   while the layers compute, and layer 7 runs once its copy is in: 5000 + 304.8 + the head 100.2 = 5405
    #   (schedule.py `pipelined`)
    # prefetch only (5 layers: the embedding stays): step = link 5000; prefill 5 copies back to back, then the last
    #   streamed layer (7) 304.8 and the head 100.2 = 5405
    want = {"sparse->uva, dense->prefetch": (4001, 5405), "sparse->uva, dense->uva": (2701, 11339),
            "prefetch only": (5000, 5405), "uva only": (2701, 11339)}
    # request: 1 new token: 9406 (streaming) < 10405 (prefetch only) < 14040 (uva);
    #          6 new tokens: 27545 (uva) < 29411 (streaming)
    for new_tokens, best in ((1, "sparse->uva, dense->prefetch"), (6, "sparse->uva, dense->uva")):
        pol = dataclasses.replace(policy("mixed", budget_gib=7.1e6 / 2**30, step=2, stage_prefill=False),
                                  workload=Workload(1, prompt_tokens=1024, new_tokens=new_tokens))
        d = decide(build_graph(t), t, pol, hw, None)
        said = {k: f"step {step / 1e3:.3f} ms, prefill {pre / 1e3:.3f} ms, request "
                   f"{(pre + new_tokens * step) / 1e3:.3f} ms" for k, (step, pre) in want.items()}
        assert d.notes[1] == (f"mixed chose {best!r}: predicted {said[best]} (prefill of 1024 tokens + {new_tokens} "
                              "steps at batch 1); others: " + "; ".join(f"{k}: {v}" for k, v in said.items() if k != best))
        assert (d.cost.step_us, d.cost.prefill_us, d.cost.prompt_tokens) == (*want[best], 1024)


@pytest.mark.parametrize("waits, want", [
    ((1, False), [10, 12, 20]),  # one slot: layer 2's copy waits for layer 0, the slot's last user, to run (10)
    ((2, False), [10, 12, 18]),  # two: it follows layer 0's copy at once (8 to 16), and layer 2 runs after layer 1
    ((1, True), [10, 12, 18]),  # staging: issued as layer 0 begins (8), so it follows layer 0's copy too
    (None, [10, 12, 18]),  # the expert ring never holds a copy back
])
def test_the_prefill_copies_ahead_through_free_buffers(waits, want):
    assert pipelined([(2, 0, (8,)), (2, 0, (0,)), (2, 0, (8,))], (waits,)) == want


def test_a_staged_copy_waits_for_the_staged_layer_before_it_to_begin():
    """Layers 0, 2 and 3 copy ahead (1, 5, 5), layer 1 computes long (10). Layer 2's copy runs early (1 to 6). The
    stager issues layer 3's as layer 2 begins (12): in at 17, done at 18. Through two prefetch slots it waits only
    for layer 0, the slot's last user, to end (2), so it follows layer 2's copy (6 to 11) and layer 3 ends at 14."""
    layers = [(1, 0, (1,)), (10, 0, (0,)), (1, 0, (5,)), (1, 0, (5,))]
    assert pipelined(layers, ((1, True),)) == [2, 12, 13, 18]
    assert pipelined(layers, ((2, False),)) == [2, 12, 13, 14]


def test_the_stager_copies_a_layer_as_the_staged_layer_before_it_begins():
    """Through the cost model: layers 0, 2 and 3 on uva, staged at 1024 tokens (1 MB each, copied at 1 MB/us), layer
    1 resident and long (5 MB: 1024 of GEMMs and 500 from HBM). Layer 0 runs once its copy is in (1000 to 1305),
    layer 1 to 2829; layer 2's copy, issued as layer 0 began, is in by 2000, so layer 2 runs at once (305). Layer 3's
    is issued as layer 2 begins (2829): layer 3 waits for it, 1000 after layer 2's end. (Through the expert ring, or
    a prefetch slot free once layer 0 ended, it would have followed layer 2's copy: 305.)"""
    hw = Hardware("test", h2d_copy_gbps=1.0, uva_read_gbps=1.0, hbm_read_gbps=10.0, layer_overhead_us=0.0,
                  matmul_tflops=10.0, stage_above_tokens=256, prefill_token_ns=0.0, moe_prefill_token_ns=0.0)
    t = infos([("model.embed_tokens.weight", "U8", (1000, 1000)), ("model.layers.0.mlp.w", "U8", (10**6,)),
               ("model.layers.1.mlp.w", "U8", (5 * 10**6,)), ("model.layers.2.mlp.w", "U8", (10**6,)),
               ("model.layers.3.mlp.w", "U8", (10**6,)), ("lm_head.weight", "U8", (10**6,))])
    place = {n: UVA if n.startswith(("model.layers.0.", "model.layers.2.", "model.layers.3.")) else GPU for n in t}
    p = CostModel(build_graph(t), t, hw, 1, FusedGroups.find([]), None, prompt_tokens=1024).predict(place)
    assert ([l.prefill_us for l in p.layers], p.prefill_us) == ([100, 1205, 1524, 305, 1000, 100], 4234)


def test_the_expert_ring_copies_without_waiting():
    """Layers 1 and 2 stage their experts on uva through the expert ring at 1024 tokens (24 MB each at 1 MB/us:
    0 to 24000, then 24000 to 48000), behind layer 0, resident with a 200 MB projection (40960 of GEMMs + 20000
    from HBM + its experts' 1229 + 2400): both are in before layer 0 ends, and the prefill is the all-GPU one.
    Given the stager's wait (layer 2's copy issued as layer 1 begins, 64689) or a slot's, it would add 20066 or
    24000."""
    hw = Hardware("test", h2d_copy_gbps=1.0, uva_read_gbps=0.5, hbm_read_gbps=10.0, layer_overhead_us=0.0,
                  matmul_tflops=10.0, stage_above_tokens=256, prefill_token_ns=0.0, moe_prefill_token_ns=0.0)
    t = infos([(n, d, (2 * 10**8,) if n == "model.layers.0.self_attn.o_proj.weight" else s)
               for n, d, s in moe(layers=3)])
    g = build_graph(t)
    m = CostModel(g, t, hw, 1, FusedGroups.find(n for l in g.stack_layers() for n in l.params), 2,
                  prompt_tokens=1024)
    ring = {n: UVA if ".experts." in n and not n.startswith("model.layers.0.") else GPU for n in t}
    got, resident = m.predict(ring), m.predict({n: GPU for n in t})
    assert m.favours_staged_experts
    assert [l.prefill_us for l in got.layers] == [l.prefill_us for l in resident.layers] == [100, 64589, 3933,
                                                                                            3934, 100]
    assert got.prefill_us == resident.prefill_us == 72656


def test_one_copy_stream_serves_every_pool_in_layer_order():
    """One link: layer 1's staged copy (4) waits for layer 0's prefetch (8) though its own pool has a free slot."""
    assert pipelined([(2, 0, (8, 0)), (2, 0, (0, 4))], ((1, False), (1, True))) == [10, 14]
    assert pipelined([(5, 0, (0, 0)), (1, 0, (0, 0))], ((1, False), (1, True))) == [5, 6]  # nothing copied: compute


def test_the_prefetch_step_sets_the_prefill_slots():
    """Layers 1 and 2 prefetched (1 MB each at 1 MB/us), every layer 304.8 us of compute, the embedding and head
    100: with one slot, layer 2's copy starts once layer 1 has run (1304.8) and layer 2 ends at 2609.6; with two
    it follows layer 1's copy (1000 to 2000), and layer 2 runs from 2000."""
    hw = Hardware("test", h2d_copy_gbps=1.0, uva_read_gbps=1.0, hbm_read_gbps=10.0, layer_overhead_us=0.0,
                  matmul_tflops=10.0, stage_above_tokens=256, prefill_token_ns=0.0, moe_prefill_token_ns=0.0)
    t = infos(dense())
    place = {n: PREFETCH if n.startswith(("model.layers.1.", "model.layers.2.")) else GPU for n in t}
    got = {s: CostModel(build_graph(t), t, hw, 1, FusedGroups.find([]), None, prompt_tokens=1024,
                        prefetch_slots=s).predict(place) for s in (1, 2)}
    # each layer's share: its end less the one before's, both rounded to the us, so that the shares add up
    assert [l.prefill_us for l in got[1].layers] == [100, 305, 900, 1305, 304, 305, 305, 305, 305, 100]
    assert [l.prefill_us for l in got[2].layers] == [100, 305, 900, 1000, 305, 304, 305, 305, 305, 100]
    assert (got[1].prefill_us, got[2].prefill_us) == (4234, 3929) == tuple(sum(l.prefill_us for l in got[s].layers)
                                                                          for s in (1, 2))


@pytest.mark.parametrize("dense, moe", [(357.0, 335.0), (0.0, 335.0), (500.0, 250.0)])
def test_a_profile_round_trips_the_prefill_token_times(tmp_path, dense, moe):
    """prefill_token_ns and moe_prefill_token_ns are written where they differ from the built-in 357 and 335 ns,
    read back, and valid to the schema; a profile without them (every one `plan calibrate` has written) takes those."""
    from planner.inputs.hardware import H100, dumps_hardware, load_hardware
    hw = dataclasses.replace(H100, prefill_token_ns=dense, moe_prefill_token_ns=moe)
    (tmp_path / "hw.yaml").write_text(dumps_hardware(hw))
    text = dumps_hardware(hw)
    assert ("\nprefill_token_ns" in text, "moe_prefill_token_ns" in text) == (dense != 357.0, moe != 335.0)
    back = load_hardware(tmp_path / "hw.yaml")
    assert (back.prefill_token_ns, back.moe_prefill_token_ns) == (dense, moe)


def test_a_decoder_layers_other_kernels_take_their_time_per_token():
    """Each decoder layer adds its kind's time per prompt token to its compute (moe_prefill_token_ns with routed
    experts, prefill_token_ns without); the head and embedding do not."""
    for tensors, field in ((moe(layers=2, experts=4), "moe_prefill_token_ns"), (dense(layers=2), "prefill_token_ns")):
        t = infos(tensors)
        g = build_graph(t)
        groups = FusedGroups.find(n for l in g.stack_layers() for n in l.params)
        place = {n: GPU for n in t}
        got = {}
        for ns in (0.0, 1000.0):
            hw = dataclasses.replace(HW_PREFILL, **{field: ns})
            got[ns] = CostModel(g, t, hw, 1, groups, 1, prompt_tokens=1000).predict(place)
        assert got[1000.0].prefill_us - got[0.0].prefill_us == 2 * 1000, field  # 2 layers x 1000 tokens x 1 us
        assert [l.prefill_us for l in got[1000.0].layers if "layers" not in l.name] == \
            [l.prefill_us for l in got[0.0].layers if "layers" not in l.name]
