import sys, dataclasses, pathlib, tempfile
sys.path[:0] = ["tests", "."]
import torch
from tiny_models import make_plan, qwen3_moe_config, save_model
from planner.inputs.hardware import H100, dumps_hardware
from runtime.hf import from_pretrained
tmp = pathlib.Path(tempfile.mkdtemp())
ck = save_model(qwen3_moe_config(num_hidden_layers=3, initializer_range=0.2), tmp / "m")
(tmp / "hw.yaml").write_text(dumps_hardware(dataclasses.replace(H100, cpu_threads=1, stage_above_tokens=8)))
SPLIT = "rules:\n  - {match: ['re:experts\\.[01]\\.'], place: cpu}\n  - {match: ['re:experts\\.2\\.'], place: uva}\nhardware: hw.yaml\n"
model, handle = from_pretrained(make_plan(tmp, ck, SPLIT), progress=False)
e = handle.host_experts
mod = model.model.layers[0].mlp.experts
torch.manual_seed(0)
mods = [model.model.layers[i].mlp.experts for i in range(3)]
h = torch.randn(1, 64, device="cuda", dtype=torch.bfloat16)
idx = [torch.tensor([p], device="cuda") for p in ([0, 3], [0, 1], [1, 2])]
w = torch.tensor([[0.6, 0.4]], device="cuda", dtype=torch.bfloat16)
def chain():
    x = h
    outs = []
    for m, i in zip(mods, idx):
        x = m(x, i, w) + x
        outs.append(x)
    return outs
with torch.no_grad():
    eager = [o.clone() for o in chain()]
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = chain()
    g.replay(); torch.cuda.synchronize()
    print("chain diffs", [(o - e_).abs().max().item() for o, e_ in zip(outs, eager)], flush=True)
    # the same chain with a router computing ids in the graph
    gate = model.model.layers[0].mlp.gate
    def routed():
        x = h
        outs = []
        for m in mods:
            logits = torch.nn.functional.linear(x, gate.weight)
            wts, ids = torch.topk(logits.float().softmax(-1), 2)
            x = m(x, ids, wts.to(x.dtype)) + x
            outs.append(x)
        return outs
    eager = [o.clone() for o in routed()]
    with torch.cuda.stream(s):
        routed()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2):
        outs = routed()
    g2.replay(); torch.cuda.synchronize()
    print("routed diffs", [(o - e_).abs().max().item() for o, e_ in zip(outs, eager)], flush=True)
