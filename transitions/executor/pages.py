"""Moving and copying raw memory inside this process (CPU): libc memmove, madvise and mremap.

A run a new unit keeps from an old one on the same worker can change buffers as whole pages
(``mremap`` with ``MREMAP_DONTUNMAP``): 126 MiB in 504 runs of 256 KiB in ~5 ms here, where copying
into fresh pages runs at 1.7-3 GB/s. Only between mappings of our own (``buffers.alloc_bytes``),
never in or out of malloc's heap; a refused move is copied instead.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
from dataclasses import dataclass, field

import torch

from transitions.layout import PAGE_BYTES

# runs from this size change buffers as pages; smaller ones are copied. Each moved run costs the new
# buffer up to two mappings (vm.max_map_count is 65530 by default; a refused move is copied instead)
MOVE_MIN_BYTES = 64 << 10

_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_LIBC.memmove.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_LIBC.memmove.restype = ctypes.c_void_p
_LIBC.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_LIBC.madvise.restype = ctypes.c_int
_MADV_DONTNEED = 4
_LIBC.mremap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
_LIBC.mremap.restype = ctypes.c_void_p
_MREMAP_MAYMOVE, _MREMAP_FIXED, _MREMAP_DONTUNMAP = 1, 2, 4


def memmove(dst: int, src: int, num_bytes: int) -> None:
    """libc memmove between two addresses of this process's CPU memory (overlap allowed)."""
    _LIBC.memmove(dst, src, num_bytes)


def release_tail(flat: torch.Tensor, keep: int) -> int:
    """Give the whole pages of ``flat`` past its first ``keep`` bytes back to the OS (CPU): the
    buffer a unit was compacted into keeps only what the new unit uses. Returns the bytes released."""
    if flat.device.type != "cpu" or not hasattr(mmap, "PAGESIZE"):
        return 0
    page = mmap.PAGESIZE
    start = -(-(flat.data_ptr() + keep) // page) * page
    end = (flat.data_ptr() + flat.numel()) // page * page
    if end - start < page:
        return 0
    if _LIBC.madvise(start, end - start, _MADV_DONTNEED) != 0:
        return 0  # memory stays held: correct, only less frugal
    return end - start


def move_pages(dst: int, src: int, num_bytes: int) -> bool:
    """Move the pages of [src, src + num_bytes) to ``dst`` (both page-aligned): the memory changes
    address, no byte is copied, and ``src`` keeps an empty mapping (it reads zeros; nothing else may
    be mapped there meanwhile). False where the kernel refuses (Linux < 5.7, or memory that is not
    private and anonymous): the caller copies instead."""
    got = _LIBC.mremap(src, num_bytes, num_bytes, _MREMAP_MAYMOVE | _MREMAP_FIXED | _MREMAP_DONTUNMAP, dst)
    return got == dst


def move_or_copy(d: int, s: int, n: int, moved: list[tuple[int, int, int]], pages: bool = True) -> tuple[int, int]:
    """Put the ``n`` bytes at address ``s`` at address ``d``: with ``pages`` and both at the same
    offset within a page, the whole pages in between are moved (recorded in ``moved`` as (dst, src,
    bytes)) and the ragged ends copied; otherwise everything is copied. Returns (copied, moved)."""
    head = -d % PAGE_BYTES
    body = (n - head) // PAGE_BYTES * PAGE_BYTES if pages and n >= max(MOVE_MIN_BYTES, 2 * PAGE_BYTES) else 0
    if body and (s - d) % PAGE_BYTES == 0 and move_pages(d + head, s + head, body):
        moved.append((d + head, s + head, body))
        if head:
            memmove(d, s, head)
        if n - head - body:
            memmove(d + head + body, s + head + body, n - head - body)
        return n - body, body
    memmove(d, s, n)
    return n, 0


@dataclass(slots=True, kw_only=True)
class PagesMoved:
    """What a move out of a donor's buffer did, kept until the DAG frees the donor so that a failure
    can undo it: the page runs moved ((dst, src, bytes) each), the bytes copied where pages could not
    move, and the seconds it took (early builds, transitions.executor.early_build; lent local pieces,
    transitions.executor.lend)."""

    moved: list[tuple[int, int, int]] = field(default_factory=list)
    copied: int = 0
    seconds: float = 0.0

    @property
    def moved_bytes(self) -> int:
        return sum(n for _, _, n in self.moved)

    def undo(self) -> None:
        """Give the donor its pages back (the targets, dropped by the caller, keep empty ones)."""
        for dst, src, n in reversed(self.moved):
            if not move_pages(src, dst, n):
                memmove(src, dst, n)
        self.moved.clear()
