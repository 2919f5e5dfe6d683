"""Pinned host memory in one page-aligned allocation, and zero-copy device views of it.

Why one arena: torch's caching host allocator rounds every `pin_memory()`
request up to a power of two, and per-tensor pinning costs vLLM users 1.6-1.9x
the host RAM they asked for. Here the runtime sums what it needs, maps one
anonymous region of exactly that size (rounded up to a page) and page-locks it
with `cudaHostRegister`: pinned bytes = offloaded bytes + alignment padding.

Why the base is aligned: on the H100, bf16 GEMVs through a zero-copy view of
memory that starts 64 bytes past a page boundary (where `torch.empty` put the
arena before) read 42 GB/s; starting on a page, or 256 or 2048 bytes past one,
they read 50.8 GB/s, as fast as `cudaHostAlloc` memory (docs/uva-align/uva_align.py,
benchmarks/RESULTS.md). What counts is that every tensor starts on a 256-byte
boundary: a page-aligned base and `ALIGN` between tensors give that. A 2 MiB
base with transparent huge pages measured the same as a page, so the arena
takes a page: an anonymous `mmap` is page-aligned by construction. (For
`base_align` above a page the region is over-mapped, address space only, and
starts at the first aligned address.)

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

Without CUDA the arena is plain host memory, and its device views are the host
views themselves: the runtime takes the same path on either.

Lifecycle: `PinnedArena(nbytes)` -> `host_view(...)` / `device_view(...)` -> `release()`.
"""
from __future__ import annotations

import mmap
import weakref

import torch

from planner.errors import OffplanError

PAGE = mmap.PAGESIZE
HUGE_PAGE = 2 * 2**20
BASE_ALIGN = PAGE  # where the arena starts (docs/uva-align/uva_align.py measured a page and 2 MiB alike)
BASE_OFFSET = 0  # bytes past that boundary: 0, except to measure what alignment buys (benchmarks/decode.py)
ALIGN = 256  # bytes between tensors: UVA reads of a tensor starting 64 B past that run 16% slower


def align(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


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


def _map(nbytes: int, base_align: int, base_offset: int) -> torch.Tensor:
    """`nbytes` of fresh anonymous memory starting `base_offset` bytes past a `base_align` boundary.

    The tensor keeps the mapping alive (torch.frombuffer holds the mmap); it is
    unmapped when the last view of it goes.
    """
    extra = max(0, base_align - PAGE) + base_offset
    mm = mmap.mmap(-1, max(align(nbytes + extra, PAGE), PAGE))
    if base_align >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        mm.madvise(mmap.MADV_HUGEPAGE)  # a hint: fewer IOMMU translations per byte read, where the kernel agrees
    whole = torch.frombuffer(mm, dtype=torch.uint8)
    start = (-whole.data_ptr()) % base_align + base_offset
    return whole[start:start + nbytes]


class PinnedArena:
    """One page-locked, page-aligned host allocation carved into tensor views.

    `device` is where `device_view` puts its views: a CUDA device (zero-copy
    views of the pinned bytes) or the CPU (the host views themselves).
    `pinned_bytes` is what `cudaHostRegister` locked: `nbytes` rounded up to
    whole pages (0 without CUDA).
    """

    def __init__(self, nbytes: int, *, cuda: bool, device: torch.device | None = None,
                 base_align: int | None = None, base_offset: int | None = None):
        self.nbytes = nbytes
        self.cuda = cuda
        self.device = device if device is not None else (torch.device("cuda", torch.cuda.current_device())
                                                         if cuda else torch.device("cpu"))
        base_align = BASE_ALIGN if base_align is None else base_align
        base_offset = BASE_OFFSET if base_offset is None else base_offset
        self._memory = _Memory(_map(max(nbytes, 1), base_align, base_offset))
        self._view = None
        self.pinned_bytes = 0
        if cuda and nbytes:
            host = self._memory.host
            err = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel(), 0)
            if int(err) != 0:
                self._memory.host = None
                raise OffplanError(f"cudaHostRegister of {nbytes} bytes failed (error {int(err)}): not enough "
                                   "lockable host memory (check `ulimit -l`), or the range is registered already")
            self._memory.registered = True
            first = host.data_ptr() // PAGE * PAGE
            self.pinned_bytes = align(host.data_ptr() + nbytes, PAGE) - first
        self._finalizer = weakref.finalize(self, _free, self._memory, self.device if cuda else None)

    @property
    def registered(self) -> bool:
        return self._memory.registered

    @property
    def alive(self) -> bool:
        return self._memory.host is not None

    @property
    def base(self) -> int:
        """The arena's first address (host and device alike, under unified addressing)."""
        return self._host().data_ptr()

    def _host(self) -> torch.Tensor:
        host = self._memory.host
        if host is None:
            raise RuntimeError("offplan: this pinned arena was released")
        return host

    def host_view(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 CPU view of [offset, offset + nbytes)."""
        return self._host()[offset:offset + nbytes]

    def device_view(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 view of the same bytes on `self.device`: zero copy (read over PCIe) on CUDA,
        the host view itself on the CPU."""
        if not self.cuda:
            return self.host_view(offset, nbytes)
        if self._view is None:
            host = self._host()
            cai = _CudaArrayInterface(host.data_ptr(), host.numel(), self)
            self._view = torch.as_tensor(cai, device=self.device)
        return self._view[offset:offset + nbytes]

    def release(self) -> None:
        """Unregister and drop the memory now. Every view must be gone (or unused) by now."""
        self._view = None
        self._finalizer()


def typed(flat: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """View a uint8 span as `dtype` with `shape`."""
    return flat.view(dtype).view(shape)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (any dtype, including 0-d and empty)."""
    return t.reshape(-1).view(torch.uint8)


def named_views(layout, cuda: bool, device: torch.device) -> tuple[PinnedArena, dict[str, torch.Tensor]]:
    """One arena holding each (name, dtype, shape) of `layout` at its own aligned offset: the arena, and each
    name's typed view of it."""
    offsets, total = [], 0
    for _, dtype, shape in layout:
        offsets.append(total)
        total = align(total + dtype.itemsize * torch.Size(shape).numel())
    arena = PinnedArena(total, cuda=cuda, device=device)
    return arena, {name: typed(arena.host_view(offset, dtype.itemsize * torch.Size(shape).numel()), dtype, shape)
                   for (name, dtype, shape), offset in zip(layout, offsets)}
