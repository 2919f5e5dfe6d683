"""fp8_gather.py's op under torch.compile, which the GPU suite's FP8 compile test reaches only at one token (where the
FP8 products run instead): a tiny FP8 Qwen3-MoE, its experts on uva and all on the GPU, forwards of 2 and 4
sequences (more than one token: the one-launch gather and dequantization), compiled against eager, with no graph
break; then the compiled step replayed in a CUDA graph. Kept as it ran (`OUT=... python
docs/front-door/fp8_gather_compile_check.py`); prints one JSON line per case."""
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
import torch  # noqa: E402
import torch._inductor.config as inductor_config  # noqa: E402

from quantized_models import write_fp8  # noqa: E402
from runtime.hf import from_pretrained  # noqa: E402
from tiny_models import make_plan, qwen3_moe_config, save_model  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp/out"))


def main() -> int:
    bad = 0
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        fp8 = write_fp8(save_model(qwen3_moe_config(hidden_size=192, moe_intermediate_size=128, head_dim=32,
                                                    num_hidden_layers=2), root / "moe"), root / "fp8")
        for name, body in (("uva", "backend: uva\nuva: {offload_gib: 100}"), ("gpu", "")):
            model, handle = from_pretrained(make_plan(root, fp8, body, name), progress=False)
            try:
                for batch in (2, 4):
                    torch.manual_seed(batch)
                    x = torch.randint(0, 256, (batch, 1), device="cuda")
                    with torch.no_grad():
                        eager = model(x).logits.clone()
                        explained = torch._dynamo.explain(model)(x)
                        torch._dynamo.reset()
                        with inductor_config.patch(emulate_precision_casts=True):
                            compiled = torch.compile(model)
                            same = [torch.equal(compiled(x).logits, eager) for _ in range(2)]
                            graph, out = handle.capture(lambda: compiled(x).logits)
                            graph.replay()
                            replayed = torch.equal(out, eager)
                        torch._dynamo.reset()
                    row = {"plan": name, "batch": batch, "graph_breaks": explained.graph_break_count,
                           "break_reasons": sorted({str(b.reason)[:160] for b in explained.break_reasons}),
                           "compiled_equal_eager": all(same), "compiled_replayed_equal_eager": replayed}
                    bad += row["graph_breaks"] != 0 or not all(same) or not replayed
                    print(json.dumps(row), flush=True)
            finally:
                handle.remove(restore=False)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
