"""The pinned arena's API as the runtime calls it, on the CPU (the same calls run on CUDA in the GPU suite)."""
from __future__ import annotations

import inspect

import pytest

torch = pytest.importorskip("torch")

from runtime.place.arena import BASE_ALIGN, HUGE_PAGE, PAGE, PinnedArena, align, typed  # noqa: E402


def test_no_attribute_hides_a_method():
    """An instance attribute named like a method (`self.device` over `device()`) breaks every caller on CUDA only."""
    arena = PinnedArena(4096, cuda=False)
    members = {name for name, _ in inspect.getmembers(PinnedArena) if not name.startswith("__")}
    assert not members & set(vars(arena)), members & set(vars(arena))


def test_views_as_the_handle_takes_them():
    arena = PinnedArena(3 * 1000, cuda=False)
    a, b = align(1000), 2 * align(1000)
    host = typed(arena.host_view(a, 1000), torch.uint8, (10, 100))
    host.copy_(torch.arange(1000, dtype=torch.int64).reshape(10, 100) % 251)
    view = typed(arena.device_view(a, 1000), torch.uint8, (10, 100))
    assert view.device == arena.device == torch.device("cpu")
    assert view.data_ptr() == host.data_ptr() == arena.base + a  # the same bytes, no copy
    assert torch.equal(view, host)
    assert arena.device_view(b, 8).data_ptr() == arena.base + b
    assert arena.pinned_bytes == 0  # nothing is page-locked without CUDA
    arena.release()
    assert not arena.alive
    with pytest.raises(RuntimeError, match="released"):
        arena.host_view(0, 1)


@pytest.mark.parametrize("base_align", [PAGE, HUGE_PAGE])
def test_the_base_is_aligned(base_align):
    for nbytes in (1, 4095, 4096, 10**6 + 7):
        arena = PinnedArena(nbytes, cuda=False, base_align=base_align)
        assert arena.base % base_align == 0
        assert arena.host_view(0, nbytes).numel() == nbytes
        arena.host_view(0, nbytes).fill_(7)  # every byte is writable memory
        arena.release()


def test_default_base_is_page_aligned_and_an_offset_moves_it():
    assert PinnedArena(100, cuda=False).base % BASE_ALIGN == 0
    assert PinnedArena(100, cuda=False, base_offset=64).base % PAGE == 64  # what benchmarks compare against


def test_views_keep_the_memory_alive():
    arena = PinnedArena(PAGE, cuda=False)
    view = arena.device_view(0, PAGE)
    view.fill_(3)
    del arena
    assert int(view.sum()) == 3 * PAGE
