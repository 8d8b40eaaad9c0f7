"""The local allocation source (the embedded default, no Slurm): nodes are groups of local processes.

The machine is cut into ``num_nodes`` virtual nodes (``local0``, ``local1`` ...) of ``slots_per_node``
CPU worker slots each. A tracked job is granted ceil(min_gpus / gpus_per_node) nodes at once unless a
schedule says otherwise; ``grow``/``shrink``/``release`` (what ``nereusctl alloc`` asks the daemon
for) act at once and report on the next ``poll()``. A schedule file (TOML or JSON, validated) plays
allocation changes at given times, including the ones Slurm would impose:

    [[step]]
    at_s = 0.0          # seconds after the source started
    job = "demo"
    action = "grant"    # grant | grow | shrink | node_down | preempt | release
    nodes = 2           # how many nodes (grant, grow, shrink, preempt) ...
    # names = ["local1"]  ... or which ones (shrink, node_down)

With ``agent_argv`` set, each granted node starts one process group (the node agent, which starts
one worker per slot; ``agent_argv`` returning None starts none) and each lost node's group is stopped
(SIGTERM, then SIGKILL), as all of them are by ``close()`` and at interpreter exit. A ``preempt`` of
a node whose agent runs here plays Slurm's notice: SIGTERM to the agent (it drains its node and
exits), and the node is taken (PREEMPTED, its process group stopped) once the agent exited or
``kill_wait_s`` (Slurm's KillWait) passed, whichever comes first. Their output
goes to ``log_dir``/JOB.NODE.log. An ``agent_argv`` with a ``check(job)`` method is asked before a
job is tracked, so a job whose agents cannot start is refused.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nereusd.allocation import (
    Allocation,
    AllocationError,
    AllocationEvent,
    ElasticJob,
    EventKind,
    NodeAllocation,
)
from nereusd.wire.logs import get_logger
from planner.errors import SpecError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 (pydantic-settings brings tomli there)
    import tomli as tomllib

ACTIONS = ("grant", "grow", "shrink", "node_down", "preempt", "release")
_KIND = {"grant": EventKind.GRANTED, "grow": EventKind.GROWN, "shrink": EventKind.SHRUNK,
         "node_down": EventKind.NODE_DOWN, "preempt": EventKind.PREEMPTED, "release": EventKind.RELEASED}
AgentArgv = Callable[[ElasticJob, NodeAllocation], Sequence[str] | None]


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleStep:
    at_s: float
    job: str
    action: str
    nodes: int | None = None
    names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        where = f"schedule.step[{self.job}@{self.at_s}]"
        if self.at_s < 0:
            raise SpecError(f"{where}.at_s", f"must be >= 0, got {self.at_s}")
        if not self.job:
            raise SpecError(f"{where}.job", "must name a job")
        if self.action not in ACTIONS:
            raise SpecError(f"{where}.action", f"got {self.action!r}", ", ".join(ACTIONS))
        if self.nodes is not None and self.nodes < 1:
            raise SpecError(f"{where}.nodes", f"must be >= 1, got {self.nodes}")
        if self.nodes is not None and self.names:
            raise SpecError(where, "give either nodes (a count) or names, not both")
        needs_count = self.action in ("grant", "grow", "preempt")
        if needs_count and self.nodes is None:
            raise SpecError(f"{where}.nodes", f"action {self.action!r} needs a node count")
        if self.action in ("shrink", "node_down") and self.nodes is None and not self.names:
            raise SpecError(f"{where}.names", f"action {self.action!r} needs nodes (a count) or names")


def load_schedule(path: str | os.PathLike[str]) -> tuple[ScheduleStep, ...]:
    """Read a schedule file (.toml or .json: a list of steps under ``step``), sorted by time."""
    p = Path(path)
    try:
        data: Any = tomllib.loads(p.read_text()) if p.suffix == ".toml" else json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise SpecError("schedule", f"cannot read {p}: {exc}") from None
    steps = data.get("step") if isinstance(data, dict) else None
    if not isinstance(steps, list):
        raise SpecError("schedule", f"{p} needs a list of steps under 'step' ([[step]] in TOML)")
    out = []
    allowed = {"at_s", "job", "action", "nodes", "names"}
    for i, raw in enumerate(steps):
        if not isinstance(raw, dict) or set(raw) - allowed:
            raise SpecError(f"schedule.step[{i}]", f"unknown keys {sorted(set(raw) - allowed)}"
                            if isinstance(raw, dict) else "must be a table", ", ".join(sorted(allowed)))
        try:
            out.append(ScheduleStep(at_s=float(raw.get("at_s", 0.0)), job=str(raw.get("job", "")),
                                    action=str(raw.get("action", "")), nodes=raw.get("nodes"),
                                    names=tuple(raw.get("names", ()))))
        except (TypeError, ValueError) as exc:
            raise SpecError(f"schedule.step[{i}]", str(exc)) from None
    return tuple(sorted(out, key=lambda s: s.at_s))


@dataclass(kw_only=True, slots=True)
class _Tracked:
    job: ElasticJob
    allocation: Allocation
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    preempting: dict[str, tuple[float, str]] = field(default_factory=dict)  # node -> (taken at, reason)


def _locked(method: Callable[..., Any]) -> Callable[..., Any]:
    """The daemon calls track/grow/... from its serve loop while its source thread polls."""

    @functools.wraps(method)
    def call(self: LocalSource, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return call


class LocalSource:
    name = "local"

    def __init__(self, *, num_nodes: int = 4, slots_per_node: int = 8,
                 schedule: Sequence[ScheduleStep] = (), agent_argv: AgentArgv | None = None,
                 log_dir: Path | None = None, kill_wait_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        if num_nodes < 1:
            raise SpecError("local.num_nodes", f"must be >= 1, got {num_nodes}")
        if slots_per_node < 1:
            raise SpecError("local.slots_per_node", f"must be >= 1, got {slots_per_node}")
        self.nodes = tuple(f"local{i}" for i in range(num_nodes))
        self.slots_per_node = slots_per_node
        self.schedule = list(schedule)
        self.agent_argv = agent_argv
        self.log_dir = log_dir
        self.kill_wait_s = kill_wait_s
        self.clock, self.wall = clock, wall
        self.started = clock()
        self._jobs: dict[str, _Tracked] = {}
        self._events: list[AllocationEvent] = []
        self._lock = threading.RLock()
        self.log = get_logger("local-source")
        if agent_argv is not None:  # the daemon's exit (SIGTERM included) takes its node processes with it
            atexit.register(self.close)

    # --- tracking ---------------------------------------------------------------------------------
    @_locked
    def track(self, job: ElasticJob, allocation: Allocation | None = None) -> None:
        """Follow ``job``; with no ``allocation`` (a new job) grant its minimum now. A restarted daemon
        passes the allocation it stored, so nothing is granted twice and grown nodes stay. A job this
        machine can never hold is refused (AllocationError) before anything is tracked."""
        if job.job_id in self._jobs:
            return
        if job.gpus_per_node > self.slots_per_node:
            raise AllocationError(f"job {job.job_id} wants {job.gpus_per_node} devices per node; local nodes "
                                  f"have {self.slots_per_node} slots")
        need = -(-job.min_gpus // job.gpus_per_node)
        grant = allocation is None and not any(s.job == job.job_id for s in self.schedule)
        if need > job.max_nodes:
            raise AllocationError(f"job {job.job_id}: min_gpus={job.min_gpus} needs {need} nodes of "
                                  f"{job.gpus_per_node}, max_gpus={job.max_gpus} allows {job.max_nodes}")
        if grant and need > len(self.free_nodes()):
            raise AllocationError(f"job {job.job_id}: min_gpus={job.min_gpus} needs {need} local nodes, "
                                  f"{len(self.free_nodes())} of {len(self.nodes)} are free")
        check = getattr(self.agent_argv, "check", None)
        if check is not None:
            check(job)  # e.g. no agent keys: refused before anything is tracked or started
        if allocation is not None:
            taken = set(allocation.node_names) - set(self.free_nodes())
            if taken or not set(allocation.node_names) <= set(self.nodes):
                self.log.warning("restored_allocation_conflict", job_id=job.job_id, nodes=sorted(taken))
                allocation = allocation.without(sorted(taken | (set(allocation.node_names) - set(self.nodes))))
        self._jobs[job.job_id] = tracked = _Tracked(job=job, allocation=allocation or Allocation(job_id=job.job_id))
        try:
            if grant:
                self._add(tracked, need, EventKind.GRANTED, "granted on track")
            for node in tracked.allocation.nodes:  # restored allocation: make sure its processes run
                self._start_agent(tracked, node)
        except BaseException:  # an agent that cannot start: nothing of the job stays
            self.untrack(job.job_id)
            self._events = [e for e in self._events if e.job_id != job.job_id]
            raise

    @_locked
    def untrack(self, job_id: str) -> None:
        tracked = self._jobs.pop(job_id, None)
        if tracked is not None:
            for node in list(tracked.procs):
                self._stop_agent(tracked, node)

    @_locked
    def jobs(self) -> tuple[ElasticJob, ...]:
        return tuple(t.job for t in self._jobs.values())

    @_locked
    def allocation(self, job_id: str) -> Allocation:
        return self._get(job_id).allocation

    @_locked
    def free_nodes(self) -> tuple[str, ...]:
        held = {n for t in self._jobs.values() for n in t.allocation.node_names}
        return tuple(n for n in self.nodes if n not in held)

    def _get(self, job_id: str) -> _Tracked:
        if job_id not in self._jobs:
            raise AllocationError(f"job {job_id!r} is not tracked (tracked: {sorted(self._jobs)})")
        return self._jobs[job_id]

    # --- changes ----------------------------------------------------------------------------------
    def _emit(self, kind: EventKind, tracked: _Tracked, nodes: Sequence[NodeAllocation], reason: str) -> None:
        self._events.append(AllocationEvent(kind=kind, job_id=tracked.job.job_id, slurm_job_id=None,
                                            nodes=tuple(nodes), reason=reason, time_s=self.wall()))
        self.log.info("allocation_event", kind=kind.value, job_id=tracked.job.job_id,
                      nodes=[n.node for n in nodes], reason=reason)

    def _add(self, tracked: _Tracked, count: int, kind: EventKind, reason: str) -> tuple[str, ...]:
        room = tracked.job.max_nodes - len(tracked.allocation.nodes)
        free = self.free_nodes()
        if count > min(room, len(free)):
            raise AllocationError(f"{tracked.job.job_id}: cannot add {count} nodes ({len(free)} free, room for "
                                  f"{room} under max_gpus={tracked.job.max_gpus})")
        slots = tuple(range(tracked.job.gpus_per_node))
        added = [NodeAllocation(node=n, gpu_indices=slots, holder_job_id=f"{tracked.job.job_id}/{n}")
                 for n in free[:count]]
        tracked.allocation = tracked.allocation.with_nodes(added)
        for node in added:
            self._start_agent(tracked, node)
        self._emit(kind, tracked, added, reason)
        return tuple(n.holder_job_id for n in added)

    def _remove(self, tracked: _Tracked, names: Sequence[str], kind: EventKind, reason: str) -> None:
        gone = [tracked.allocation.node(n) for n in names]  # raises for a node not held
        tracked.allocation = tracked.allocation.without(names)
        for n in names:
            tracked.preempting.pop(n, None)
        for node in gone:
            self._stop_agent(tracked, node.node)
        self._emit(kind, tracked, gone, reason)

    @_locked
    def grow(self, job_id: str, n_nodes: int) -> tuple[str, ...]:
        if n_nodes < 1:
            raise AllocationError(f"grow {job_id}: n_nodes must be >= 1, got {n_nodes}")
        return self._add(self._get(job_id), n_nodes, EventKind.GROWN, "grown on request")

    @_locked
    def shrink(self, job_id: str, nodes: Sequence[str], reason: str = "released by Nereus") -> None:
        self._remove(self._get(job_id), list(nodes), EventKind.SHRUNK, reason)

    @_locked
    def release(self, job_id: str) -> None:
        tracked = self._get(job_id)
        self._remove(tracked, list(tracked.allocation.node_names), EventKind.RELEASED, "job released")

    # --- passive sync -----------------------------------------------------------------------------
    @_locked
    def poll(self) -> list[AllocationEvent]:
        elapsed = self.clock() - self.started
        while self.schedule and self.schedule[0].at_s <= elapsed:
            self._play(self.schedule.pop(0))
        for tracked in self._jobs.values():  # an agent that died took its node with it
            for node, (taken_at, why) in list(tracked.preempting.items()):
                if self.clock() >= taken_at:
                    self._remove(tracked, [node], EventKind.PREEMPTED, f"{why}: KillWait {self.kill_wait_s:g} s over")
            for node, proc in list(tracked.procs.items()):
                if proc.poll() is not None and node in tracked.allocation.node_names:
                    tracked.procs.pop(node)
                    if node in tracked.preempting:  # it left after the notice, as asked
                        self._remove(tracked, [node], EventKind.PREEMPTED,
                                     f"{tracked.preempting[node][1]}: agent left (exit {proc.returncode})")
                    else:
                        self._remove(tracked, [node], EventKind.NODE_DOWN,
                                     f"agent on {node} exited {proc.returncode}")
        events, self._events = self._events, []
        return events

    def _play(self, step: ScheduleStep) -> None:
        tracked = self._jobs.get(step.job)
        if tracked is None:
            self.log.warning("schedule_step_for_untracked_job", job=step.job, action=step.action)
            return
        kind = _KIND[step.action]
        reason = f"schedule at {step.at_s:g} s"
        try:
            if step.action in ("grant", "grow"):
                self._add(tracked, step.nodes or 0, kind, reason)
            elif step.action == "preempt":
                self._preempt(tracked, list(step.names) or list(tracked.allocation.node_names[-(step.nodes or 0):]),
                              reason)
            elif step.action == "release":
                self._remove(tracked, list(tracked.allocation.node_names), kind, reason)
            else:  # shrink, node_down: named nodes, or the last ``nodes`` nodes
                names = list(step.names) or list(tracked.allocation.node_names[-(step.nodes or 0):])
                self._remove(tracked, names, kind, reason)
        except AllocationError as exc:
            self._emit(EventKind.REQUEST_FAILED, tracked, (), f"{reason}: {exc}")

    def _preempt(self, tracked: _Tracked, names: Sequence[str], reason: str) -> None:
        """Slurm's way: SIGTERM to the agents now (the agent only: it stops its workers once its node is
        drained), the nodes taken when their agent exited or after ``kill_wait_s``."""
        for n in names:
            tracked.allocation.node(n)  # raises for a node not held
        noticed = [n for n in names if (p := tracked.procs.get(n)) is not None and p.poll() is None]
        for n in noticed:
            try:
                os.kill(tracked.procs[n].pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            tracked.preempting[n] = (self.clock() + self.kill_wait_s, reason)
            self.log.info("preemption_notice", job_id=tracked.job.job_id, node=n, kill_wait_s=self.kill_wait_s)
        rest = [n for n in names if n not in tracked.preempting]
        if rest:
            self._remove(tracked, rest, EventKind.PREEMPTED, reason)

    # --- node processes ---------------------------------------------------------------------------
    def _start_agent(self, tracked: _Tracked, node: NodeAllocation) -> None:
        if self.agent_argv is None or node.node in tracked.procs:
            return
        argv = self.agent_argv(tracked.job, node)
        if not argv:
            return
        out: Any = None  # the daemon's own output
        try:
            if self.log_dir is not None:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                out = open(self.log_dir / f"{tracked.job.job_id}.{node.node}.log", "ab")  # noqa: SIM115
            proc = subprocess.Popen(list(argv), start_new_session=True, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT if out is not None else None)
        except OSError as exc:
            raise AllocationError(f"job {tracked.job.job_id}: cannot start the agent of {node.node} "
                                  f"({argv[0]}): {exc}") from None
        finally:
            if out is not None:
                out.close()  # the child holds its own copy
        tracked.procs[node.node] = proc
        self.log.info("agent_started", job_id=tracked.job.job_id, node=node.node, pid=proc.pid)

    def _stop_agent(self, tracked: _Tracked, node: str, timeout_s: float = 5.0) -> None:
        """The node goes now: SIGTERM to its process group, a second SIGTERM to the agent (its first one
        would start a graceful leave, the second stops it at once), SIGKILL after ``timeout_s``."""
        proc = tracked.procs.pop(node, None)
        if proc is None or proc.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, 0.5), (None, timeout_s), (signal.SIGKILL, timeout_s)):
            try:
                if sig is None:
                    os.kill(proc.pid, signal.SIGTERM)
                else:
                    os.killpg(proc.pid, sig)  # the agent and the workers it started
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue

    @_locked
    def close(self) -> None:
        """Stop every node process this source started."""
        for tracked in self._jobs.values():
            for node in list(tracked.procs):
                self._stop_agent(tracked, node)
