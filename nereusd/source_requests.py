"""The daemon's requests to its allocation source: grow and shrink checked against what a job holds
now, then queued for the source thread (nereusd.source_worker); refusals, at once or from that
thread, stored as ``alloc-refused`` events; drained nodes handed back. A mixin of
``nereusd.daemon.Daemon``, which owns the state it reads (declared below). Never imports torch."""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Any

from nereusd.agent_sessions import TRANSIENT
from nereusd.allocation import AllocationError
from nereusd.controller import JobController
from nereusd.source_worker import _SourceWorker
from nereusd.store import TERMINAL_JOB_STATES, Store


class SourceRequests:
    # the Daemon's state these methods use (set in Daemon.__init__)
    store: Store
    log: Any
    source: Any
    worker: _SourceWorker | None
    controllers: dict[str, JobController]
    leaving: dict[tuple[str, str], str]
    _let_go: Callable[..., None]  # nereusd.agent_sessions.AgentSessions._let_go

    def pending_members(self, job_id: str) -> list[str]:
        """Member jobs asked for that hold no node yet (``nereusctl jobs``)."""
        pending = getattr(self.source, "pending_members", None)
        return list(pending(job_id)) if pending is not None else []

    def source_request(self, op: str, job_id: str, arg: Any) -> None:
        """Check a grow/shrink against what the job holds now, then queue it for the source thread. A
        shrink is graceful: nodes a plan uses are drained first (JobController.drain) and released once the
        transition away from them is done. A refusal raises AllocationError and is stored as an event."""
        try:
            self._source_request(op, job_id, arg)
        except AllocationError as exc:
            self._record_refusal(job_id, op, arg, str(exc))
            raise

    def _record_refusal(self, job_id: str, op: str, arg: Any, reason: str) -> None:
        nodes = list(arg) if isinstance(arg, (list, tuple)) else arg
        self.log.warning("alloc-refused", job=job_id, op=op, nodes=nodes, reason=reason)
        if self.store.job(job_id) is not None:
            self.store.add_event("alloc-refused", {"op": op, "nodes": nodes, "reason": reason}, job_id=job_id)

    def _queue_release(self, job_id: str, nodes: list[str]) -> None:
        """Drained nodes go back to the source, except leaving ones: Slurm takes those itself."""
        ctl = self.controllers.get(job_id)
        for n in [n for n in nodes if self.leaving.get((job_id, n)) == "draining"]:
            if ctl is not None:
                self._let_go(ctl, n, ctl.draining.get(n, "leaving"))
        nodes = [n for n in nodes if self.leaving.get((job_id, n)) != "released"]
        if not nodes:
            return
        if self.worker is None:
            self.log.warning("drained-node-not-released", job=job_id, nodes=nodes, reason="no allocation source")
            return
        self.worker.requests.put(("shrink", (job_id, list(nodes))))

    def _source_request(self, op: str, job_id: str, arg: Any) -> None:
        if self.worker is None or self.source is None:
            raise AllocationError("the daemon runs without an allocation source")
        tracked = {j.job_id: j for j in self.source.jobs()}
        if job_id not in tracked:
            raise AllocationError(f"job {job_id!r} has no elastic allocation (its spec has no 'elastic')")
        row = self.store.job(job_id)
        if row is not None and row["state"] in TERMINAL_JOB_STATES:
            raise AllocationError(f"{op} {job_id}: the job is {row['state']}; nothing to change")
        held = self.source.allocation(job_id).node_names
        free = getattr(self.source, "free_nodes", None)
        free_count = len(free()) if free is not None else None
        if op == "grow":
            asked = self.pending_members(job_id)
            room = tracked[job_id].max_nodes - len(held) - len(asked)
            if arg > room:
                raise AllocationError(f"grow {job_id}: {arg} more node(s) would pass max_gpus="
                                      f"{tracked[job_id].max_gpus} (it holds {len(held)}, {len(asked)} pending, "
                                      f"room for {max(room, 0)})")
            if free_count is not None and arg > free_count:
                raise AllocationError(f"grow {job_id}: {arg} node(s) asked, {free_count} free")
        else:
            unknown = [n for n in arg if n not in held]
            if unknown:
                raise AllocationError(f"shrink {job_id}: it holds no node {', '.join(map(repr, unknown))} "
                                      f"(it holds: {', '.join(held) or 'none'})")
            ctl = self.controllers.get(job_id)
            if ctl is not None:  # the rest drain first and are released by the controller
                arg = ctl.drain(list(arg), "alloc --shrink")
                if not arg:
                    return
        self.worker.requests.put((op, (job_id, arg)))

    def _take_refusals(self, worker: _SourceWorker) -> None:
        """Requests the source refused in its thread: stored as events; refused releases rejoin the pool."""
        while True:
            try:
                op, args, reason = worker.refused.get_nowait()
            except queue.Empty:
                return
            job_id, arg = (args[0], args[1]) if len(args) >= 2 else (str(args[0]) if args else "?", None)
            try:
                self._record_refusal(job_id, op, arg, f"the allocation source refused it: {reason}")
                ctl = self.controllers.get(job_id)
                if ctl is not None and op == "shrink":
                    ctl.on_release_refused(list(arg or ()), reason)
            except TRANSIENT as exc:
                self.log.error("alloc-refusal-not-recorded", job=job_id, error=str(exc))
