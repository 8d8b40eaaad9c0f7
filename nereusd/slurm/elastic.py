"""The Slurm allocation source: elastic jobs as an anchor Slurm job plus one-node member jobs.

Passive: each ``poll()`` refreshes the batched poller (when due) and turns what changed into
``AllocationEvent``s: the anchor starting (GRANTED), a member starting (GROWN), nodes we gave back
(SHRUNK, RELEASED) and what Slurm took (NODE_DOWN from sinfo or NODE_FAIL, PREEMPTED, CANCELLED,
TIME_LIMIT, FAILED). Active: ``grow`` submits member jobs through submitit, throttled to
``max_submissions_per_minute`` (the rest go out on later polls); ``shrink`` cancels whole members or
shrinks a job in place with ``scontrol update JobId=X NodeList=...``; ``release`` cancels everything.
Never grows a job by Slurm job expansion (fails for GRES jobs in 22.05).

    source = SlurmSource(SlurmCommands(), launch_spec=lambda job: LaunchSpec(...))
    source.track(job)
    events = source.poll()
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from nereusd.allocation import (
    Allocation,
    AllocationError,
    AllocationEvent,
    ElasticJob,
    EventKind,
    NodeAllocation,
)
from nereusd.slurm.commands import SlurmCommands
from nereusd.slurm.hostlist import compress
from nereusd.slurm.poller import SlurmJobInfo, SlurmPoller
from nereusd.slurm.states import Phase
from nereusd.slurm.submit import LaunchSpec, SubmitError, SubmititLauncher, SubmittedJob, job_comment
from nereusd.wire.logs import get_logger
from planner.errors import SpecError

SubmitMember = Callable[[ElasticJob], SubmittedJob]
ENDING_GRACE_S = 30.0  # how long a COMPLETING job may keep its nodes before they count as lost anyway


@dataclass(kw_only=True, slots=True)
class _Tracked:
    job: ElasticJob
    allocation: Allocation
    pending_grow_nodes: int = 0  # asked for, not yet submitted (throttle)
    shrinking: dict[str, str] = field(default_factory=dict)  # node -> why we gave it back
    cancelling: set[str] = field(default_factory=set)  # Slurm jobs we scancelled
    released: bool = False
    forgotten: set[str] = field(default_factory=set)  # ended members, never re-adopted
    started: set[str] = field(default_factory=set)  # Slurm jobs seen holding nodes
    ending_since: dict[str, float] = field(default_factory=dict)  # Slurm job -> clock() it began COMPLETING
    anchor_end_reported: bool = False

    def requested_members(self, poller: SlurmPoller) -> int:
        count = 0
        for member in self.job.member_job_ids:
            info = poller.info(member)
            if info is None or info.mapping.phase is Phase.PENDING:
                count += 1
        anchor = poller.info(self.job.anchor_job_id)
        if anchor is not None and anchor.mapping.phase is Phase.PENDING and not anchor.nodes:
            # a requeued anchor comes back on nodes of its own: a member grown meanwhile would exceed the
            # maximum and may land on the node the anchor gets again (two agents of the job on one node)
            count += -(-self.job.min_gpus // self.job.gpus_per_node)
        return count


class SlurmSource:
    name = "slurm"

    def __init__(self, commands: SlurmCommands, poller: SlurmPoller | None = None, *,
                 launch_spec: Callable[[ElasticJob], LaunchSpec] | None = None,
                 submit_member: SubmitMember | None = None, max_submissions_per_minute: int = 30,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        if max_submissions_per_minute < 1:
            raise SpecError("slurm.max_member_submissions_per_minute",
                            f"must be >= 1, got {max_submissions_per_minute}")
        self.commands = commands
        self.poller = poller or SlurmPoller(commands)
        self.clock, self.wall = clock, wall
        self.max_submissions_per_minute = max_submissions_per_minute
        if submit_member is None:
            if launch_spec is None:
                raise SpecError("slurm_source.launch_spec", "needed to submit member jobs (or pass submit_member)")
            spec_of = launch_spec

            def submit_member(job: ElasticJob) -> SubmittedJob:
                spec = spec_of(job)
                held = [n.node for n in self._jobs[job.job_id].allocation.nodes] if job.job_id in self._jobs else []
                if held:  # one agent per node and job: a member never lands on a node the job holds
                    spec = replace(spec, extra_sbatch={**spec.extra_sbatch, "exclude": compress(held)})
                return SubmititLauncher(spec, env=commands.env).submit("member", 1)
        self._submit_member = submit_member
        self._jobs: dict[str, _Tracked] = {}
        self._events: list[AllocationEvent] = []
        self._submissions: deque[float] = deque()  # clock() of recent submissions (global throttle)
        self.log = get_logger("slurm-source")

    # --- tracking ---------------------------------------------------------------------------------
    def track(self, job: ElasticJob, allocation: Allocation | None = None) -> None:
        tracked = self._jobs.get(job.job_id)
        if tracked is None:
            for holder in dict.fromkeys(n.holder_job_id for n in (allocation.nodes if allocation else ())):
                if holder and holder not in job.slurm_job_ids:  # a member the daemon grew (stored, not in the spec)
                    job = job.with_member(holder)
            tracked = _Tracked(job=job, allocation=allocation or Allocation(job_id=job.job_id),
                               started=set(n.holder_job_id for n in allocation.nodes) if allocation else set())
            self._jobs[job.job_id] = tracked
        else:  # idempotent: keep what we know, add members we did not
            merged = tracked.job
            for member in job.member_job_ids:
                if member not in merged.member_job_ids:
                    merged = merged.with_member(member)
            tracked.job = merged
        # an anchor launched by nereusd.launch carries the job's comment: a reused id cannot match it
        self.poller.watch(job.anchor_job_id, submitted_at_s=job.submitted_at_s, comment=job.extra.get("comment"))
        for member in tracked.job.member_job_ids:
            self.poller.watch(member, comment=job_comment(job.job_id))

    def untrack(self, job_id: str) -> None:
        tracked = self._jobs.pop(job_id, None)
        if tracked is not None:
            for slurm_id in tracked.job.slurm_job_ids:
                self.poller.unwatch(slurm_id)

    def jobs(self) -> tuple[ElasticJob, ...]:
        return tuple(t.job for t in self._jobs.values())

    def allocation(self, job_id: str) -> Allocation:
        return self._get(job_id).allocation

    def _get(self, job_id: str) -> _Tracked:
        tracked = self._jobs.get(job_id)
        if tracked is None:
            raise AllocationError(f"job {job_id!r} is not tracked (tracked: {sorted(self._jobs)})")
        return tracked

    def _emit(self, kind: EventKind, tracked: _Tracked, slurm_job_id: str | None,
              nodes: Sequence[NodeAllocation] = (), reason: str = "") -> None:
        event = AllocationEvent(kind=kind, job_id=tracked.job.job_id, slurm_job_id=slurm_job_id,
                                nodes=tuple(nodes), reason=reason, time_s=self.wall())
        self.log.info("allocation_event", kind=kind.value, job_id=event.job_id, slurm_job_id=slurm_job_id,
                      nodes=[n.node for n in nodes], reason=reason)
        self._events.append(event)

    # --- passive sync -----------------------------------------------------------------------------
    def poll(self) -> list[AllocationEvent]:
        if self.poller.refresh():
            for tracked in list(self._jobs.values()):
                self._adopt_members(tracked)
                self._sync(tracked)
        for tracked in self._jobs.values():
            self._submit_pending(tracked)
        events, self._events = self._events, []
        return events

    def _adopt_members(self, tracked: _Tracked) -> None:
        """Members submitted just before a daemon crash carry our comment: take them back."""
        known = set(tracked.job.slurm_job_ids) | tracked.forgotten
        for info in self.poller.jobs_with_comment(job_comment(tracked.job.job_id)):
            if info.job_id not in known and not info.terminal and info.name.endswith("-member"):
                tracked.job = tracked.job.with_member(info.job_id)
                self.poller.watch(info.job_id, submitted_at_s=info.submit_time_s,
                                  comment=job_comment(tracked.job.job_id))
                self.log.info("member_adopted", job_id=tracked.job.job_id, slurm_job_id=info.job_id)

    def _current_nodes(self, tracked: _Tracked) -> list[NodeAllocation]:
        nodes: list[NodeAllocation] = []
        for slurm_id in tracked.job.slurm_job_ids:
            info = self.poller.info(slurm_id)
            if self._undecided(tracked, slurm_id, info):
                # Not known yet why (or whether) the job lets its nodes go: keep them one more poll
                # rather than report a loss with the wrong reason.
                nodes.extend(n for n in tracked.allocation.nodes if n.holder_job_id == slurm_id)
                continue
            if info is None or not info.mapping.holds_usable_nodes:
                continue
            for node in info.nodes:
                if self.poller.node_lost(node)[0]:
                    continue  # Slurm may not have excised a DOWN node from the job yet
                nodes.append(NodeAllocation(node=node, gpu_indices=tuple(info.gpu_indices.get(node, ())),
                                            holder_job_id=slurm_id))
        return nodes

    def _undecided(self, tracked: _Tracked, slurm_id: str, info: SlurmJobInfo | None) -> bool:
        """True while a job's fate is unknown: missing from one squeue, an unknown state, or
        COMPLETING (its final state, CANCELLED or TIMEOUT or ..., follows within seconds)."""
        if info is None or info.mapping.phase is Phase.UNKNOWN:
            return True
        if info.mapping.phase is not Phase.ENDING:
            tracked.ending_since.pop(slurm_id, None)
            return False
        since = tracked.ending_since.setdefault(slurm_id, self.clock())
        return self.clock() - since < ENDING_GRACE_S

    def _sync(self, tracked: _Tracked) -> None:
        before = {n.node: n for n in tracked.allocation.nodes}
        now = self._current_nodes(tracked)
        after = {n.node: n for n in now}
        added = [n for n in now if n.node not in before]
        removed = [n for name, n in before.items() if name not in after]
        for holder, group in _by_holder(added).items():
            kind = EventKind.GRANTED if holder == tracked.job.anchor_job_id else EventKind.GROWN
            tracked.started.add(holder)
            self._emit(kind, tracked, holder, group, f"{holder} running on {compress([n.node for n in group])}")
        anchor = tracked.job.anchor_job_id
        for (kind, holder, reason), group in self._classify_losses(tracked, removed).items():
            self._emit(kind, tracked, holder, group, reason)
            tracked.anchor_end_reported |= holder == anchor and kind is not EventKind.NODE_DOWN \
                and kind is not EventKind.SHRUNK
        tracked.allocation = Allocation(job_id=tracked.job.job_id, nodes=tuple(now))
        info = self.poller.info(anchor)
        if info is not None and info.terminal and not tracked.anchor_end_reported:
            # the anchor ended holding nothing (e.g. cancelled while pending): the job still ends
            kind = (EventKind.RELEASED if tracked.released else info.mapping.ended_by or EventKind.CANCELLED)
            self._emit(kind, tracked, anchor, (), _describe(info))
            tracked.anchor_end_reported = True
        self._settle_members(tracked)

    def _classify_losses(self, tracked: _Tracked, removed: list[NodeAllocation]
                         ) -> dict[tuple[EventKind, str, str], list[NodeAllocation]]:
        groups: dict[tuple[EventKind, str, str], list[NodeAllocation]] = {}
        for node in removed:
            info = self.poller.info(node.holder_job_id)
            lost, why = self.poller.node_lost(node.node)
            if node.node in tracked.shrinking:
                key = (EventKind.SHRUNK, node.holder_job_id, tracked.shrinking.pop(node.node))
            elif tracked.released:
                key = (EventKind.RELEASED, node.holder_job_id, "job released")
            elif lost:
                key = (EventKind.NODE_DOWN, node.holder_job_id, why)
            elif info is not None and info.mapping.ended_by is not None:
                key = (info.mapping.ended_by, node.holder_job_id, _describe(info))
            elif info is not None and info.mapping.phase is Phase.PENDING:  # requeued: waits for nodes again
                key = (EventKind.NODE_DOWN, node.holder_job_id, f"{_describe(info)}: requeued by Slurm")
            elif info is not None and info.mapping.phase is Phase.ENDED:  # left squeue unseen
                key = (EventKind.CANCELLED, node.holder_job_id, _describe(info))
            else:  # the job runs on, without this node: shrunk in place by someone else
                key = (EventKind.SHRUNK, node.holder_job_id, "shrunk outside Nereus (not requested)")
            groups.setdefault(key, []).append(node)
        return groups

    def _settle_members(self, tracked: _Tracked) -> None:
        """Drop ended members from the job; a member that ended before it ever ran is a failed request."""
        for member in tracked.job.member_job_ids:
            info = self.poller.info(member)
            if info is None or not info.terminal:
                continue
            if member not in tracked.started and member not in tracked.cancelling and not tracked.released:
                self._emit(EventKind.REQUEST_FAILED, tracked, member, (), f"member ended before starting: "
                           f"{_describe(info)}")
            tracked.job = tracked.job.without_member(member)
            tracked.forgotten.add(member)
            tracked.cancelling.discard(member)
            tracked.started.discard(member)
            tracked.ending_since.pop(member, None)
            self.poller.unwatch(member)

    # --- active steps -----------------------------------------------------------------------------
    def grow(self, job_id: str, n_nodes: int) -> tuple[str, ...]:
        tracked = self._get(job_id)
        if n_nodes < 1:
            raise AllocationError(f"grow {job_id}: n_nodes must be >= 1, got {n_nodes}")
        if tracked.released:
            raise AllocationError(f"grow {job_id}: the job was released")
        held = len(tracked.allocation.nodes)
        asked = tracked.requested_members(self.poller) + tracked.pending_grow_nodes
        room = tracked.job.max_nodes - held - asked
        if n_nodes > room:
            raise AllocationError(f"grow {job_id} by {n_nodes} nodes: holds {held}, {asked} requested, "
                                  f"max {tracked.job.max_nodes} nodes ({tracked.job.max_gpus} GPUs): "
                                  f"at most {max(room, 0)} more")
        tracked.pending_grow_nodes += n_nodes
        return self._submit_pending(tracked)

    def pending_members(self, job_id: str) -> tuple[str, ...]:
        """Member jobs asked for that do not hold nodes yet: submitted and PENDING in Slurm (or not yet
        seen there), plus one placeholder per request the throttle holds back."""
        tracked = self._jobs.get(job_id)
        if tracked is None:
            return ()
        out = [m for m in tracked.job.member_job_ids if m not in tracked.cancelling and
               ((info := self.poller.info(m)) is None or info.mapping.phase is Phase.PENDING)]
        return (*out, *(f"(queued {i + 1})" for i in range(tracked.pending_grow_nodes)))

    def member_end_times(self, job_id: str) -> dict[str, float]:
        """node -> the Unix time its running member job ends (Slurm's end time: start + time limit)."""
        tracked = self._jobs.get(job_id)
        if tracked is None:
            return {}
        out: dict[str, float] = {}
        for node in tracked.allocation.nodes:
            info = self.poller.info(node.holder_job_id)
            if node.holder_job_id != tracked.job.anchor_job_id and info is not None and \
                    info.mapping.holds_usable_nodes and info.end_time_s > 0:
                out[node.node] = info.end_time_s
        return out

    def idle_nodes(self) -> tuple[str, ...]:
        """Nodes sinfo last said are idle (room for a one-node member job)."""
        return self.poller.idle_nodes()

    def cancel_pending(self, job_id: str, members: Sequence[str]) -> None:
        """Cancel member jobs that never ran (no longer wanted): scancel, and no failed-request event."""
        tracked = self._get(job_id)
        queued = [m for m in members if m.startswith("(queued")]
        tracked.pending_grow_nodes = max(0, tracked.pending_grow_nodes - len(queued))
        ids = [m for m in members if m in tracked.job.member_job_ids and m not in tracked.started]
        if not ids:
            return
        tracked.cancelling.update(ids)
        result = self.commands.scancel(ids)
        if not result.ok:
            self._emit(EventKind.REQUEST_FAILED, tracked, None, (), f"cancel of pending members failed: {result.error}")
        self.poller.poll_soon()

    def _throttle_room(self) -> int:
        now = self.clock()
        while self._submissions and now - self._submissions[0] >= 60.0:
            self._submissions.popleft()
        return self.max_submissions_per_minute - len(self._submissions)

    def _submit_pending(self, tracked: _Tracked) -> tuple[str, ...]:
        submitted: list[str] = []
        while tracked.pending_grow_nodes > 0 and not tracked.released and self._throttle_room() > 0:
            self._submissions.append(self.clock())
            tracked.pending_grow_nodes -= 1
            try:
                sub = self._submit_member(tracked.job)
            except (SubmitError, OSError) as exc:
                self._emit(EventKind.REQUEST_FAILED, tracked, None, (), str(exc))
                continue
            tracked.job = tracked.job.with_member(sub.slurm_job_id)
            self.poller.watch(sub.slurm_job_id, comment=job_comment(tracked.job.job_id))
            self._emit(EventKind.REQUESTED, tracked, sub.slurm_job_id, (), "member job submitted")
            submitted.append(sub.slurm_job_id)
        if submitted:
            self.poller.poll_soon()
        return tuple(submitted)

    def shrink(self, job_id: str, nodes: Sequence[str], reason: str = "released by Nereus") -> None:
        tracked = self._get(job_id)
        held = {n.node: n for n in tracked.allocation.nodes}
        unknown = [n for n in nodes if n not in held]
        if unknown:
            raise AllocationError(f"shrink {job_id}: not holding {unknown} (holds {sorted(held)})")
        by_holder = _by_holder([held[n] for n in nodes])
        anchor = tracked.job.anchor_job_id
        if anchor in by_holder:  # check before acting: the batch node cannot go
            info = self.poller.info(anchor)
            batch = info.batch_host if info else ""
            if batch in {n.node for n in by_holder[anchor]}:
                raise AllocationError(f"shrink {job_id}: {batch} is the anchor's batch node; release the job "
                                      f"instead")
        for holder, group in by_holder.items():
            names = [n.node for n in group]
            keep = [n.node for n in tracked.allocation.nodes if n.holder_job_id == holder and n.node not in names]
            result = (self.commands.scancel([holder]) if not keep
                      else self.commands.update_job(holder, NodeList=compress(keep)))
            if not result.ok:
                self._emit(EventKind.REQUEST_FAILED, tracked, holder, group, f"shrink failed: {result.error}")
                continue
            if not keep:
                tracked.cancelling.add(holder)
            for name in names:
                tracked.shrinking[name] = reason
        self.poller.poll_soon()

    def release(self, job_id: str) -> None:
        tracked = self._get(job_id)
        tracked.released = True
        tracked.pending_grow_nodes = 0
        ids = list(tracked.job.slurm_job_ids)
        tracked.cancelling.update(ids)
        result = self.commands.scancel(ids)
        if not result.ok:
            self._emit(EventKind.REQUEST_FAILED, tracked, None, (), f"release failed: {result.error}")
        self.poller.poll_soon()


def _by_holder(nodes: Sequence[NodeAllocation]) -> dict[str, list[NodeAllocation]]:
    out: dict[str, list[NodeAllocation]] = {}
    for n in nodes:
        out.setdefault(n.holder_job_id, []).append(n)
    return out


def _describe(info: SlurmJobInfo) -> str:
    reason = f" ({info.reason})" if info.reason and info.reason != "None" else ""
    return f"Slurm job {info.job_id} {info.state}{reason}"
