"""Scratch: which CPU kernel computes a set of experts fastest; host-node latency under a CUDA graph."""
import ctypes, json, os, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
import torch
import torch.nn.functional as F

out = open(os.path.join(os.environ.get("OUT", "/tmp"), "cpu_kernels.jsonl"), "w")
def rec(**kw):
    print(json.dumps(kw), flush=True); out.write(json.dumps(kw) + "\n"); out.flush()

E, H, I = 128, 2048, 768
torch.manual_seed(0)
cuda = torch.cuda.is_available()
gu = torch.randn(E, 2 * I, H, dtype=torch.bfloat16) * 0.02
dn = torch.randn(E, H, I, dtype=torch.bfloat16) * 0.02
if cuda:
    gu, dn = gu.pin_memory(), dn.pin_memory()
per_expert = (gu[0].numel() + dn[0].numel()) * 2
rec(threads=torch.get_num_threads(), mkldnn_bf16=torch.backends.mkldnn.is_available(), cpu=os.cpu_count(),
    config=torch.__config__.parallel_info().splitlines()[:6])

def act(u):
    g, up = u.chunk(2, dim=-1)
    return F.silu(g) * up

def loop(x, ids):
    o = torch.zeros(x.shape[0], H, dtype=torch.float32)
    for e in ids:
        o += F.linear(act(F.linear(x, gu[e])), dn[e]).float()
    return o

def gather_bmm(x, ids):
    idx = torch.tensor(ids)
    g = gu.index_select(0, idx); d = dn.index_select(0, idx)
    u = torch.bmm(x.unsqueeze(0).expand(len(ids), -1, -1), g.transpose(1, 2))
    return torch.bmm(act(u), d.transpose(1, 2)).float().sum(0)

pools = {}
def pooled(P):
    def setup():
        torch.set_num_threads(max(1, 16 // P))
    if P not in pools:
        pools[P] = ThreadPoolExecutor(P, initializer=setup)
    pool = pools[P]
    def run(x, ids):
        chunks = [ids[i::P] for i in range(P)]
        parts = list(pool.map(lambda c: loop(x, c) if c else None, chunks))
        return sum(p for p in parts if p is not None)
    return run

def timeit(fn, x, ids, n=30):
    for _ in range(3): fn(x, ids)
    t = time.perf_counter()
    for _ in range(n): fn(x, ids)
    return (time.perf_counter() - t) / n


def pairs(x, g, d, tok, exp, w):
    xp = x.float().index_select(0, tok)
    u = (g.index_select(0, exp).float() * xp[:, None, :]).sum(-1)
    a, b = u.chunk(2, -1)
    h = F.silu(a) * b
    y = (d.index_select(0, exp).float() * h[:, None, :]).sum(-1) * w[:, None]
    return torch.zeros(x.shape[0], H).index_add_(0, tok, y)
t0 = time.perf_counter()
cp = torch.compile(pairs, dynamic=True)
ids8 = list(range(0, 128, 16))
cp(torch.randn(1, H, dtype=torch.bfloat16), gu, dn, torch.zeros(8, dtype=torch.long), torch.tensor(ids8), torch.ones(8))
rec(kernel="inductor-pairs", compile_s=round(time.perf_counter() - t0, 1))
def ind(x, ids):
    T = x.shape[0]
    tok = torch.arange(T).repeat_interleave(len(ids)); exp = torch.tensor(ids * T)
    return cp(x, gu, dn, tok, exp, torch.ones(tok.numel()))
for threads in sorted({os.cpu_count(), max(1, os.cpu_count() - 1), max(1, os.cpu_count() // 2)}, reverse=True):
    torch.set_num_threads(threads)
    for T in (1, 4, 8):
        for k in (2, 4, 8):
            ids = ids8[:k]
            x = torch.randn(T, H, dtype=torch.bfloat16)
            ref = loop(x, ids)
            for name, fn in (("loop", loop), ("inductor-pairs", ind)):
                if name == "loop" and T == 8: continue
                dt = timeit(fn, x, ids, 20)
                err = (fn(x, ids) - ref).abs().max().item()
                rec(kernel=name, threads=threads, tokens=T, experts=k, us=round(dt * 1e6),
                    gbps=round(per_expert * k * T / dt / 1e9, 1), err=round(err, 5))
torch.set_num_threads(os.cpu_count())
if not cuda:
    sys.exit()

# host-node latency: fork/join side stream, D2H, host func, H2D, in a CUDA graph
lib = ctypes.CDLL("libcuda.so.1")
HOSTFN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
lib.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, HOSTFN, ctypes.c_void_p]
lib.cuLaunchHostFunc.restype = ctypes.c_int
dev = torch.device("cuda")
side = torch.cuda.Stream()
xg = torch.randn(4, H, device=dev, dtype=torch.bfloat16)
xh = torch.empty(4, H, dtype=torch.bfloat16).pin_memory()
oh = torch.zeros(4, H, dtype=torch.float32).pin_memory()
og = torch.empty(4, H, device=dev, dtype=torch.float32)
work = {"fn": None, "n": 0}
def host(_):
    work["n"] += 1
    f = work["fn"]
    if f is not None:
        f()
cb = HOSTFN(host)

def layer():
    main = torch.cuda.current_stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        xh.copy_(xg, non_blocking=True)
        assert lib.cuLaunchHostFunc(side.cuda_stream, cb, None) == 0
        og.copy_(oh, non_blocking=True)
    main.wait_stream(side)
    xg.add_(og.to(torch.bfloat16) * 0)

def graph_of(n):
    g = torch.cuda.CUDAGraph()
    layer(); torch.cuda.synchronize()
    with torch.cuda.graph(g):
        for _ in range(n):
            layer()
    return g

g8 = graph_of(8)
for fn_name, fn in (("noop", None), ("experts8-loop", lambda: oh[:1].copy_(loop(xh[:1], ids8))), ("experts8-inductor", lambda: oh[:1].copy_(ind(xh[:1], ids8)))):
    work["fn"] = fn
    for _ in range(3): g8.replay()
    torch.cuda.synchronize()
    t = time.perf_counter(); n0 = work["n"]
    for _ in range(20): g8.replay(); torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / 20 / 8
    rec(hostnode=fn_name, us_per_layer=round(dt * 1e6, 1), calls=work["n"] - n0)

# with the GPU reading other experts over a zero-copy view at once
sys.path.insert(0, os.getcwd())
from runtime.place.arena import PinnedArena, typed
arena = PinnedArena(per_expert * 64, cuda=True, device=dev)
view = typed(arena.device_view(0, per_expert * 64), torch.bfloat16, (64, per_expert // 2))
hv = typed(arena.host_view(0, per_expert * 64), torch.bfloat16, (64, per_expert // 2)); hv.normal_()
vec = torch.randn(per_expert // 2 // H, H, device=dev, dtype=torch.bfloat16)
def uva_read(m):
    s = 0
    for e in range(m):
        s = s + (view[e].view(-1, H) @ vec[0]).sum()
    return s
for m in (8,):
    for _ in range(3): uva_read(m)
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(10): uva_read(m)
    torch.cuda.synchronize(); dt = (time.perf_counter() - t) / 10
    rec(uva_alone_gbps=round(per_expert * m / dt / 1e9, 1))
    # together: CPU computes 8 experts (T=1) in a thread while the GPU reads 8 experts
    x1 = torch.randn(1, H, dtype=torch.bfloat16)
    for P, fn in ((1, loop), (0, ind)):
        stop = threading.Event(); cnt = [0]
        def spin():
            while not stop.is_set():
                fn(x1, list(range(0, 128, 16))); cnt[0] += 1
        th = threading.Thread(target=spin); th.start(); time.sleep(0.2)
        c0 = cnt[0]; torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(40): uva_read(m)
        torch.cuda.synchronize(); dt = time.perf_counter() - t
        c1 = cnt[0]; stop.set(); th.join()
        rec(together="loop" if P else "inductor", uva_gbps=round(per_expert * m * 40 / dt / 1e9, 1),
            cpu_gbps=round(per_expert * 8 * (c1 - c0) / dt / 1e9, 1))
