"""One batched poller for every Slurm job the daemon follows.

One ``squeue --json`` per interval answers for all jobs (Slurm 22.05 ignores -j/-u/-t with --json,
so jobs are filtered here by id), plus one ``sinfo --json`` for node states while any job runs.
When a command fails or hangs, the next attempt waits 0, 2, 4, 8 ... s up to a cap and the last
good answer stays in place; nothing is raised into the daemon's loop. Terminal states are cached and
never asked about again. Job ids can be reused (slurmctld state wiped, id wrap-around): each watched
id is pinned to its submit time (and name/comment when given), and a record that does not match is
reported as the watched job having vanished rather than adopted; a later submit time under the same
id, name and comment is the job requeued (Slurm restamps it), and the pin moves.

    poller = SlurmPoller(SlurmCommands(), interval_s=5)
    poller.watch("1042", comment="nereus:grpo-8b")
    if poller.refresh():            # True when new data arrived
        info = poller.info("1042")  # SlurmJobInfo or None
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from nereusd.slurm.commands import SlurmCommands, gres_indices, node_gpu_indices
from nereusd.slurm.hostlist import expand
from nereusd.slurm.states import Phase, StateMapping, map_job_state, node_lost
from nereusd.wire.logs import get_logger
from planner.errors import SpecError

SUBMIT_TIME_TOLERANCE_S = 1.0
VANISHED = StateMapping(phase=Phase.ENDED)  # left squeue without a terminal state we saw


@dataclass(frozen=True, kw_only=True, slots=True)
class SlurmJobInfo:
    """What the last squeue said about one job (times are Unix seconds; 0 when unset)."""

    job_id: str
    name: str
    comment: str
    user: str
    state: str  # Slurm's own word, e.g. RUNNING, NODE_FAIL
    mapping: StateMapping
    reason: str
    partition: str
    batch_host: str
    nodes: tuple[str, ...]
    gpu_indices: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # per node
    submit_time_s: float = 0.0
    start_time_s: float = 0.0
    end_time_s: float = 0.0
    resize_time_s: float = 0.0

    @property
    def terminal(self) -> bool:
        return self.mapping.terminal


@dataclass(kw_only=True, slots=True)
class _Watch:
    job_id: str
    submitted_at_s: float | None
    name: str | None
    comment: str | None
    polls_missing: int = 0


def parse_squeue_job(raw: Mapping[str, Any]) -> SlurmJobInfo:
    """One entry of ``squeue --json``'s "jobs" list."""
    nodes = expand(raw.get("nodes") or "")
    state = str(raw.get("job_state") or "")
    mapping = map_job_state(state)
    if not mapping.holds_usable_nodes and mapping.phase is not Phase.SUSPENDED:
        nodes = ()  # an ended or requeued job's last node list is history, not an allocation
    detail = list(raw.get("gres_detail") or [])
    per_node = {n: gres_indices(g) for n, g in zip(nodes, detail)} if len(detail) == len(nodes) else {}
    return SlurmJobInfo(
        job_id=str(raw.get("job_id")), name=str(raw.get("name") or ""), comment=str(raw.get("comment") or ""),
        user=str(raw.get("user_name") or ""), state=state, mapping=mapping,
        reason=str(raw.get("state_reason") or ""), partition=str(raw.get("partition") or ""),
        batch_host=str(raw.get("batch_host") or ""), nodes=nodes, gpu_indices=per_node,
        submit_time_s=float(raw.get("submit_time") or 0), start_time_s=float(raw.get("start_time") or 0),
        end_time_s=float(raw.get("end_time") or 0), resize_time_s=float(raw.get("resize_time") or 0),
    )


class SlurmPoller:
    def __init__(self, commands: SlurmCommands, *, interval_s: float = 5.0, backoff_max_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s <= 0:
            raise SpecError("slurm.poll_interval_s", f"must be > 0, got {interval_s}")
        if backoff_max_s <= 0:
            raise SpecError("slurm.poll_backoff_max_s", f"must be > 0, got {backoff_max_s}")
        self.commands = commands
        self.interval_s = interval_s
        self.backoff_max_s = backoff_max_s
        self.clock = clock
        self.log = get_logger("slurm-poller")
        self._watches: dict[str, _Watch] = {}
        self._infos: dict[str, SlurmJobInfo] = {}
        self._terminal: dict[str, SlurmJobInfo] = {}  # cached forever (until unwatch)
        self._all_jobs: dict[str, SlurmJobInfo] = {}  # every job in the last squeue, for discovery
        self._node_states: dict[str, tuple[str, tuple[str, ...], str]] = {}  # name -> (state, flags, reason)
        self._next_at = 0.0
        self.consecutive_failures = 0
        self.successful_polls = 0

    # --- what to follow ---------------------------------------------------------------------------
    def watch(self, job_id: str, *, submitted_at_s: float | None = None, name: str | None = None,
              comment: str | None = None) -> None:
        job_id = str(job_id)
        if job_id not in self._watches:
            self._watches[job_id] = _Watch(job_id=job_id, submitted_at_s=submitted_at_s, name=name,
                                           comment=comment)
            if job_id in self._all_jobs:  # already in the last squeue: known at once, no extra call
                self._update(self._watches[job_id], self._all_jobs[job_id])

    def poll_soon(self) -> None:
        """Make the next ``refresh`` poll (after the daemon changed something and wants to see it)."""
        if self.consecutive_failures == 0:
            self._next_at = self.clock()

    def unwatch(self, job_id: str) -> None:
        for table in (self._watches, self._infos, self._terminal):
            table.pop(str(job_id), None)

    def watched(self) -> tuple[str, ...]:
        return tuple(self._watches)

    def submitted_at(self, job_id: str) -> float | None:
        watch = self._watches.get(str(job_id))
        return watch.submitted_at_s if watch else None

    # --- polling ----------------------------------------------------------------------------------
    def backoff_s(self, failures: int) -> float:
        """Delay before the next attempt after ``failures`` failures in a row: 0, 2, 4, 8 ... cap."""
        return 0.0 if failures <= 1 else min(self.backoff_max_s, 2.0 ** (failures - 1))

    def due(self) -> bool:
        return self.clock() >= self._next_at

    def refresh(self, force: bool = False) -> bool:
        """Poll Slurm if due (or forced). True when fresh data arrived; False otherwise (never raises)."""
        if not force and not self.due():
            return False
        if not self._watches and not force:
            self._next_at = self.clock() + self.interval_s
            return False
        data = self.commands.squeue_json()
        if data is None or not isinstance(data.get("jobs"), list):
            self.consecutive_failures += 1
            delay = self.backoff_s(self.consecutive_failures)
            self._next_at = self.clock() + delay
            self.log.warning("slurm_poll_failed", failures=self.consecutive_failures, retry_in_s=delay)
            return False
        self.consecutive_failures = 0
        self.successful_polls += 1
        self._next_at = self.clock() + self.interval_s
        self._all_jobs = {}
        for raw in data["jobs"]:
            try:
                info = parse_squeue_job(raw)
            except (SpecError, ValueError, TypeError) as exc:
                self.log.warning("slurm_job_unparsable", job_id=raw.get("job_id"), error=str(exc))
                continue
            self._all_jobs[info.job_id] = info
        for watch in self._watches.values():
            if watch.job_id not in self._terminal:
                self._update(watch, self._all_jobs.get(watch.job_id))
        if any(i.mapping.holds_usable_nodes for i in self._infos.values()):
            self._refresh_nodes()
        return True

    def _update(self, watch: _Watch, info: SlurmJobInfo | None) -> None:
        why = "left squeue"
        if info is not None and not self._same_job(watch, info):
            info = None  # a different job under a reused id: as far as we know ours is gone
            why = "job id reused by another job"
            watch.polls_missing = max(watch.polls_missing, 1)
        if info is None:
            watch.polls_missing += 1
            # A job just submitted is in squeue at once, and a finished one stays MinJobAge seconds:
            # missing twice in a row means it is gone.
            if watch.polls_missing >= 2:
                last = self._infos.get(watch.job_id)
                gone = (replace(last, state="VANISHED", mapping=VANISHED, nodes=(), gpu_indices={}, reason=why)
                        if last else SlurmJobInfo(job_id=watch.job_id, name=watch.name or "",
                                                  comment=watch.comment or "", user="", state="VANISHED",
                                                  mapping=VANISHED, reason=why, partition="", batch_host="",
                                                  nodes=(), submit_time_s=watch.submitted_at_s or 0.0))
                self._terminal[watch.job_id] = gone
                self._infos[watch.job_id] = gone
                self.log.info("slurm_job_vanished", job_id=watch.job_id, reason=why,
                              last_state=last.state if last else None)
            return
        watch.polls_missing = 0
        if watch.submitted_at_s is None and info.submit_time_s:
            watch.submitted_at_s = info.submit_time_s  # pin identity at first sight
        if info.mapping.holds_usable_nodes and info.nodes and len(info.gpu_indices) != len(info.nodes):
            info = self._with_scontrol_gres(info)
        self._infos[watch.job_id] = info
        if info.terminal:
            self._terminal[watch.job_id] = info
        if info.mapping.phase is Phase.UNKNOWN:
            self.log.warning("slurm_state_unknown", job_id=info.job_id, state=info.state)

    def _same_job(self, watch: _Watch, info: SlurmJobInfo) -> bool:
        reasons = []
        if watch.submitted_at_s is not None and info.submit_time_s and \
                abs(info.submit_time_s - watch.submitted_at_s) > SUBMIT_TIME_TOLERANCE_S:
            if self._requeued(watch, info):  # Slurm restamps a requeued job's submit time: same job, re-pinned
                self.log.info("slurm_job_requeued", job_id=watch.job_id, state=info.state,
                              submit_time=info.submit_time_s, was=watch.submitted_at_s)
                watch.submitted_at_s = info.submit_time_s
            else:
                reasons.append(f"submit time {info.submit_time_s:.0f} != {watch.submitted_at_s:.0f}")
        if watch.name is not None and info.name != watch.name:
            reasons.append(f"name {info.name!r} != {watch.name!r}")
        if watch.comment is not None and info.comment != watch.comment:
            reasons.append(f"comment {info.comment!r} != {watch.comment!r}")
        if reasons:
            self.log.warning("slurm_job_id_reused", job_id=watch.job_id, reasons=reasons)
        return not reasons

    @staticmethod
    def _requeued(watch: _Watch, info: SlurmJobInfo) -> bool:
        """A later submit time under the same id, name and comment (nereus:JOB, which a reused id from
        another submitter does not carry) is the same job requeued (node failure, preemption, scontrol
        requeue), not a reuse."""
        return (watch.comment is not None and info.comment == watch.comment
                and (watch.name is None or info.name == watch.name)
                and watch.submitted_at_s is not None and info.submit_time_s > watch.submitted_at_s)

    def _with_scontrol_gres(self, info: SlurmJobInfo) -> SlurmJobInfo:
        fields = self.commands.show_job(info.job_id)
        if fields is None:
            return info
        per_node = node_gpu_indices(fields)
        return replace(info, gpu_indices={n: per_node.get(n, ()) for n in info.nodes})

    def _refresh_nodes(self) -> None:
        data = self.commands.sinfo_json()
        if data is None:
            return  # keep the last node states
        states: dict[str, tuple[str, tuple[str, ...], str]] = {}
        for node in data.get("nodes") or []:
            states[str(node.get("name"))] = (str(node.get("state") or ""),
                                             tuple(node.get("state_flags") or ()), str(node.get("reason") or ""))
        self._node_states = states

    # --- answers ----------------------------------------------------------------------------------
    def info(self, job_id: str) -> SlurmJobInfo | None:
        return self._infos.get(str(job_id))

    def jobs_with_comment(self, comment: str) -> tuple[SlurmJobInfo, ...]:
        """Jobs of the last squeue carrying this comment (finds member jobs after a daemon restart)."""
        return tuple(i for i in self._all_jobs.values() if i.comment == comment)

    def idle_nodes(self) -> tuple[str, ...]:
        """Nodes in the last sinfo whose state is idle (no job on them)."""
        return tuple(n for n, (state, _, _) in self._node_states.items()
                     if state.strip().lower().split("+", 1)[0].rstrip("*~#!%$@^-") == "idle")

    def node_lost(self, node: str) -> tuple[bool, str]:
        """(lost, why) for a node, from the last sinfo; unknown nodes are not lost."""
        state, flags, reason = self._node_states.get(node, ("", (), ""))
        lost = bool(state) and node_lost(state, flags)
        return lost, (f"node {node} {state.upper()}" + (f": {reason}" if reason else "")) if lost else ""
