"""uva tensors copied to the GPU just before their module runs (`load(..., uva=False)`), without touching
`param.data`.

Every module that owns uva tensors (under any of their names: a tied
embedding also belongs to the head) gets a region of one shared GPU buffer,
`stage_bytes` long: the largest module's uva tensors, each ALIGN apart. The
parameters are views of that buffer from load to remove, like prefetched ones
are views of their slot; a forward pre-hook copies the module's tensors from
pinned host memory into the buffer on the current stream, so the copy is
ordered after whatever earlier module still reads the buffer, and before this
module's kernels. Only one module's tensors are on the GPU at a time.

A tensor shared by modules that also own other uva tensors is given one
offset for all of them; if that would make two of a module's tensors overlap,
loading fails (no transformers model known to us does this).
"""
from __future__ import annotations

import torch

from planner.errors import OffplanError

from ..place.arena import PinnedArena, align, as_bytes, typed
from ..place.names import Target


class UvaStaging:
    """The shared buffer, each uva tensor's view of it, and the hooks that fill it."""

    def __init__(self, uva: list[Target], host_offset: dict[str, int], arena: PinnedArena, model: torch.nn.Module,
                 device: torch.device):
        owners: dict[str, dict[str, Target]] = {}  # module path -> its uva targets, by name
        for t in uva:
            for alias in t.aliases:
                owners.setdefault(alias.rpartition(".")[0], {})[t.name] = t
        owners = {path: list(ts.values()) for path, ts in owners.items()}
        offset: dict[str, int] = {}
        for ts in owners.values():
            cursor = 0
            for t in ts:
                if t.name not in offset:
                    offset[t.name] = cursor
                cursor = align(max(cursor, offset[t.name]) + t.nbytes)
        for path, ts in owners.items():
            spans = sorted((offset[t.name], offset[t.name] + t.nbytes) for t in ts)
            if any(b[0] < a[1] for a, b in zip(spans, spans[1:])):
                raise OffplanError(f"{path}: its uva tensors would overlap in the staging buffer; load with uva=True")
        self.stage_bytes = max((offset[t.name] + t.nbytes for t in uva), default=0)
        self.buffer = torch.empty(self.stage_bytes, dtype=torch.uint8, device=device)
        self.views = {t.name: typed(self.buffer[offset[t.name]:offset[t.name] + t.nbytes], t.dtype, t.shape)
                      for t in uva}
        self.hooks = []
        for path, ts in owners.items():
            copies = [(as_bytes(self.views[t.name]), arena.host_view(host_offset[t.name], t.nbytes)) for t in ts]
            self.hooks.append(model.get_submodule(path).register_forward_pre_hook(self._fill(copies)))

    @staticmethod
    def _fill(copies):
        def hook(module, args):
            for dst, src in copies:
                dst.copy_(src, non_blocking=True)
        return hook

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []
        self.views = {}
        self.buffer = None
