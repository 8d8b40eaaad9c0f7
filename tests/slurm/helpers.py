"""Shared helpers for the Slurm tests: drive a source until an expected event shows up."""

from __future__ import annotations

import time
from collections.abc import Callable

from nereusd.allocation import AllocationEvent, AllocationSource, EventKind


def poll_until(source: AllocationSource, seen: list[AllocationEvent],
               done: Callable[[list[AllocationEvent]], bool], timeout_s: float = 30.0,
               what: str = "events") -> list[AllocationEvent]:
    """Poll ``source`` (appending to ``seen``) until ``done(seen)``; TimeoutError names what was missing."""
    deadline = time.monotonic() + timeout_s
    while not done(seen):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s:.0f} s; saw "
                               f"{[(e.kind.value, e.slurm_job_id, [n.node for n in e.nodes]) for e in seen]}")
        seen.extend(source.poll())
        time.sleep(0.1)  # pacing between polls of a real cluster, not synchronisation
    return seen


def kinds(events: list[AllocationEvent], kind: EventKind) -> list[AllocationEvent]:
    return [e for e in events if e.kind is kind]


def has(kind: EventKind, slurm_job_id: str | None = None, count: int = 1) -> Callable[[list[AllocationEvent]], bool]:
    def check(events: list[AllocationEvent]) -> bool:
        return len([e for e in events if e.kind is kind and (slurm_job_id is None or e.slurm_job_id == slurm_job_id)]) >= count

    return check
