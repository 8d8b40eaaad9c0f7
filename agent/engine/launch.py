"""Run a function on ``world`` local processes joined by gloo (CPU ranks), collecting each rank's
return value. Used by the local driver, the benchmarks and the multi-process tests.

Results travel as ``torch.save`` bytes, not shared-memory tensors, so a rank may exit before the
parent reads them; a failing rank reports its traceback instead of leaving the others hanging.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, threads: int, q: Any,
           args: tuple[Any, ...]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        buf = io.BytesIO()
        torch.save(fn(rank, world, *args), buf)
        q.put((rank, "ok", buf.getvalue()))
    except BaseException:  # report any failure to the parent instead of hanging it
        q.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_local(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 240.0,
              threads_per_rank: int = 1) -> list[Any]:
    """``fn(rank, world, *args)`` on each of ``world`` spawned ranks; their results in rank order."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, threads_per_rank, q, args), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, status, value = q.get(timeout=timeout_s)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]
