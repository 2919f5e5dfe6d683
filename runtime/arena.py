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
reference to the interface object, which holds the arena: the memory cannot be
freed, nor unregistered by the garbage collector, under a live view. `release()`
unregisters at once (the runtime drops its views first); an arena that is
simply dropped unregisters when its last view goes (`weakref.finalize`), so
freed memory is never left registered: a later registration of the same
addresses would fail with cudaErrorHostMemoryAlreadyRegistered.

Without CUDA the arena is plain host memory and views are CPU tensors.

Lifecycle: `PinnedArena(nbytes)` -> `host(...)` / `device(...)` views -> `release()`.
"""
from __future__ import annotations

import weakref

import torch

from planner.errors import OffplanError

ALIGN = 256  # bytes between tensors; kernels need 16, and the host allocator gives the base at least 64


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _CudaArrayInterface:
    """The minimal object `torch.as_tensor(..., device="cuda")` accepts; keeps `owner` alive."""

    def __init__(self, ptr: int, nbytes: int, owner: "PinnedArena"):
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None}


class _Memory:
    """The host tensor and whether it is registered: what the finalizer needs, without the arena."""

    def __init__(self, host: torch.Tensor):
        self.host: torch.Tensor | None = host
        self.registered = False


def _free(memory: _Memory, device: torch.device | None) -> None:
    """Unregister (once) and drop the host memory. Run by release() or when the arena is collected."""
    if memory.registered and memory.host is not None:
        torch.cuda.synchronize(device)
        torch.cuda.cudart().cudaHostUnregister(memory.host.data_ptr())
        memory.registered = False
    memory.host = None


class PinnedArena:
    """One page-locked host allocation carved into tensor views."""

    def __init__(self, nbytes: int, *, cuda: bool, device: torch.device | None = None):
        self.nbytes = nbytes
        self.cuda = cuda
        self.device = device if device is not None else (torch.device("cuda", torch.cuda.current_device())
                                                         if cuda else torch.device("cpu"))
        self._memory = _Memory(torch.empty(max(nbytes, 1), dtype=torch.uint8))
        self._device = None
        if cuda and nbytes:
            host = self._memory.host
            err = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel(), 0)
            if int(err) != 0:
                self._memory.host = None
                raise OffplanError(f"cudaHostRegister of {nbytes} bytes failed (error {int(err)}): not enough "
                                   "lockable host memory (check `ulimit -l`), or the range is registered already")
            self._memory.registered = True
        self._finalizer = weakref.finalize(self, _free, self._memory, self.device if cuda else None)

    @property
    def registered(self) -> bool:
        return self._memory.registered

    @property
    def alive(self) -> bool:
        return self._memory.host is not None

    @property
    def _host(self) -> torch.Tensor:
        host = self._memory.host
        if host is None:
            raise RuntimeError("offplan: this pinned arena was released")
        return host

    def host(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 CPU view of [offset, offset + nbytes)."""
        return self._host[offset:offset + nbytes]

    def device(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 CUDA view of the same bytes: zero copy, read over PCIe."""
        if self._device is None:
            cai = _CudaArrayInterface(self._host.data_ptr(), self._host.numel(), self)
            self._device = torch.as_tensor(cai, device=self.device)
        return self._device[offset:offset + nbytes]

    def release(self) -> None:
        """Unregister and drop the memory now. Every view must be gone (or unused) by now."""
        self._device = None
        self._finalizer()


def typed(flat: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """View a uint8 span as `dtype` with `shape`."""
    return flat.view(dtype).view(shape)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (any dtype, including 0-d and empty)."""
    return t.reshape(-1).view(torch.uint8)
