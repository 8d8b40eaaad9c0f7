"""The daemon's growth policy: a Slurm job grows toward its ``max_gpus`` by itself, one member job at a time.

Every ``interval_s`` per job (the throttle; settings: ``[slurm]`` ``grow``, ``grow_interval_s``,
``grow_horizon_steps``, ``time_limit_lead_s``), for a job that runs a committed plan with nothing in flight
(no open transition, no drain), holding fewer nodes than ``max_gpus / gpus_per_node``:

- one node more is priced on the planner: the best plan on the pool plus one node's GPUs against the
  running plan's calibrated prediction, and the transition onto it (L_tran from the planner's DAG);
- the payback rule decides (``admission.admit``, opportunistic: L_tran / dL <= gamma * H, with H the
  steps the grown pool is expected to serve: the rest of the run where the job file gives ``steps``,
  else ``horizon_steps``); the member's start costs the job
  nothing (it trains on while the member waits in Slurm's queue);
- the cluster must have room: an idle node (sinfo) for the member; else it waits, said once;
- admitted: one member job is asked for (``source.grow``); it shows in ``nereusctl jobs`` (PENDING
  column) and ``job-plan`` until it runs and its agent joins, and the next one waits for that.

A pending member no longer wanted is cancelled (``source.cancel_pending``): the job stopped running,
started draining (a shrink or a leaving node), passed its maximum, or the gain went away on the
re-priced pool. A member whose Slurm end time (its time limit) is within ``time_limit_lead_s`` is
drained and released ahead of Slurm's SIGTERM (``time-limit-ahead``). Each verdict lands in events (``growth-requested``, ``growth-declined``,
``growth-waiting``, ``growth-cancelled``), a repeated one only when its reason changes.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from nereusd.controller import JobController
from planner import admission
from planner.errors import InfeasibleError, SpecError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

DEFAULT_INTERVAL_S = 5.0
DEFAULT_HORIZON_STEPS = 50.0  # steps a grown pool is expected to serve (no end is known to the daemon)
DEFAULT_TIME_LIMIT_LEAD_S = 120.0  # a member this close to its Slurm end time is drained and released first
PENDING_NODE = "(member pending)"


class GrowingSource(Protocol):
    name: str

    def jobs(self) -> tuple[Any, ...]: ...
    def allocation(self, job_id: str) -> Any: ...
    def pending_members(self, job_id: str) -> tuple[str, ...]: ...
    def idle_nodes(self) -> tuple[str, ...]: ...


class GrowthPolicy:
    def __init__(self, *, source: GrowingSource, controllers: dict[str, JobController],
                 request: Callable[[str, str, Any], None], add_event: Callable[[str, str, dict[str, Any]], None],
                 interval_s: float = DEFAULT_INTERVAL_S, horizon_steps: float = DEFAULT_HORIZON_STEPS,
                 shrink: Callable[[str, list[str], str], None] | None = None,
                 time_limit_lead_s: float = DEFAULT_TIME_LIMIT_LEAD_S,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.source, self.controllers = source, controllers
        self.shrink, self.time_limit_lead_s, self.wall = shrink, time_limit_lead_s, wall
        self._shrunk_ahead: set[tuple[str, str, float]] = set()
        self.request, self.add_event = request, add_event  # request(op, job, arg): queued for the source thread
        self.interval_s, self.horizon_steps, self.clock = interval_s, horizon_steps, clock
        self._next_at: dict[str, float] = {}
        self._said: dict[str, str] = {}  # job -> the last verdict's reason told (no flood of repeats)
        self._cancelling: set[str] = set()
        self._steps: dict[str, int | None] = {}  # job -> its run's length in steps (job file), if known

    def tick(self) -> None:
        now = self.clock()
        for ej in self.source.jobs():
            if now >= self._next_at.get(ej.job_id, 0.0):
                self._next_at[ej.job_id] = now + self.interval_s
                self.ahead_of_time_limits(ej.job_id)
                self.consider(ej)

    def ahead_of_time_limits(self, job_id: str) -> list[str]:
        """Members whose Slurm end time is within ``time_limit_lead_s``: drained, then released (the
        daemon's graceful shrink), before Slurm's SIGTERM; each once. Returns the nodes asked to go."""
        ends = getattr(self.source, "member_end_times", None)
        if ends is None or self.shrink is None:
            return []
        wall = self.wall()
        end_of = ends(job_id)
        due = [node for node, end_s in end_of.items()  # keyed by the end time too: a later member on that node
               if 0 < end_s - wall <= self.time_limit_lead_s and (job_id, node, end_s) not in self._shrunk_ahead]
        for node in due:
            self._shrunk_ahead.add((job_id, node, end_of[node]))
            self.add_event(job_id, "time-limit-ahead", {"node": node, "ends_in_s": round(end_of[node] - wall, 1)})
            try:
                self.shrink(job_id, [node], "time limit ahead")
            except Exception as exc:  # refused (its state has nowhere to go): Slurm's SIGTERM path remains
                self.add_event(job_id, "time-limit-ahead-refused", {"node": node, "reason": str(exc)})
        return due

    def consider(self, ej: Any) -> str:
        """One look at one job; returns what it did (for tests and logs)."""
        ctl = self.controllers.get(ej.job_id)
        pending = [m for m in self.source.pending_members(ej.job_id) if m not in self._cancelling]
        held = len(self.source.allocation(ej.job_id).nodes)
        if ctl is None or ctl.job["state"] not in ("running", "transitioning"):
            return self._cancel(ej.job_id, pending, "the job is not running")
        if ctl.draining:
            return self._cancel(ej.job_id, pending, f"the job is draining {', '.join(sorted(ctl.draining))}")
        if held + len(pending) > ej.max_nodes:
            return self._cancel(ej.job_id, pending[max(0, ej.max_nodes - held):], f"past max_gpus={ej.max_gpus}")
        if held >= ej.max_nodes:
            return self._say(ej.job_id, "growth-declined", f"at max_gpus={ej.max_gpus}", {"nodes": held})
        if ctl.job["state"] != "running" or ctl.plan is None or ctl.prediction is None or \
                ctl.store.open_transitions(ej.job_id) or len(ctl.pool) < held * ctl.gpus_per_node:
            return "busy"  # a transition in flight, no plan yet, or a granted node not joined: look later
        verdict = self._price(ctl)
        if pending:
            if verdict is not None and not verdict.admitted:
                return self._cancel(ej.job_id, pending, f"no gain any more: {verdict.reason}")
            return "pending"
        if verdict is None:
            return "unpriced"
        data = {"gpus": len(ctl.pool), "gpus_after": len(ctl.pool) + ctl.gpus_per_node, "rule": verdict.rule.value,
                "saving_s_per_step": verdict.saving_s_per_step, "l_tran_s": verdict.transition_s,
                "h_steps": verdict.h_steps}
        if not verdict.admitted:
            return self._say(ej.job_id, "growth-declined", verdict.reason, data)
        idle = self.source.idle_nodes()
        if not idle:
            return self._say(ej.job_id, "growth-waiting", "no idle node in the cluster for a member job", data)
        self.request("grow", ej.job_id, 1)
        self._said.pop(ej.job_id, None)
        self.add_event(ej.job_id, "growth-requested", {**data, "reason": verdict.reason, "idle_nodes": len(idle)})
        return "requested"

    def _price(self, ctl: JobController) -> admission.Verdict | None:
        """The payback verdict on the pool plus one node; None when the planner cannot say."""
        if ctl.planner is None or ctl.plan is None or ctl.prediction is None:
            return None
        first = (max(ctl.gpu_owner, default=-1) // ctl.gpus_per_node + 1) * ctl.gpus_per_node
        extra = frozenset(range(first, first + ctl.gpus_per_node))
        spec = ctl._spec_now()
        try:
            cand = ctl.planner.search(spec, ctl.pool | extra, ctl.store.max_plan_version(ctl.job_id) + 1)
            sketch = ctl.planner.transition(spec, ctl.plan, cand.plan, ctl._participants() | extra,
                                            lambda g: PENDING_NODE if g in extra else ctl._node_of_gpu(g))
        except (InfeasibleError, SpecError, KeyError, ValueError) as exc:
            self._say(ctl.job_id, "growth-declined", f"cannot price a larger pool: {str(exc).splitlines()[0]}", {})
            return None
        trigger = admission.Trigger(kind=admission.TriggerKind.OPPORTUNISTIC, step=ctl.last_step,
                                    reasons=(f"growth to {len(ctl.pool | extra)} GPUs",), h_steps=self._horizon(ctl))
        current = ctl.current_prediction()  # calibrated, as the candidate's search is; else the plan's own
        now_s = current[0].step_latency_s if current is not None else ctl.prediction.step_latency_s
        return admission.admit(trigger=trigger, current_step_s=float(now_s),
                               candidate_step_s=float(cand.prediction.step_latency_s),
                               transition_s=float(sketch.predicted_s), same_plan=cand.plan == ctl.plan,
                               gamma=ctl.gamma)

    def _horizon(self, ctl: JobController) -> float:
        """Steps the grown pool serves: the rest of the run where the job file says how long it is
        (``steps``), else ``horizon_steps``."""
        if ctl.job_id not in self._steps:
            extra = ((ctl.job.get("spec") or {}).get("elastic") or {}).get("extra") or {}
            try:
                steps = tomllib.loads(Path(str(extra["job_file"])).read_text()).get("steps")
            except (KeyError, OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
                steps = None
            self._steps[ctl.job_id] = int(steps) if isinstance(steps, int) and steps > 0 else None
        total = self._steps[ctl.job_id]
        return float(max(1, total - ctl.last_step)) if total is not None else self.horizon_steps

    def _cancel(self, job_id: str, members: list[str], why: str) -> str:
        if not members:
            return "idle"
        self._cancelling.update(members)
        self.request("cancel_pending", job_id, list(members))
        self.add_event(job_id, "growth-cancelled", {"members": members, "reason": why})
        return "cancelled"

    def _say(self, job_id: str, kind: str, reason: str, data: dict[str, Any]) -> str:
        key = f"{kind}: {data.get('rule') or reason}"  # a verdict's figures move every step: keyed by its rule
        if self._said.get(job_id) != key:
            self._said[job_id] = key
            self.add_event(job_id, kind, {**data, "reason": reason})
        return kind.removeprefix("growth-")


def make_growth(d: Any) -> GrowthPolicy | None:
    """The growth policy of daemon ``d`` (nereusd.daemon.Daemon) for a Slurm source (None otherwise: the
    local source grows on request only)."""
    if d.source is None or d.worker is None or d.source.name != "slurm" or not d.settings.slurm.grow:
        return None
    worker, s = d.worker, d.settings.slurm
    return GrowthPolicy(source=d.source, controllers=d.controllers,  # type: ignore[arg-type]
                        request=lambda op, job, arg: worker.requests.put((op, (job, arg))),
                        add_event=lambda job, kind, data: d.store.add_event(kind, data, job_id=job),
                        shrink=lambda job, nodes, why: d.source_request("shrink", job, nodes),
                        interval_s=s.grow_interval_s, horizon_steps=s.grow_horizon_steps,
                        time_limit_lead_s=s.time_limit_lead_s)
