"""One table from Slurm job and node states to Nereus' view of them.

A Slurm job is, for an elastic job, either waiting (PENDING), holding usable nodes (RUNNING), or
gone; when it is gone the table says which allocation event explains the loss. Unknown states are
not guessed at: they map to UNKNOWN and the elastic source leaves the job's nodes as they were.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from nereusd.allocation import EventKind


class Phase(str, enum.Enum):
    PENDING = "pending"  # waiting for nodes (also: requeued after losing them)
    RUNNING = "running"  # holds nodes the job can use
    SUSPENDED = "suspended"  # holds nodes but cannot use them (gang/suspend preemption)
    ENDING = "ending"  # finished, epilog still running: nodes no longer usable
    ENDED = "ended"  # terminal: cached by the poller, never asked about again
    UNKNOWN = "unknown"


@dataclass(frozen=True, kw_only=True, slots=True)
class StateMapping:
    phase: Phase
    ended_by: EventKind | None = None  # for a terminal (or node-losing) state: why the nodes went

    @property
    def terminal(self) -> bool:
        return self.phase is Phase.ENDED

    @property
    def holds_usable_nodes(self) -> bool:
        return self.phase is Phase.RUNNING


_E = EventKind
JOB_STATES: dict[str, StateMapping] = {
    "PENDING": StateMapping(phase=Phase.PENDING),
    "CONFIGURING": StateMapping(phase=Phase.PENDING),  # nodes allocated but booting: not usable yet
    "REQUEUED": StateMapping(phase=Phase.PENDING, ended_by=_E.NODE_DOWN),  # lost its nodes, waits again
    "REQUEUE_HOLD": StateMapping(phase=Phase.PENDING, ended_by=_E.NODE_DOWN),
    "REQUEUE_FED": StateMapping(phase=Phase.PENDING, ended_by=_E.NODE_DOWN),
    "RESV_DEL_HOLD": StateMapping(phase=Phase.PENDING),
    "RUNNING": StateMapping(phase=Phase.RUNNING),
    "RESIZING": StateMapping(phase=Phase.RUNNING),  # transient while scontrol update NumNodes applies
    "SIGNALING": StateMapping(phase=Phase.RUNNING),
    "STAGE_OUT": StateMapping(phase=Phase.ENDING),
    "SUSPENDED": StateMapping(phase=Phase.SUSPENDED, ended_by=_E.PREEMPTED),
    "STOPPED": StateMapping(phase=Phase.SUSPENDED, ended_by=_E.PREEMPTED),
    "COMPLETING": StateMapping(phase=Phase.ENDING),
    "COMPLETED": StateMapping(phase=Phase.ENDED, ended_by=_E.COMPLETED),
    "CANCELLED": StateMapping(phase=Phase.ENDED, ended_by=_E.CANCELLED),
    "REVOKED": StateMapping(phase=Phase.ENDED, ended_by=_E.CANCELLED),  # federation: ran elsewhere
    "PREEMPTED": StateMapping(phase=Phase.ENDED, ended_by=_E.PREEMPTED),
    "TIMEOUT": StateMapping(phase=Phase.ENDED, ended_by=_E.TIME_LIMIT),
    "DEADLINE": StateMapping(phase=Phase.ENDED, ended_by=_E.TIME_LIMIT),
    "NODE_FAIL": StateMapping(phase=Phase.ENDED, ended_by=_E.NODE_DOWN),
    "BOOT_FAIL": StateMapping(phase=Phase.ENDED, ended_by=_E.NODE_DOWN),
    "FAILED": StateMapping(phase=Phase.ENDED, ended_by=_E.FAILED),
    "OUT_OF_MEMORY": StateMapping(phase=Phase.ENDED, ended_by=_E.FAILED),
    "SPECIAL_EXIT": StateMapping(phase=Phase.ENDED, ended_by=_E.FAILED),
}
UNKNOWN_STATE = StateMapping(phase=Phase.UNKNOWN)


def map_job_state(raw: str) -> StateMapping:
    """Map a Slurm job state (``RUNNING``, ``CANCELLED by 0``, ``NODE_FAIL``) to ours."""
    word = raw.strip().split(" ", 1)[0].upper() if raw else ""
    return JOB_STATES.get(word, UNKNOWN_STATE)


# Node states (sinfo --json "state", lower case) in which a node's GPUs are gone for good. DRAIN and
# DRAINING are not here: running jobs keep their nodes until they end.
# FAILING and NOT_RESPONDING are not either: the first still runs jobs, the second is often a slurmd
# restart, and Slurm itself marks the node DOWN after SlurmdTimeout.
LOST_NODE_STATES = frozenset({"down", "fail", "future", "power_down", "powered_down"})
LOST_NODE_FLAGS = frozenset({"POWERED_DOWN", "POWERING_DOWN", "REBOOT_ISSUED"})


def node_lost(state: str, flags: tuple[str, ...] | list[str] = ()) -> bool:
    """True if a node in this state no longer serves the jobs on it."""
    base = state.strip().lower().split("+", 1)[0].rstrip("*~#!%$@^-")
    return base in LOST_NODE_STATES or any(f.upper() in LOST_NODE_FLAGS for f in flags)
