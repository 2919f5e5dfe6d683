"""What the host engine (engine.py) keeps of one experts module with experts on cpu, and who computes them.

`HostModule` holds the module's stored weights as host tensors (the arena's CPU views, where the plan's pinned
parameter lies), its mask of experts on cpu, and, for a block-scaled FP8 module, the scales beside the FP8 data
(quant.py). `job` makes native.cpp's call over them.

Who computes a module (`computed_natively`): native.cpp, where it is built, for gated experts (kernel.py
`gated_like`) whose weights are bf16, or FP8 E4M3 with their block scales (converted as read, outputs in bf16:
bitwise those of the bf16 kernel on the dequantized experts, native.cpp); the engine's Python worker (kernel.py)
for any other gated or ungated bf16/fp16/fp32 module. Quantized experts never go to the worker: bind.py `check`
refuses FP8 experts on cpu without native.cpp, and MXFP4 ones, before the load.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import native

NATIVE_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)  # the weights native.cpp reads: bf16, or FP8 E4M3 + scales


@dataclass
class HostModule:
    module: torch.nn.Module
    weights: dict[str, torch.Tensor]  # fused parameter -> its host tensor (the arena's CPU view): FP8 data for FP8
    on_cpu: torch.Tensor  # [E] bool, CPU: experts the host computes
    on_cpu_device: torch.Tensor  # the same on the model's device
    top_k: int
    gated: bool  # the compiled kernel computes it (`gated_like`)
    native: bool  # native.cpp computes it, no Python in the way (module doc)
    on_cpu_bytes: torch.Tensor  # on_cpu as uint8, for native.cpp
    dtype: torch.dtype  # what the module computes in: its activations' and the host's outputs'
    scales: dict[str, torch.Tensor] = field(default_factory=dict)  # FP8: fused parameter -> its block scales
    block: tuple[int, int] = (0, 0)  # FP8: the elements (rows, columns) one scale covers

    def job(self, pool: native.Pool, x: torch.Tensor, ids: torch.Tensor, y: torch.Tensor, tokens: int,
            top_k: int | None = None) -> native.Job:
        """native.cpp's call of this module over `tokens` tokens with the exchange buffers x, ids, y."""
        fp8 = dict(scales=(self.scales["gate_up_proj"], self.scales["down_proj"]), block=self.block) \
            if self.scales else {}
        return native.job(pool, self.weights["gate_up_proj"], self.weights["down_proj"], self.on_cpu_bytes, x, ids,
                          y, tokens, self.top_k if top_k is None else top_k, **fp8)

    @property
    def expert_bytes(self) -> int:
        """One expert's stored bytes, read by the host once per call that routes a token to it: its weights, and
        an FP8 module's scales."""
        return sum(w[0].nbytes for w in (*self.weights.values(), *self.scales.values()))  # [E, ...] each

    @property
    def hidden(self) -> int:
        w = self.weights["down_proj"]  # [E, H, I] ([E, I, H] transposed)
        return w.shape[-1] if self.module.is_transposed else w.shape[-2]


def computed_natively(lib, gated: bool, weights: dict[str, torch.Tensor], fp8: bool) -> bool:
    """Whether native.cpp computes a module (module doc): `lib` loaded (native.py `library`), `gated`, and its
    weights bf16, or FP8 E4M3 with scales (`fp8`)."""
    dtypes = {w.dtype for w in weights.values()}
    return lib is not None and gated and dtypes == {torch.float8_e4m3fn if fp8 else torch.bfloat16}
