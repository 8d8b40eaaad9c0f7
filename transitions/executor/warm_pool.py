"""Memory this worker has already touched, kept for its next buffers (CPU): the warm pool.

A fresh anonymous mapping pays a first touch of every page it is written to (the kernel maps and
zeroes 4 KiB pages: ~1.3 GB/s here, where writing warm memory runs at 15-28 GB/s), so a transition
receiving into new unit buffers ran at a third of gloo's speed into warm buffers, and freeing the
old units (munmap) cost as much again. Here a CPU buffer's mapping outlives its tensors: when the
last tensor viewing it dies (a finalizer on the buffer object, so no view can see its reuse) it
returns to the pool, pages still mapped, and the next buffer of at most its size and at least half
of it takes the best-fitting one. Pages an early build moved out of it (``pages.move_pages``) or
``release_tail`` gave back are simply touched again when written.

The pool holds at most ``WARM_POOL_BYTES`` (a mapping that does not fit is unmapped), so a worker
keeps at most that much beyond its live state; ``trim`` unmaps everything held. 0 turns it off. The
bound is $NEREUS_WARM_POOL_BYTES, else 1/16 of the host's memory (at most 8 GiB).

A mapping whose pages moved out (an early build, pages lent by a merge's local runs) or were given
back (``release_tail``) returns to the pool empty there, and the next transition writing it paid
the first touches after all: tiny-25m's TP merge and TP split took 78-156 MiB of page faults per
worker (~0.1 s). ``refill`` populates what the pool holds again (``MADV_POPULATE_WRITE``: only the
missing pages, at the kernel's zeroing speed) on a thread (``refill_async``), so the zeroing happens
between transitions, not inside the next one. A run only asks for it (``refill_later``); the worker
starts it when its next command arrives (``start_pending``), when every peer's run is over too: a
worker done early otherwise zeroed pages (~0.1 s of kernel time for tiny-25m's 163 MiB) while its
peers still moved bytes, on the same cores. ``settle`` starts one still pending, then waits for it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading
import time
import weakref
from dataclasses import dataclass, field

import psutil
import torch

from transitions.executor import background
from transitions.executor.background import Job


def _default_bound() -> int:
    """$NEREUS_WARM_POOL_BYTES, else 1/16 of the host's memory up to 8 GiB: several workers share a host
    (a CPU node runs one per slot), and what the pool holds stays resident between transitions."""
    env = os.environ.get("NEREUS_WARM_POOL_BYTES")
    if env is not None:
        try:
            value = int(env)
        except ValueError:
            raise ValueError(f"NEREUS_WARM_POOL_BYTES must be a byte count (0 turns the pool off), got {env!r}") \
                from None
        if value < 0:
            raise ValueError(f"NEREUS_WARM_POOL_BYTES must be >= 0, got {value}")
        return value
    return min(8 << 30, psutil.virtual_memory().total // 16)


# most bytes a worker keeps mapped for reuse beyond what its tensors hold
WARM_POOL_BYTES = _default_bound()

_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_LIBC.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_LIBC.munmap.restype = ctypes.c_int
_LIBC.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_LIBC.madvise.restype = ctypes.c_int
_MAP_FAILED = ctypes.c_void_p(-1).value
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault the range in, writable, as a write would


@dataclass(slots=True)
class _Stats:
    reused: int = 0  # buffers handed out from the pool
    reused_bytes: int = 0
    fresh: int = 0  # buffers newly mapped
    fresh_bytes: int = 0
    refills: int = 0  # refill passes
    refill_s: float = 0.0  # their time on the refilling thread


@dataclass
class WarmPool:
    """Mappings (address, length) no tensor views any more, kept mapped for reuse."""

    free: list[tuple[int, int]] = field(default_factory=list)
    held_bytes: int = 0
    stats: _Stats = field(default_factory=_Stats)
    lock: threading.Lock = field(default_factory=threading.Lock)
    refilling: Job | None = None
    pending: bool = False  # a refill asked for (``refill_later``), not started yet

    def take(self, num_bytes: int) -> torch.Tensor:
        """A uint8 CPU buffer of ``num_bytes`` in a private anonymous mapping of its own (page-aligned):
        a held mapping of [num_bytes, 2 * num_bytes] when there is one (the smallest), else a new one."""
        length = -(-num_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
        with self.lock:
            fits = [r for r in self.free if length <= r[1] <= 2 * length]
            region = min(fits, key=lambda r: r[1]) if fits else None
            if region is not None:
                self.free.remove(region)
                self.held_bytes -= region[1]
                self.stats.reused += 1
                self.stats.reused_bytes += num_bytes
        if region is None:
            region = (_map(length), length)
            with self.lock:
                self.stats.fresh += 1
                self.stats.fresh_bytes += num_bytes
        addr, mapped = region
        owner = (ctypes.c_uint8 * num_bytes).from_address(addr)
        weakref.finalize(owner, self._give, addr, mapped)  # the last view of the buffer is gone
        return torch.frombuffer(owner, dtype=torch.uint8)  # type: ignore[arg-type]

    def _give(self, addr: int, length: int) -> None:
        with self.lock:
            keep = WARM_POOL_BYTES - self.held_bytes >= length
            if keep:
                self.free.append((addr, length))
                self.held_bytes += length
        if not keep:
            _LIBC.munmap(addr, length)

    def refill(self) -> int:
        """Populate every held mapping's missing pages (present ones are left as they are). Each
        mapping leaves the pool while it is populated, so no buffer is handed out of it meanwhile
        (a request then maps fresh memory) and none is unmapped under it. Returns the bytes walked."""
        start = time.perf_counter()
        with self.lock:
            todo, self.free = self.free, []
            self.held_bytes -= sum(n for _, n in todo)
        done = 0
        try:
            for addr, length in todo:
                _LIBC.madvise(addr, length, _MADV_POPULATE_WRITE)  # refused (old kernel): stays as it is
                done += length
        finally:
            for addr, length in todo:
                self._give(addr, length)
            with self.lock:
                self.stats.refills += 1
                self.stats.refill_s += time.perf_counter() - start
        return done

    def refill_async(self) -> Job | None:
        """``refill`` on the refill thread (``background.REFILLS``, started once: madvise runs without
        the GIL); None when one is still queued or running. ``settle`` waits for it."""
        with self.lock:
            if self.refilling is not None and self.refilling.is_alive():
                return None
            self.refilling = job = background.REFILLS.submit(self.refill)
        return job

    def refill_later(self) -> None:
        """Ask for a refill, started by ``start_pending`` (or ``settle``), not now."""
        self.pending = True

    def start_pending(self) -> Job | None:
        """The refill asked for by ``refill_later``, on its thread (``refill_async``); None when none
        is pending (or one still runs: the request then stays pending)."""
        if not self.pending:
            return None
        job = self.refill_async()
        if job is not None:
            self.pending = False
        return job

    def settle(self, timeout_s: float = 60.0) -> None:
        """Wait (bounded by ``timeout_s`` in all) until no refill runs and none is pending: one asked
        for while another ran starts once that one is done."""
        deadline = time.monotonic() + timeout_s
        for _ in range(2):
            self.start_pending()
            job = self.refilling
            if job is not None:
                job.wait(max(0.0, deadline - time.monotonic()))

    def trim(self) -> int:
        """Unmap every held mapping; returns the bytes given back."""
        with self.lock:
            free, self.free, held, self.held_bytes = self.free, [], self.held_bytes, 0
        for addr, length in free:
            _LIBC.munmap(addr, length)
        return held


def _map(length: int) -> int:
    addr = _LIBC.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if addr is None or addr == _MAP_FAILED:
        raise MemoryError(f"mmap of {length} bytes failed (errno {ctypes.get_errno()})")
    return int(addr)


POOL = WarmPool()  # the process's
