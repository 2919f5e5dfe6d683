import sys, time, threading
sys.path[:0] = ["."]
import torch
from runtime.execute import host_kernel as hk
from runtime.execute.host_experts import _host_function
from runtime.place.arena import PinnedArena, typed
E, H, I = 128, 2048, 768
nbytes = E * 2 * I * H * 2
arena = PinnedArena(nbytes * 2 + 4096, cuda=True)
gu = typed(arena.host_view(0, nbytes), torch.bfloat16, (E, 2 * I, H)); gu.normal_()
dn = typed(arena.host_view(nbytes + 256, E * H * I * 2), torch.bfloat16, (E, H, I)); dn.normal_()
x = torch.randn(2, H, dtype=torch.bfloat16)
tok = torch.zeros(8, dtype=torch.long); ex = torch.arange(0, 128, 16)
def timed(fn, n=20):
    fn(); t = time.perf_counter()
    for _ in range(n): fn()
    return round((time.perf_counter() - t) / n * 1e6)
for emulate in (True, False):
    torch._dynamo.reset()
    k = hk.Kernel(15)
    if not emulate:
        orig = torch.compile
        torch.compile = lambda f, **kw: orig(f, dynamic=True)
    t = time.perf_counter(); k.start([(gu, dn, 8)]); k.ready()
    if not emulate:
        torch.compile = orig
    print("emulate", emulate, "compile", round(time.perf_counter() - t, 1), k.compiled, k.why_eager, flush=True)
    print(" main (16 threads, toggled)", timed(lambda: k.gated(x, tok, gu, dn, ex)), "misses", k.misses, k.last_miss, flush=True)
    torch.set_num_threads(15)
    print(" main (15 threads)", timed(lambda: k.gated(x, tok, gu, dn, ex)), flush=True)
    print(" direct compiled fn", timed(lambda: k._fn(x, tok, gu, dn, ex)), flush=True)
    torch.set_num_threads(16)
    times = []
    def host(call):
        t = time.perf_counter(); k.gated(x, tok, gu, dn, ex); times.append(time.perf_counter() - t)
    launch, cb = _host_function(host)
    s = torch.cuda.Stream(); g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for i in range(8):
            launch(torch.cuda.current_stream().cuda_stream, i + 1)
    g.replay(); torch.cuda.synchronize(); times.clear()
    t = time.perf_counter()
    for _ in range(5):
        g.replay(); torch.cuda.synchronize()
    print(" host node wall/layer", round((time.perf_counter() - t) / 40 * 1e6), "inside", round(sum(times) / len(times) * 1e6), "misses", k.misses, flush=True)
    def host2(call):
        torch.set_num_threads(15)
        t = time.perf_counter(); k._fn(x, tok, gu, dn, ex); times.append(time.perf_counter() - t)
    launch2, cb2 = _host_function(host2)
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2, stream=s):
        for i in range(8):
            launch2(torch.cuda.current_stream().cuda_stream, i + 1)
    g2.replay(); torch.cuda.synchronize(); times.clear()
    t = time.perf_counter()
    for _ in range(5):
        g2.replay(); torch.cuda.synchronize()
    print(" host node direct fn wall/layer", round((time.perf_counter() - t) / 40 * 1e6), "inside", round(sum(times) / len(times) * 1e6), flush=True)
