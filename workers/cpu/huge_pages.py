"""CPU tensors on 2 MB pages (transparent huge pages), for the memory a step streams through: the KV
cache and the projection weights' packed copies.

Why: on 4 KB pages every 4 KB of a cold read is a TLB miss, and in a VM a miss walks two page
tables. Decode attention reads each (request, KV head)'s context as 4 KB runs scattered over the
cache, and the projections stream ~425 MB of weights per step. Measured on the 2-core Zen 3 EPYC
(alternated in one process, median of 8 passes; docs/cpu-kernels.md):
decode attention over 30 layers of cold caches, 64 x 300-token contexts, 72.2 -> 69.3 ms;
panel_linear over 30 cold layers 20.8 -> 19.6 ms at 1 row, 38.9 -> 36.2 at 16, 113.0 -> 111.8 at
64. A plain C++ read of random 4 KB runs went 8-10 -> 12-14 GB/s with the same change.

torch's own switch for this (`THP_MEM_ALLOC_ENABLE=1`) is read once per process, before anything
here runs, and applies to every allocation of 2 MB or more; these buffers are mapped here instead
and handed to torch with `torch.frombuffer` (the tensor keeps the mapping alive). Where the kernel
has no transparent huge pages (`never`) or the platform no `madvise`, the mapping stays on 4 KB
pages: it is the same memory, only slower.
"""

from __future__ import annotations

import logging
import math
import mmap

import torch

from scheduler.math_utils import cdiv

logger = logging.getLogger(__name__)

# The x86-64 transparent huge page.
HUGE_PAGE_BYTES = 2 << 20
# Each tensor carved from an arena starts on a cache line (the kernels' 32-byte aligned loads).
ARENA_ALIGN = 64


def enabled() -> bool:
    """Whether CPU buffers go on huge pages: wherever the platform has madvise(MADV_HUGEPAGE)."""
    return hasattr(mmap, "MADV_HUGEPAGE")


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of nbytes (zero-filled by the OS, pages mapped on first touch) whose
    start is 2 MB aligned, on memory advised for huge pages."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError as exc:  # THP compiled out: 4 KB pages, still correct
        logger.debug("madvise(MADV_HUGEPAGE) refused: %s", exc)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    return raw[start:start + nbytes]


def carve(layouts: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """Uninitialized contiguous CPU tensors of these (shape, dtype)s, all from one huge-page
    mapping, each on a 64-byte boundary (torch.empty each where not enabled()). One mapping, not
    one per tensor: THP backs the page holding a mapping's end whole, so 60 per-layer caches of
    their own would each hold up to 2 MB more than they use."""
    if not enabled():
        return [torch.empty(shape, dtype=dtype) for shape, dtype in layouts]
    offsets, total = [], 0
    for shape, dtype in layouts:
        offsets.append(total)
        total += cdiv(math.prod(shape) * dtype.itemsize, ARENA_ALIGN) * ARENA_ALIGN
    arena = huge_page_bytes(total)
    return [arena[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            for (shape, dtype), offset in zip(layouts, offsets)]


def move_to_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of CPU tensors carved from one huge-page mapping; the tensors themselves
    where not enabled()."""
    if not enabled() or not tensors:
        return tensors
    moved = carve([(tuple(t.shape), t.dtype) for t in tensors])
    for copy, t in zip(moved, tensors):
        copy.copy_(t)
    return moved
