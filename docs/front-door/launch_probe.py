"""Where a batch-8 eager experts step's CPU time goes: Triton launches by argument count, a pointer table, the
routing ops, and a route kernel; with the GPU rate of each gather through the zero-copy view. Kept as it ran, before
gather.py had `route` and `gather_many` (its `_two` and `_route` are their first forms), from the checkout's root:
`python docs/front-door/launch_probe.py`; its output: launch-probe-h100.json."""
import json, os, statistics, sys, time
from pathlib import Path
sys.path.insert(0, os.getcwd())
import torch
import triton
import triton.language as tl
from runtime.place.arena import PinnedArena
from runtime.execute import gather as G

OUT = Path(os.environ.get("OUT", "/tmp/out"))
res = {"triton": triton.__version__, "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
try:
    res["cpu"] = [l for l in open("/proc/cpuinfo") if "model name" in l][0].split(":")[1].strip()
except Exception:
    pass
dev = torch.device("cuda")
E, H, I, K, T = 128, 2048, 768, 8, 8


def uva(shape, dtype):
    n = torch.Size(shape).numel() * torch.tensor([], dtype=dtype).element_size()
    a = PinnedArena(n, cuda=True, device=dev)
    a.host_view(0, n).view(dtype).view(shape).normal_() if dtype.is_floating_point else None
    return a, a.device_view(0, n).view(dtype).view(shape)


ag, gate_up = uva((E, 2 * I, H), torch.bfloat16)
ad, down = uva((E, H, I), torch.bfloat16)
resident = torch.empty((0, 2 * I, H), dtype=torch.bfloat16, device=dev)
resident_d = torch.empty((0, H, I), dtype=torch.bfloat16, device=dev)
slot = torch.full((E,), -1, dtype=torch.int32, device=dev)
torch.manual_seed(0)
ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).reshape(-1).to(dev)


def route(ids):
    size = min(E, ids.numel())
    hit = torch.zeros(E, dtype=torch.int32, device=ids.device).index_fill_(0, ids, 1)
    order = torch.sort(hit, descending=True, stable=True).indices[:size]
    valid = hit.index_select(0, order)
    slot_of = torch.zeros(E, dtype=torch.long, device=ids.device).index_copy_(0, order,
                                                                           torch.arange(size, device=ids.device))
    pos = slot_of.index_select(0, ids)
    return order, valid, pos


order, valid, pos = route(ids)
zero = torch.zeros_like(valid)
res["hit"] = int(valid.sum())


def cpu_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n // 5):
            fn()
        ts.append((time.perf_counter() - t) / (n // 5) * 1e6)
        torch.cuda.synchronize()
    return round(statistics.median(ts), 1)


def gpu_ms(fn, n=10):
    fn(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) / n


@triton.jit
def _plain(out, full, resident, slot, order, valid, row_numel, BLOCK: tl.constexpr):
    u = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_numel
    if tl.load(valid + u) != 0:
        e = tl.load(order + u).to(tl.int64)
        s = tl.load(slot + e).to(tl.int64)
        if s >= 0:
            src = resident + s * row_numel
        else:
            src = full + e * row_numel
        tl.store(out + u.to(tl.int64) * row_numel + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit
def _two(out0, full0, res0, slot0, n0, out1, full1, res1, slot1, n1, order, valid, BLOCK: tl.constexpr):
    u = tl.program_id(0)
    b = tl.program_id(1)
    if tl.load(valid + u) != 0:
        e = tl.load(order + u).to(tl.int64)
        if tl.program_id(2) == 0:
            offs = b * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n0
            s = tl.load(slot0 + e).to(tl.int64)
            if s >= 0:
                src = res0 + s * n0
            else:
                src = full0 + e * n0
            tl.store(out0 + u.to(tl.int64) * n0 + offs, tl.load(src + offs, mask=mask), mask=mask)
        else:
            offs = b * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n1
            s = tl.load(slot1 + e).to(tl.int64)
            if s >= 0:
                src = res1 + s * n1
            else:
                src = full1 + e * n1
            tl.store(out1 + u.to(tl.int64) * n1 + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit
def _table(out, table, order, valid, U, BLOCK: tl.constexpr, HINT: tl.constexpr):
    u = tl.program_id(0)
    b = tl.program_id(1)
    t = tl.program_id(2)
    row = tl.load(table + t * 5 + 3)  # int32 words per expert row
    if b * BLOCK < row:
        if tl.load(valid + u) != 0:
            e = tl.load(order + u).to(tl.int64)
            s = tl.load(tl.load(table + t * 5 + 2).to(tl.pointer_type(tl.int32)) + e).to(tl.int64)
            base = tl.where(s >= 0, tl.load(table + t * 5 + 1) + s * row * 4, tl.load(table + t * 5) + e * row * 4)
            dst = out + tl.load(table + t * 5 + 4) * U + u.to(tl.int64) * row
            if HINT:
                base = tl.multiple_of(base, 16)
            src = base.to(tl.pointer_type(tl.int32))
            offs = b * BLOCK + tl.arange(0, BLOCK)
            if HINT:
                offs = tl.max_contiguous(tl.multiple_of(offs, BLOCK), BLOCK)
            mask = offs < row
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit
def _route(ids, order, valid, pos, P, E, U, EB: tl.constexpr, PB: tl.constexpr):
    p = tl.arange(0, PB)
    pm = p < P
    ep = tl.load(ids + p, mask=pm, other=-1)
    ex = tl.arange(0, EB)
    match = ep[:, None] == ex[None, :]
    hit = tl.max(match.to(tl.int32), axis=0)
    incl = tl.cumsum(hit, 0)
    n = tl.sum(hit)
    slot = tl.where(hit != 0, incl - 1, n + ex - incl)
    keep = (ex < E) & (slot < U)
    tl.store(order + slot, ex.to(tl.int64), mask=keep)
    tl.store(valid + slot, hit, mask=keep)
    tl.store(pos + p, tl.sum(tl.where(match, slot[None, :], 0), axis=1).to(tl.int64), mask=pm)


def plain(full, res_, v):
    n = full[0].numel()
    out = torch.empty((order.numel(), *full.shape[1:]), dtype=full.dtype, device=dev)
    _plain[(order.numel(), triton.cdiv(n, 4096))](out, full, res_, slot, order, v, n, BLOCK=4096)
    return out


def two(v):
    n0, n1 = gate_up[0].numel(), down[0].numel()
    o0 = torch.empty((order.numel(), *gate_up.shape[1:]), dtype=gate_up.dtype, device=dev)
    o1 = torch.empty((order.numel(), *down.shape[1:]), dtype=down.dtype, device=dev)
    _two[(order.numel(), triton.cdiv(max(n0, n1), 4096), 2)](o0, gate_up, resident, slot, n0, o1, down, resident_d,
                                                             slot, n1, order, v, BLOCK=4096)
    return o0, o1


words = [gate_up[0].numel() // 2, down[0].numel() // 2]
prefix = [0, words[0]]
table = torch.tensor([[gate_up.data_ptr(), resident.data_ptr(), slot.data_ptr(), words[0], prefix[0]],
                      [down.data_ptr(), resident_d.data_ptr(), slot.data_ptr(), words[1], prefix[1]]],
                     dtype=torch.int64, device=dev)


def tab(v, hint=True):
    U = order.numel()
    flat = torch.empty(U * sum(words), dtype=torch.int32, device=dev)
    _table[(U, triton.cdiv(max(words), 4096), 2)](flat, table, order, v, U, BLOCK=4096, HINT=hint)
    o0 = flat[:U * words[0]].view(torch.bfloat16).view(U, *gate_up.shape[1:])
    o1 = flat[U * words[0]:].view(torch.bfloat16).view(U, *down.shape[1:])
    return o0, o1


def route_k(ids):
    P = ids.numel()
    U = min(E, P)
    o = torch.empty(U, dtype=torch.int64, device=dev)
    v = torch.empty(U, dtype=torch.int32, device=dev)
    p = torch.empty(P, dtype=torch.int64, device=dev)
    _route[(1,)](ids, o, v, p, P, E, U, EB=triton.next_power_of_2(E), PB=triton.next_power_of_2(P))
    return o, v, p


# correctness
ref0 = G._gather_rows(gate_up, resident, slot, order, valid)
ref1 = G._gather_rows(down, resident_d, slot, order, valid)
m = valid.bool()
checks = {}
checks["plain"] = bool(torch.equal(plain(gate_up, resident, valid)[m], ref0[m]))
a0, a1 = two(valid)
checks["two"] = bool(torch.equal(a0[m], ref0[m]) and torch.equal(a1[m], ref1[m]))
for h in (True, False):
    b0, b1 = tab(valid, h)
    checks[f"table{int(h)}"] = bool(torch.equal(b0[m], ref0[m]) and torch.equal(b1[m], ref1[m]))
for trial in range(20):
    g = torch.Generator().manual_seed(trial)
    tt = [1, 2, 3, 8, 16, 32][trial % 6]
    x = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tt)]).reshape(-1).to(dev)
    r, k_ = route(x), route_k(x)
    ok = all(torch.equal(a.to(b.dtype), b) for a, b in zip(r, k_))
    checks.setdefault("route", True)
    checks["route"] = checks["route"] and ok
res["checks"] = checks

# CPU launch cost, no sync (valid 0: the kernels read nothing)
small = torch.zeros(E, dtype=torch.int32, device=dev)
cpu = {}
cpu["index_select_small"] = cpu_us(lambda: small.index_select(0, ids))
cpu["empty"] = cpu_us(lambda: torch.empty(64, 1536, 2048, dtype=torch.bfloat16, device=dev))
cpu["route_ops"] = cpu_us(lambda: route(ids))
cpu["route_kernel"] = cpu_us(lambda: route_k(ids))
cpu["current_x2"] = cpu_us(lambda: (G._gather_rows(gate_up, resident, slot, order, zero),
                                    G._gather_rows(down, resident_d, slot, order, zero)))
cpu["plain_x2"] = cpu_us(lambda: (plain(gate_up, resident, zero), plain(down, resident_d, zero)))
cpu["two"] = cpu_us(lambda: two(zero))
cpu["table"] = cpu_us(lambda: tab(zero))
res["cpu_us"] = cpu
# GPU: ms per layer's two gathers, and GB/s of the hit rows
nbytes = res["hit"] * (gate_up[0].numel() + down[0].numel()) * 2
gpu = {}
for name, fn in {"current": lambda: (G._gather_rows(gate_up, resident, slot, order, valid),
                                     G._gather_rows(down, resident_d, slot, order, valid)),
                 "plain": lambda: (plain(gate_up, resident, valid), plain(down, resident_d, valid)),
                 "two": lambda: two(valid), "table_hint": lambda: tab(valid, True),
                 "table_nohint": lambda: tab(valid, False)}.items():
    ms = gpu_ms(fn)
    gpu[name] = {"ms": round(ms, 3), "gbps": round(nbytes / ms / 1e6, 1)}
res["gpu"] = gpu
print(json.dumps(res, indent=1))
OUT.mkdir(parents=True, exist_ok=True)
(OUT / "launch_probe.json").write_text(json.dumps(res, indent=1))
