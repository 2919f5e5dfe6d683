"""Pinned host memory in one allocation, and zero-copy CUDA views of it.

Why one arena: torch's caching host allocator rounds every `pin_memory()`
request up to a power of two, and per-tensor pinning costs vLLM users 1.6-1.9x
the host RAM they asked for. Here the runtime sums what it needs (each tensor
aligned to `ALIGN` bytes), allocates one ordinary host tensor of exactly that
size and page-locks it with `cudaHostRegister`: pinned bytes = offloaded bytes
+ alignment padding.

Why a CUDA view works: with unified virtual addressing, registered host memory
has the same address on the device. `torch.as_tensor` over an object exposing
`__cuda_array_interface__` at that address gives a CUDA tensor that reads the
host memory in place (kernels then pull it over PCIe). The view holds a
reference to the interface object, which holds the host tensor: the memory
cannot be freed under a live view, but it *can* be unregistered by `release()`,
so the runtime drops every view first.

Without CUDA the arena is plain host memory and views are CPU tensors.

Lifecycle: `PinnedArena(nbytes)` -> `host(...)` / `device(...)` views -> `release()`.
"""
from __future__ import annotations

import torch

ALIGN = 256  # bytes; matches what the CUDA caching allocator gives, so kernels see the same alignment


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _CudaArrayInterface:
    """The minimal object `torch.as_tensor(..., device="cuda")` accepts; keeps `owner` alive."""

    def __init__(self, ptr: int, nbytes: int, owner: torch.Tensor):
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None}


class PinnedArena:
    """One page-locked host allocation carved into tensor views."""

    def __init__(self, nbytes: int, *, cuda: bool):
        self.nbytes = nbytes
        self.cuda = cuda
        self.registered = False
        self._host = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        self._device = None
        if cuda and nbytes:
            cudart = torch.cuda.cudart()
            err = cudart.cudaHostRegister(self._host.data_ptr(), self._host.numel(), 0)
            if int(err) != 0:
                self._host = None
                raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed ({err}): "
                                   "not enough lockable host memory? (check `ulimit -l`)")
            self.registered = True

    def host(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 CPU view of [offset, offset + nbytes)."""
        return self._host[offset:offset + nbytes]

    def device(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 CUDA view of the same bytes: zero copy, read over PCIe."""
        if self._device is None:
            cai = _CudaArrayInterface(self._host.data_ptr(), self._host.numel(), self._host)
            self._device = torch.as_tensor(cai, device="cuda")
        return self._device[offset:offset + nbytes]

    def release(self) -> None:
        """Unregister and drop the memory. Every view must be gone (or unused) by now."""
        self._device = None
        if self.registered and self._host is not None:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self._host.data_ptr())
            self.registered = False
        self._host = None


def typed(flat: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """View a uint8 span as `dtype` with `shape`."""
    return flat.view(dtype).view(shape)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (any dtype, including 0-d and empty)."""
    return t.reshape(-1).view(torch.uint8)
