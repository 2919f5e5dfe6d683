import sys, dataclasses, pathlib, tempfile
sys.path[:0] = ["tests", "."]
import torch
from tiny_models import make_plan, qwen3_moe_config, save_model
from planner.inputs.hardware import H100, dumps_hardware
from runtime.hf import from_pretrained
from transformers import StaticCache
tmp = pathlib.Path(tempfile.mkdtemp())
ck = save_model(qwen3_moe_config(num_hidden_layers=3, initializer_range=0.2), tmp / "m")
above = int(sys.argv[1])
(tmp / "hw.yaml").write_text(dumps_hardware(dataclasses.replace(H100, cpu_threads=1, stage_above_tokens=above)))
SPLIT = "rules:\n  - {match: ['re:experts\\.[01]\\.'], place: cpu}\n  - {match: ['re:experts\\.2\\.'], place: uva}\nhardware: hw.yaml\n"
model, handle = from_pretrained(make_plan(tmp, ck, SPLIT), progress=False)
print("above", above, "prefill plan", handle.plan.prefill is not None, "stager", handle.prefill is not None, flush=True)
e = handle.host_experts
for B in (1, 2):
    cache = StaticCache(config=model.config, max_cache_len=64)
    ids = torch.tensor([[5, 17, 99, 3]] * B, device="cuda")
    with torch.no_grad():
        model(ids, past_key_values=cache, cache_position=torch.arange(4, device="cuda"))
    tok = torch.tensor([[7]] * B, device="cuda") + torch.arange(B, device="cuda")[:, None]
    pos = torch.tensor([4], device="cuda")
    step = lambda: model(tok, past_key_values=cache, cache_position=pos).logits
    hx, hids, hy = (e._views[n][0] for n in ("x", "ids", "y"))
    print("pinned", hx.is_pinned(), hy.is_pinned(), flush=True)
    with torch.no_grad():
        eager = step().clone(); torch.cuda.synchronize()
        ex, ei, ey = hx[:B].clone(), hids[:2 * B].clone(), hy[:2 * B].clone()
        graph, out = handle.capture(step)
        hx.zero_(); hy.zero_(); c0 = e.host_calls
        graph.replay(); torch.cuda.synchronize()
        print("calls", e.host_calls - c0, "x same", torch.equal(hx[:B], ex), "ids", hids[:2 * B].tolist(), ei.tolist(),
              "y same", torch.equal(hy[:2 * B], ey), "dev y same", torch.equal(e._y[:2 * B].cpu(), hy[:2 * B]), flush=True)
        print("B", B, "graph vs eager max diff", (out - eager).abs().max().item(), "misses", e.kernel.misses, e.kernel.last_miss, "err", e.error, flush=True)
        # per layer: compare the host's y of the last layer
        e.durations.clear()
