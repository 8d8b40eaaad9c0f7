"""The data channel: torch.distributed worlds formed in generations, point-to-point moves with timeouts.

Workers keep their tensors in memory across generations; only the process group is torn down and
re-formed (destroy, then init the new world through a TCPStore rendezvous under a per-generation
prefix). Workers are addressed by their stable worker id (one per device); a generation maps ids to
ranks. The backend follows the device: NCCL on CUDA, gloo on CPU, same code path.

After ANY communication error the group is treated as broken (gloo groups can hang after a failed
collective): the channel destroys it at once, which also makes peers blocked on this worker fail
fast instead of waiting for their timeout, and every later call raises ``ChannelBroken`` until the
next generation is joined.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from planner.errors import NereusError, SpecError


class ChannelBroken(NereusError):
    """A communication failed or timed out; the generation is gone and must be re-formed."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerationSpec:
    """One world generation: its number, member worker ids in rank order, and the rendezvous store."""

    generation: int
    members: tuple[int, ...]
    store_host: str
    store_port: int
    timeout_s: float = 30.0  # rendezvous and per-operation bound: nothing waits longer

    def __post_init__(self) -> None:
        if self.generation < 0:
            raise SpecError("generation", f"must be >= 0, got {self.generation}")
        if not self.members or len(set(self.members)) != len(self.members):
            raise SpecError("members", f"must be non-empty and distinct, got {self.members}")
        if not 0 < self.store_port < 65536:
            raise SpecError("store_port", f"{self.store_port} outside 1..65535")
        if self.timeout_s <= 0:
            raise SpecError("timeout_s", f"must be > 0, got {self.timeout_s}")

    def rank_of(self, worker_id: int) -> int:
        try:
            return self.members.index(worker_id)
        except ValueError:
            raise SpecError("worker_id", f"{worker_id} is not a member of generation {self.generation}",
                            ", ".join(map(str, self.members))) from None


def forget_meshes() -> None:
    """Drop what DTensor cached about device meshes of a world that is gone. A DeviceMesh hashes by
    its layout, not by its process groups, and the sharding propagation caches its answers (meshes
    included) by that hash without bound: a mesh of the same layout in the next world would find the
    old mesh there, and its collectives would name a process group that no longer exists."""
    from torch.distributed.tensor import DTensor

    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if native is not None:  # the C++ dispatch fast path's cache, ahead of the Python one
        native()
    prop = DTensor._op_dispatcher.sharding_propagator
    for name in ("propagate_op_sharding", "_propagate_tensor_meta_cached"):
        cache = getattr(prop, name, None)
        if cache is not None and hasattr(cache, "cache_clear"):
            cache.cache_clear()


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass(kw_only=True, slots=True)
class P2POp:
    """One send (``is_send``) or receive of a contiguous tensor with a peer worker."""

    peer: int
    tensor: torch.Tensor
    is_send: bool


@dataclass(slots=True)
class InFlight:
    """Posted point-to-point operations; ``wait`` bounds the wait and breaks the group on failure."""

    channel: DataChannel
    works: list[Any]
    generation: int

    def wait(self, timeout_s: float | None = None) -> None:
        if not self.works:
            return
        spec = self.channel._require()
        timeout = timedelta(seconds=timeout_s or spec.timeout_s)
        try:
            for work in self.works:
                work.wait(timeout)
        except Exception as exc:  # noqa: BLE001 - peer death, timeout, transport error: all break the group
            self.channel.break_(f"p2p in generation {self.generation}: {exc}")
            raise ChannelBroken(self.channel.broken_reason or "p2p failed") from exc
        finally:
            self.works = []


@dataclass(slots=True)
class DataChannel:
    """One worker's end of the data channel. Not thread-safe: one worker thread drives it."""

    worker_id: int
    device: torch.device
    spec: GenerationSpec | None = None
    broken_reason: str | None = None
    join_seconds: list[float] = field(default_factory=list)
    _store: dist.TCPStore | None = None
    _store_addr: tuple[str, int] | None = None

    @property
    def ready(self) -> bool:
        return self.spec is not None and self.broken_reason is None

    def join(self, spec: GenerationSpec) -> None:
        """Leave the current generation (if any) and form ``spec``'s world. Tensors are untouched."""
        start = time.perf_counter()
        self.leave()
        rank = spec.rank_of(self.worker_id)
        timeout = timedelta(seconds=spec.timeout_s)
        if self._store is None or self._store_addr != (spec.store_host, spec.store_port):
            # one client connection to the long-lived store, reused by every generation
            self._store = dist.TCPStore(spec.store_host, spec.store_port, is_master=False, timeout=timeout,
                                        wait_for_workers=False)
            self._store_addr = (spec.store_host, spec.store_port)
        prefixed = dist.PrefixStore(f"nereus/gen{spec.generation}/", self._store)
        try:
            dist.init_process_group(backend_for(self.device), store=prefixed, rank=rank,
                                    world_size=len(spec.members), timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - any rendezvous failure means this generation is dead
            self.broken_reason = f"join generation {spec.generation}: {exc}"
            raise ChannelBroken(self.broken_reason) from exc
        self.spec = spec
        self.broken_reason = None
        self.join_seconds.append(time.perf_counter() - start)

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
            forget_meshes()
        self.spec = None

    def _require(self) -> GenerationSpec:
        if self.broken_reason is not None:
            raise ChannelBroken(f"channel of worker {self.worker_id} is broken: {self.broken_reason}")
        if self.spec is None:
            raise ChannelBroken(f"worker {self.worker_id} has joined no generation")
        return self.spec

    def break_(self, reason: str) -> None:
        """Declare the generation broken: destroy the group so that peers fail fast too."""
        self.broken_reason = reason
        try:
            self.leave()
        except Exception:  # noqa: BLE001 - tearing down a broken group may fail again; it is gone anyway
            self.spec = None

    def start(self, ops: list[P2POp]) -> InFlight:
        """Post sends and receives (one batch_isend_irecv) without waiting: the caller overlaps work."""
        spec = self._require()
        if not ops:
            return InFlight(channel=self, works=[], generation=spec.generation)
        try:
            p2p = [dist.P2POp(dist.isend if op.is_send else dist.irecv, op.tensor, spec.rank_of(op.peer))
                   for op in ops]
            works = dist.batch_isend_irecv(p2p)
        except Exception as exc:  # noqa: BLE001 - peer death, transport error: all break the group
            self.break_(f"p2p in generation {spec.generation}: {exc}")
            raise ChannelBroken(self.broken_reason or "p2p failed") from exc
        return InFlight(channel=self, works=list(works), generation=spec.generation)

    def exchange(self, ops: list[P2POp], timeout_s: float | None = None) -> None:
        """Run sends and receives concurrently and wait for all, bounded."""
        self.start(ops).wait(timeout_s)

    def new_group(self, workers: tuple[int, ...]) -> Any:
        """A process group of ``workers`` (for broadcasts among them). Collective over the WHOLE
        generation: every member calls it, in the same order, with the same workers."""
        spec = self._require()
        try:
            return dist.new_group([spec.rank_of(w) for w in workers], timeout=timedelta(seconds=spec.timeout_s))
        except ChannelBroken:
            raise
        except Exception as exc:  # noqa: BLE001 - a member missing or gone: the generation is broken
            self.break_(f"new group in generation {spec.generation}: {exc}")
            raise ChannelBroken(self.broken_reason or "new group failed") from exc

    def destroy_group(self, group: Any) -> None:
        if self.ready and dist.is_initialized():
            with contextlib.suppress(Exception):  # a broken group may fail to tear down: it is gone anyway
                dist.destroy_process_group(group)

    def broadcast(self, tensor: torch.Tensor, src_worker: int, group_workers: tuple[int, ...] | None = None,
                  timeout_s: float | None = None, group: Any = None) -> None:
        """Broadcast from ``src_worker`` to the whole generation, or to the members of ``group`` (made
        by ``new_group``; ``group_workers`` must then be left out)."""
        spec = self._require()
        if group is None and group_workers is not None and \
                tuple(sorted(group_workers)) != tuple(sorted(spec.members)):
            raise SpecError("group_workers", "a sub-group broadcast needs a group from new_group()")
        try:
            work = dist.broadcast(tensor, spec.rank_of(src_worker), group=group, async_op=True)
            assert work is not None
            work.wait(timedelta(seconds=timeout_s or spec.timeout_s))
        except Exception as exc:  # noqa: BLE001
            self.break_(f"broadcast in generation {spec.generation}: {exc}")
            raise ChannelBroken(self.broken_reason or "broadcast failed") from exc

    def barrier(self, timeout_s: float | None = None) -> None:
        """A bounded barrier over the generation (a one-element all-reduce, so the timeout is honoured)."""
        spec = self._require()
        flag = torch.ones(1, device=self.device)
        try:
            work = dist.all_reduce(flag, async_op=True)
            assert work is not None
            work.wait(timedelta(seconds=timeout_s or spec.timeout_s))
        except Exception as exc:  # noqa: BLE001
            self.break_(f"barrier in generation {spec.generation}: {exc}")
            raise ChannelBroken(self.broken_reason or "barrier failed") from exc
        if int(flag.item()) != len(spec.members):
            raise ChannelBroken(f"barrier saw {int(flag.item())} of {len(spec.members)} members")
