"""Allocation sources: where an elastic job's nodes and GPUs come from, as one interface.

The per-job controller does not care whether GPUs come from Slurm or from local worker processes.
It talks to an ``AllocationSource``:

- passive: ``poll()`` returns the ``AllocationEvent``s seen since the last poll (a member job started,
  a node went DOWN, Slurm cancelled or preempted something) and ``allocation(job_id)`` the current view;
- active: ``grow(job_id, n_nodes)`` asks for more nodes (granted later, reported by ``poll()`` as
  GROWN), ``shrink(job_id, nodes)`` gives named nodes back, ``release(job_id)`` gives everything back.

An elastic job is an anchor job plus member jobs (Slurm 22.05 cannot grow a running job that holds
GPUs, so growth is always new member jobs). Everything here is frozen data and pure; the sources live
in nereusd/slurm/ (real Slurm) and nereusd/local_source.py (the embedded default).

    from nereusd.allocation import AllocationSource, ElasticJob
    source.track(ElasticJob(job_id="grpo-8b", anchor_job_id="1042", min_gpus=8, max_gpus=32,
                            gpus_per_node=8, slurm_user="alice"))
    for event in source.poll(): ...
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

from planner.errors import NereusError, SpecError


class AllocationError(NereusError):
    """An active request (grow, shrink, release) cannot be carried out; the message says why."""


class EventKind(str, enum.Enum):
    """What happened to a job's allocation. The first group the daemon asked for; the rest Slurm took."""

    GRANTED = "granted"  # the anchor started: the job's first nodes
    GROWN = "grown"  # a member job started: nodes added
    SHRUNK = "shrunk"  # nodes given back on our request (member scancelled or NumNodes lowered)
    RELEASED = "released"  # the whole job given back on our request
    REQUESTED = "requested"  # a member job was submitted (pending; GROWN follows when it starts)
    REQUEST_FAILED = "request_failed"  # a member submission or a shrink command failed
    # taken by Slurm or by people, not asked for by the daemon:
    NODE_DOWN = "node_down"  # a node of the job went DOWN/DRAIN/FAIL; its GPUs are gone
    PREEMPTED = "preempted"
    CANCELLED = "cancelled"  # scancel by someone else (user, admin)
    TIME_LIMIT = "time_limit"
    FAILED = "failed"  # the Slurm job failed (non-zero exit, NODE_FAIL, OUT_OF_MEMORY, ...)
    COMPLETED = "completed"  # the Slurm job ended on its own

    @property
    def urgent(self) -> bool:
        """True when GPUs were lost without notice: the controller must replan at once."""
        return self in _URGENT


_URGENT = frozenset({EventKind.NODE_DOWN, EventKind.PREEMPTED, EventKind.CANCELLED,
                     EventKind.TIME_LIMIT, EventKind.FAILED})


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeAllocation:
    """One node of a job: its name, the device indices the job holds there, and the job holding it.

    ``gpu_indices`` are the node-local device indices (CUDA_VISIBLE_DEVICES for Slurm GRES; CPU worker
    slots for the local source). ``holder_job_id`` is the Slurm job (anchor or member) or the local
    group that owns the node, so that releasing the node knows what to cancel or shrink.
    """

    node: str
    gpu_indices: tuple[int, ...]
    holder_job_id: str

    def __post_init__(self) -> None:
        if not self.node:
            raise SpecError("node_allocation.node", "must be a non-empty node name")
        if not self.holder_job_id:
            raise SpecError("node_allocation.holder_job_id", "must name the job holding the node")
        if any(i < 0 for i in self.gpu_indices) or len(set(self.gpu_indices)) != len(self.gpu_indices):
            raise SpecError("node_allocation.gpu_indices",
                            f"must be distinct non-negative indices, got {self.gpu_indices}")

    @property
    def num_gpus(self) -> int:
        return len(self.gpu_indices)

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "gpu_indices": list(self.gpu_indices), "holder_job_id": self.holder_job_id}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NodeAllocation:
        return cls(node=data["node"], gpu_indices=tuple(data["gpu_indices"]),
                   holder_job_id=str(data["holder_job_id"]))


@dataclass(frozen=True, kw_only=True, slots=True)
class Allocation:
    """The nodes a job holds right now (in a stable order: anchor nodes first, then members)."""

    job_id: str
    nodes: tuple[NodeAllocation, ...] = ()

    def __post_init__(self) -> None:
        names = [n.node for n in self.nodes]
        if len(set(names)) != len(names):
            raise SpecError("allocation.nodes", f"a node appears twice: {names}")

    @property
    def num_gpus(self) -> int:
        return sum(n.num_gpus for n in self.nodes)

    @property
    def node_names(self) -> tuple[str, ...]:
        return tuple(n.node for n in self.nodes)

    def node(self, name: str) -> NodeAllocation:
        for n in self.nodes:
            if n.node == name:
                return n
        raise AllocationError(f"job {self.job_id} holds no node {name!r} (holds {list(self.node_names)})")

    def without(self, names: Sequence[str]) -> Allocation:
        drop = set(names)
        return replace(self, nodes=tuple(n for n in self.nodes if n.node not in drop))

    def with_nodes(self, added: Sequence[NodeAllocation]) -> Allocation:
        have = set(self.node_names)
        return replace(self, nodes=self.nodes + tuple(n for n in added if n.node not in have))

    def to_dict(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "nodes": [n.to_dict() for n in self.nodes]}


@dataclass(frozen=True, kw_only=True, slots=True)
class AllocationEvent:
    """One change of a job's allocation. ``nodes`` are the nodes added or lost (empty if none)."""

    kind: EventKind
    job_id: str  # the Nereus elastic job
    slurm_job_id: str | None  # the Slurm job (anchor or member) it concerns; None for the local source
    nodes: tuple[NodeAllocation, ...] = ()
    reason: str = ""
    time_s: float  # Unix time at which the source noticed it

    def __post_init__(self) -> None:
        if not isinstance(self.kind, EventKind):
            raise SpecError("allocation_event.kind", f"got {self.kind!r}",
                            ", ".join(k.value for k in EventKind))
        if not self.job_id:
            raise SpecError("allocation_event.job_id", "must name the elastic job")

    @property
    def num_gpus(self) -> int:
        return sum(n.num_gpus for n in self.nodes)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "job_id": self.job_id, "slurm_job_id": self.slurm_job_id,
                "nodes": [n.to_dict() for n in self.nodes], "reason": self.reason, "time_s": self.time_s}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AllocationEvent:
        return cls(kind=EventKind(data["kind"]), job_id=data["job_id"], slurm_job_id=data.get("slurm_job_id"),
                   nodes=tuple(NodeAllocation.from_dict(n) for n in data.get("nodes", ())),
                   reason=data.get("reason", ""), time_s=float(data["time_s"]))


@dataclass(frozen=True, kw_only=True, slots=True)
class ElasticJob:
    """An elastic job: an anchor Slurm job plus member jobs, between ``min_gpus`` and ``max_gpus``.

    ``job_id`` is Nereus' name for the job (agents register with it). For the local source
    ``anchor_job_id`` names the first local node group. ``slurm_user`` is the owner: only that user's
    agents may act on the job.
    """

    job_id: str
    anchor_job_id: str
    min_gpus: int
    max_gpus: int
    gpus_per_node: int
    slurm_user: str
    member_job_ids: tuple[str, ...] = ()
    partition: str | None = None
    submitted_at_s: float | None = None  # anchor's submit time, to tell a reused job id apart
    extra: dict[str, str] = field(default_factory=dict, compare=False)  # e.g. account, qos

    def __post_init__(self) -> None:
        if not self.job_id:
            raise SpecError("elastic_job.job_id", "must be a non-empty name")
        if not self.anchor_job_id:
            raise SpecError("elastic_job.anchor_job_id", "must name the anchor job")
        if self.gpus_per_node < 1:
            raise SpecError("elastic_job.gpus_per_node", f"must be >= 1, got {self.gpus_per_node}")
        if self.min_gpus < 1 or self.max_gpus < self.min_gpus:
            raise SpecError("elastic_job.min_gpus/max_gpus",
                            f"need 1 <= min_gpus <= max_gpus, got {self.min_gpus}..{self.max_gpus}")
        if not self.slurm_user:
            raise SpecError("elastic_job.slurm_user", "must name the job's owner")
        if self.anchor_job_id in self.member_job_ids:
            raise SpecError("elastic_job.member_job_ids", "must not contain the anchor job")

    @property
    def max_nodes(self) -> int:
        return self.max_gpus // self.gpus_per_node

    @property
    def slurm_job_ids(self) -> tuple[str, ...]:
        return (self.anchor_job_id, *self.member_job_ids)

    def with_member(self, member_job_id: str) -> ElasticJob:
        return replace(self, member_job_ids=(*self.member_job_ids, member_job_id))

    def without_member(self, member_job_id: str) -> ElasticJob:
        return replace(self, member_job_ids=tuple(m for m in self.member_job_ids if m != member_job_id))

    def to_dict(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "anchor_job_id": self.anchor_job_id, "min_gpus": self.min_gpus,
                "max_gpus": self.max_gpus, "gpus_per_node": self.gpus_per_node,
                "slurm_user": self.slurm_user, "member_job_ids": list(self.member_job_ids),
                "partition": self.partition, "submitted_at_s": self.submitted_at_s, "extra": dict(self.extra)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ElasticJob:
        return cls(job_id=data["job_id"], anchor_job_id=str(data["anchor_job_id"]),
                   min_gpus=int(data["min_gpus"]), max_gpus=int(data["max_gpus"]),
                   gpus_per_node=int(data["gpus_per_node"]), slurm_user=data["slurm_user"],
                   member_job_ids=tuple(str(m) for m in data.get("member_job_ids", ())),
                   partition=data.get("partition"), submitted_at_s=data.get("submitted_at_s"),
                   extra=dict(data.get("extra", {})))


@runtime_checkable
class AllocationSource(Protocol):
    """What a per-job controller needs from the world that hands out GPUs.

    ``poll`` never raises for an outside failure (a failing Slurm command is logged and retried with
    back-off); ``grow``/``shrink``/``release`` raise ``AllocationError`` for requests that cannot be
    valid (unknown job, node not held, beyond max_gpus) and report command failures as
    REQUEST_FAILED events from the next ``poll``.
    """

    name: str  # "slurm" or "local"

    def track(self, job: ElasticJob, allocation: Allocation | None = None) -> None:
        """Start following ``job`` (idempotent). A restarted daemon passes the stored ``allocation`` so
        that only real changes since then become events."""

    def untrack(self, job_id: str) -> None:
        """Stop following the job (nothing is cancelled)."""

    def jobs(self) -> tuple[ElasticJob, ...]:
        """The tracked jobs, with their current member job ids."""

    def poll(self) -> list[AllocationEvent]:
        """Passive sync: the events seen since the last call, oldest first."""

    def allocation(self, job_id: str) -> Allocation:
        """The nodes the job holds now, as of the last poll."""

    def grow(self, job_id: str, n_nodes: int) -> tuple[str, ...]:
        """Ask for ``n_nodes`` more nodes; returns the ids of the requests (e.g. member Slurm jobs)."""

    def shrink(self, job_id: str, nodes: Sequence[str]) -> None:
        """Give the named nodes back."""

    def release(self, job_id: str) -> None:
        """Give everything back (end of job); the job stays tracked until its jobs have ended."""
