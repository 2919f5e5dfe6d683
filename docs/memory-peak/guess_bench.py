"""The lookahead's guess: F.linear (cuBLAS) against a product and a float32 sum, Qwen3-30B-A3B and DeepSeek-V3 router
shapes, CUDA-event time per call over 2000 calls, on a side stream; and the cuBLAS workspace each allocates."""
import torch
torch.manual_seed(0)
side = torch.cuda.Stream()
for E, H in ((128, 2048), (256, 7168)):
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, H, device="cuda", dtype=torch.bfloat16) * 0.02
    fns = {"linear": lambda: torch.nn.functional.linear(x[-1:], w).topk(8, dim=-1).indices,
           "product+sum": lambda: (x[-1] * w).sum(-1, dtype=torch.float32).topk(8, dim=-1).indices}
    for name, f in fns.items():
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with torch.cuda.stream(side):
            for _ in range(50):
                f()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(100):
                    f()
            a.record()
            for _ in range(20):
                g.replay()
            b.record()
        torch.cuda.synchronize()
        print(f"E {E} H {H} {name}: {a.elapsed_time(b) * 1e3 / 2000:.2f} us a call (graph replay), "
              f"held after: {(torch.cuda.memory_allocated() - before) / 2**20:.1f} MiB")
