"""workers/cpu/huge_pages.py: CPU buffers on 2 MB pages for the KV cache and packed weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workers.cpu import huge_pages
from workers.runner.kv_cache import KVCacheSpec, allocate_kv_cache

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_available() -> bool:
    """The kernel hands out transparent huge pages to madvised memory ("always" or "madvise")."""
    return THP_MODE.exists() and "[never]" not in THP_MODE.read_text() and huge_pages.enabled()


def anon_huge_kb(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside, total = False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total


def test_carve_gives_aligned_disjoint_tensors_of_one_mapping():
    layouts = [((3, 1000, 7), torch.float32), ((5,), torch.bfloat16), ((16, 64), torch.float32)]
    tensors = huge_pages.carve(layouts)
    for t, (shape, dtype) in zip(tensors, layouts):
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert t.data_ptr() % huge_pages.ARENA_ALIGN == 0
    if huge_pages.enabled():
        assert tensors[0].data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
        assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
        assert spans[-1][1] - spans[0][0] < 2 * huge_pages.HUGE_PAGE_BYTES  # one mapping
    for value, t in enumerate(tensors):
        t.fill_(value)
    assert [float(t.float().mean()) for t in tensors] == [0.0, 1.0, 2.0]


@pytest.mark.skipif(not thp_available(), reason="the kernel gives no transparent huge pages (THP 'never')")
def test_touched_buffer_is_backed_by_huge_pages():
    (t,) = huge_pages.carve([((4 * huge_pages.HUGE_PAGE_BYTES // 4,), torch.float32)])
    t.zero_()  # first touch maps the pages
    assert anon_huge_kb(t.data_ptr()) >= 2048


def test_move_to_huge_pages_keeps_values_and_aligns_each_tensor():
    tensors = [torch.randn(5, 7), torch.randn(16, 3, 16), torch.randn(1).to(torch.bfloat16), torch.randn(33)]
    moved = huge_pages.move_to_huge_pages(tensors)
    for before, after in zip(tensors, moved):
        assert after.shape == before.shape and after.dtype == before.dtype and after.is_contiguous()
        assert torch.equal(before, after)
        assert after.data_ptr() % huge_pages.ARENA_ALIGN == 0
    if huge_pages.enabled():
        # One mapping, no overlaps: writing one leaves the others as they were.
        moved[0].fill_(0)
        assert all(torch.equal(b, a) for b, a in zip(tensors[1:], moved[1:]))
        assert len({t.data_ptr() for t in moved}) == len(moved)


def test_without_madvise_keeps_the_allocator(monkeypatch):
    monkeypatch.setattr(huge_pages, "enabled", lambda: False)
    tensors = [torch.randn(4, 4)]
    assert huge_pages.move_to_huge_pages(tensors)[0] is tensors[0]
    assert huge_pages.carve([((2, 2), torch.float32)])[0].shape == (2, 2)


def test_cpu_kv_cache_is_zeroed_head_major_on_huge_pages():
    spec = KVCacheSpec(num_layers=2, block_size=16, num_kv_heads=3, head_dim=64, dtype=torch.float32)
    caches = allocate_kv_cache(spec, num_blocks=40, device=torch.device("cpu"))
    for k, v in caches:
        for c in (k, v):
            assert c.shape == (40, 16, 3, 64)
            assert c.stride() == (3 * 16 * 64, 64, 16 * 64, 1)  # head-major memory
            assert not c.any()
    starts = sorted(c.data_ptr() for pair in caches for c in pair)
    assert all(b - a >= 40 * 16 * 3 * 64 * 4 for a, b in zip(starts, starts[1:]))  # no two overlap
    if huge_pages.enabled():
        assert starts[0] % huge_pages.HUGE_PAGE_BYTES == 0
