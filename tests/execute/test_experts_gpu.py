"""offplan's experts implementation on CUDA (marked `gpu`): the Triton gather reads pinned rows through the zero-copy
view, outputs equal batched_mm bitwise, and a decode step with experts in pinned memory replays in a CUDA graph."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from runtime.execute import experts, gather  # noqa: E402
from runtime.hf import from_pretrained  # noqa: E402
from runtime.place.arena import PinnedArena, typed  # noqa: E402
from test_experts import RESIDENT_LAYER_0, SPLIT, configs  # noqa: E402
from tiny_models import make_plan, reference, save_model  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {name: save_model(config, root / name) for name, config in configs().items()}


def test_gather_rows_reads_pinned_rows_in_place_and_resident_rows_from_hbm():
    assert gather.triton is not None  # the kernel path, not the reference, runs here
    e, shape = 16, (96, 128)
    arena = PinnedArena(e * 96 * 128 * 2, cuda=True)
    host = typed(arena.host_view(0, arena.nbytes), torch.bfloat16, (e, *shape))
    host.copy_(torch.randn(e, *shape, dtype=torch.bfloat16))
    full = typed(arena.device_view(0, arena.nbytes), torch.bfloat16, (e, *shape))
    resident_ids = [1, 5, 6]
    resident = host[resident_ids].cuda() + 1  # marked: a row from HBM shows by its value
    slot = torch.full((e,), -1, dtype=torch.int32)
    slot[resident_ids] = torch.arange(3, dtype=torch.int32)
    order = torch.tensor([5, 0, 9, 1, 3, 2], device="cuda")
    valid = torch.tensor([1, 1, 1, 1, 1, 0], dtype=torch.int32, device="cuda")
    rows = gather.gather_rows(full, resident, slot.cuda(), order, valid)
    want = torch.stack([resident[1], host[0].cuda(), host[9].cuda(), resident[0], host[3].cuda()])
    assert torch.equal(rows[:5], want)
    del full, rows
    arena.release()


def test_gather_many_moves_five_tensors_of_three_dtypes_as_gather_does():
    """Two launches (four tensors, then one): each tensor's valid rows as the reference gives them, from HBM where
    the slot says so, through the zero-copy view otherwise."""
    e = 12
    shapes = [((64, 96), torch.bfloat16), ((32, 64), torch.float8_e4m3fn), ((3, 5), torch.float32),
              ((96, 64), torch.bfloat16), ((7,), torch.bfloat16)]
    arenas, fulls, residents, slots = [], [], [], []
    for i, (shape, dtype) in enumerate(shapes):
        size = torch.empty((), dtype=dtype).element_size() * e * torch.Size(shape).numel()
        arenas.append(PinnedArena(size, cuda=True))
        host = typed(arenas[-1].host_view(0, size), dtype, (e, *shape))
        host.copy_(torch.randn(e, *shape).to(dtype))
        fulls.append(typed(arenas[-1].device_view(0, size), dtype, (e, *shape)))
        ids = [i, i + 3]  # each tensor keeps other experts in HBM, marked by their value
        residents.append((host[ids].float() + 1).to(dtype).cuda())
        slot = torch.full((e,), -1, dtype=torch.int32)
        slot[ids] = torch.arange(2, dtype=torch.int32)
        slots.append(slot.cuda())
    order = torch.tensor([3, 0, 11, 4, 1, 7, 2, 5], device="cuda")
    valid = torch.tensor([1, 1, 1, 1, 1, 1, 0, 0], dtype=torch.int32, device="cuda")
    got = gather.gather_many(fulls, residents, slots, order, valid)
    for f, r, s, rows in zip(fulls, residents, slots, got):
        want = gather._gather_reference(f, r, s, order, valid)
        assert rows.shape == want.shape and rows.dtype == want.dtype
        assert torch.equal(rows[:6].view(torch.uint8), want[:6].view(torch.uint8))
    del fulls, got
    for a in arenas:
        a.release()


@pytest.mark.parametrize("experts", [16, 128, 384])
def test_route_kernel_gives_the_slots_of_torchs_ops(experts):
    """The one-launch route equals the nine torch ops on every output, pairs sharing experts, more pairs than the
    kernel's chunk (64) and than experts."""
    g = torch.Generator().manual_seed(experts)
    for tokens in (2, 3, 8, 40, 100):
        k = min(8, experts)
        ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]).reshape(-1).cuda()
        for got, want in zip(gather.route(ids, experts), gather._route_reference(ids, experts)):
            assert got.dtype == want.dtype and torch.equal(got, want), (experts, tokens)


@pytest.mark.parametrize("name", ["qwen3-moe", "mixtral", "qwen2-moe"])
def test_split_experts_on_cuda_equal_transformers_bitwise(tmp_path, models, name):
    plan = make_plan(tmp_path, models[name], SPLIT)
    model, handle = from_pretrained(plan, progress=False)
    assert model.config._experts_implementation == "offplan"
    k = model.config.num_experts_per_tok
    for tokens in (1, 9):
        impl = experts.arithmetic(2 * tokens * k)
        ref = reference(models[name], "cuda")
        ref.set_experts_implementation(impl)
        torch.manual_seed(3)
        ids = torch.randint(0, 256, (2, tokens), device="cuda")
        with torch.no_grad():
            assert torch.equal(model(ids).logits, ref(ids).logits), (tokens, impl)
        del ref
    handle.remove(restore=False)


def test_a_resident_layer_computes_as_the_offloaded_ones(tmp_path, models):
    """Layer 0 keeps every expert on the GPU, layers 1-2 read experts 0 and 2 from pinned memory: at 9 tokens the
    whole model is bitwise transformers' grouped_mm, the resident layer included."""
    plan = make_plan(tmp_path, models["qwen3-moe"], RESIDENT_LAYER_0)
    model, handle = from_pretrained(plan, progress=False)
    ref = reference(models["qwen3-moe"], "cuda")
    k = model.config.num_experts_per_tok
    ref.set_experts_implementation(experts.arithmetic(2 * 9 * k))
    ids = torch.randint(0, 256, (2, 9), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    handle.remove(restore=False)


@pytest.mark.parametrize("name", ["qwen3-moe", "mixtral", "qwen2-moe"])
def test_all_on_the_gpu_runs_grouped_mm_without_its_masks_bitwise(tmp_path, models, name):
    """Nothing offloaded: offplan_grouped_mm stands in for transformers' grouped_mm, bitwise at prefill sizes and
    in a replayed decode step."""
    model, handle = from_pretrained(make_plan(tmp_path, models[name], ""), progress=False)
    assert model.config._experts_implementation == "offplan_grouped_mm"
    ref = reference(models[name], "cuda")
    for tokens in (3, 100):
        ids = torch.randint(0, 256, (2, tokens), device="cuda", generator=torch.Generator("cuda").manual_seed(5))
        with torch.no_grad():
            assert torch.equal(model(ids).logits, ref(ids).logits), tokens
    _replays_as(model, handle, ref)
    handle.remove(restore=False)


def test_uva_false_refuses_a_plan_that_splits_experts(tmp_path, models):
    from planner.errors import OffplanError
    plan = make_plan(tmp_path, models["qwen3-moe"], SPLIT)
    with pytest.raises(OffplanError, match="uva=False copies each uva parameter to the GPU whole"):
        from_pretrained(plan, progress=False, uva=False)


def _replays_as(model, handle, eager, steps: int = 20) -> None:
    """Capture `model`'s decode step (static cache, one token) and replay it `steps` times over random tokens,
    each replay's logits bitwise those of `eager` (a model, `model` itself or a reference) on the same token."""
    from transformers import StaticCache
    graph_cache = StaticCache(config=model.config, max_cache_len=64)
    eager_cache = StaticCache(config=eager.config, max_cache_len=64)
    prompt = torch.randint(0, 256, (1, 8), device="cuda")
    static_ids = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    static_pos = torch.tensor([8], device="cuda")
    with torch.no_grad():
        graph, static_logits = handle.capture(
            lambda: model(static_ids, past_key_values=graph_cache, cache_position=static_pos).logits)
        graph_cache.reset()
        model(prompt, past_key_values=graph_cache, cache_position=torch.arange(8, device="cuda"))
        handle.join()
        eager(prompt, past_key_values=eager_cache, cache_position=torch.arange(8, device="cuda"))
        for step in range(steps):
            token = torch.randint(0, 256, (1, 1), device="cuda")
            static_ids.copy_(token)
            static_pos.fill_(8 + step)
            graph.replay()
            want = eager(token, past_key_values=eager_cache, cache_position=torch.tensor([8 + step], device="cuda"))
            torch.cuda.synchronize()
            assert torch.equal(static_logits, want.logits), step


def test_decode_step_with_experts_in_pinned_memory_replays_in_a_cuda_graph(tmp_path, models):
    model, handle = from_pretrained(make_plan(tmp_path, models["qwen3-moe"], SPLIT), progress=False)
    _replays_as(model, handle, model)
    handle.remove(restore=False)


def test_no_graph_break_under_torch_compile_on_cuda(tmp_path, models):
    plan = make_plan(tmp_path, models["qwen3-moe"], SPLIT)
    model, handle = from_pretrained(plan, progress=False)
    ids = torch.randint(0, 256, (2, 5), device="cuda")
    try:
        with torch.no_grad():
            explained = torch._dynamo.explain(model)(ids)
        assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    finally:
        torch._dynamo.reset()
        handle.remove(restore=False)


def test_lookahead_stopped_part_way_gathers_exact_rows():
    """The side read stops when the next gather needs the link (runtime/execute/lookahead.py), at any chunk: the gather
    then takes each guessed block from the buffer only where the read completed it. Stops at 40 moments, from
    before the read to after it; every gathered row must equal the pinned one (a chunk stored by only some of a
    program's threads showed here as a few thousand wrong values)."""
    from runtime.execute.lookahead import BLOCK, PROGRAMS, _read_kernel
    e, count, na, nb = 12, 2, 768 * 2048, 2048 * 384
    arena = PinnedArena(e * (na + nb) * 2, cuda=True)
    arena.host_view(0, arena.nbytes).view(torch.bfloat16).copy_(torch.randn(e * (na + nb)).to(torch.bfloat16))
    view = arena.device_view(0, arena.nbytes)
    fa = typed(view[:e * na * 2], torch.bfloat16, (e, na))
    fb = typed(view[e * na * 2:], torch.bfloat16, (e, nb))
    slot = torch.full((e,), -1, dtype=torch.int32, device="cuda")
    ids = torch.zeros(count, dtype=torch.long, device="cuda")
    stop = torch.full((1,), -1, dtype=torch.int32, device="cuda")
    done = torch.zeros(PROGRAMS, dtype=torch.int32, device="cuda")
    oa, ob = (torch.empty(count, n, dtype=torch.bfloat16, device="cuda") for n in (na, nb))
    ca, cb = -(-na // BLOCK), -(-nb // BLOCK)
    total = count * (ca + cb)  # chunks of the side read
    side, partial = torch.cuda.Stream(), 0
    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        guess = torch.randperm(e, generator=gen)[:count].cuda()
        order = torch.cat([guess, torch.randperm(e, generator=gen)[:2].cuda()]).unique()
        oa.fill_(7)
        ob.fill_(7)  # what a block taken from an unread chunk would show
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ids.copy_(guess)
            stop.fill_(-1)
            _read_kernel[(PROGRAMS,)](ids, stop, done, 5, oa, fa, slot, na, ob, fb, slot, nb, count, 2,
                                      PROGRAMS=PROGRAMS, BLOCK=BLOCK, num_warps=16)
        torch.cuda._sleep(trial * 2000)  # cycles before the gather needs the link
        stop.fill_(5)
        torch.cuda.current_stream().wait_stream(side)
        for full, rows, first in ((fa, oa, 0), (fb, ob, ca)):
            out = torch.empty(order.numel(), full.shape[1], dtype=full.dtype, device="cuda")
            gather._gather_kernel[(order.numel(), -(-full.shape[1] // 4096))](
                out, full, full[:0], slot, order, torch.ones_like(order, dtype=torch.int32), ids, rows, done,
                full.shape[1], first, ca + cb, BLOCK=4096, AHEAD=count, PROGRAMS=PROGRAMS,
                RATIO=BLOCK // 4096)
            assert torch.equal(out, full[order]), trial
        partial += 0 < int(done.sum()) < total
    assert partial >= 5  # the stops fell inside the read
    arena.release()


def test_decode_with_the_lookahead_replays_bitwise_as_transformers(tmp_path, models):
    """Every expert in pinned memory: a captured decode step guesses and reads ahead on the side stream; its
    replays give transformers' batched_mm logits bitwise, step after step."""
    from test_experts import EVERY_EXPERT
    model, handle = from_pretrained(make_plan(tmp_path, models["qwen3-moe"], EVERY_EXPERT), progress=False)
    assert handle.lookahead is not None
    ref = reference(models["qwen3-moe"], device="cuda")
    ref.set_experts_implementation("batched_mm")
    _replays_as(model, handle, ref)
    assert int(handle.lookahead.done.sum()) > 0  # the replays read ahead
    handle.remove(restore=False)
