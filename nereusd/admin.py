"""The admin endpoint's operations: what nereusctl can ask the daemon (admin CURVE keys only).

Each op's ``args`` are first checked against its model in ``protocol.ADMIN_ARGS`` (names, bounded
counts, a job spec validated field by field); the op then gets the model and returns plain data (the
CLI renders tables or --json). A bad request raises ``AdminError`` with a protocol error code naming
the field; the daemon turns it into an ``AdminReply(ok=False)`` and keeps serving.

The ops see the daemon only through ``AdminBackend``: its store and key store (read), a snapshot of
its runtime, the live per-job figures the store does not hold, and the two requests an admin may
make (add a job, ask the allocation source for a change). ``nereusd.daemon.Daemon`` implements it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from nereusd.allocation import AllocationError
from nereusd.wire import protocol
from nereusd.wire.job_models import JobSpecModel
from planner.errors import NereusError

if TYPE_CHECKING:
    from nereusd.store import Store
    from nereusd.wire.keys import KeyStore


class AdminBackend(Protocol):
    """What the admin ops may read from and ask of the daemon (``Daemon`` implements it)."""

    @property
    def store(self) -> Store: ...

    @property
    def keys(self) -> KeyStore: ...

    @property
    def source_name(self) -> str | None: ...

    def runtime(self) -> dict[str, Any]:
        """pid, uptime_s, started_at, state_dir, endpoints, allocation_source, planner, agents_connected."""
        ...

    def damaged_jobs(self) -> dict[str, str]: ...

    def pool_gpus(self, job_id: str) -> int:
        """GPUs the job's controller holds now (0 without a controller)."""
        ...

    def node_workers(self, job_id: str, node: str) -> list[dict[str, Any]]:
        """The node's workers as its agent last reported them."""
        ...

    def draining_nodes(self, job_id: str) -> dict[str, str]:
        """Nodes being drained before they are given back (node -> why); empty without a controller."""
        ...

    def add_job(self, *, job_id: str, user: str, spec: JobSpecModel, slurm_job_id: str | None) -> None: ...

    def source_request(self, op: str, job_id: str, arg: Any) -> None: ...


class AdminError(NereusError):
    def __init__(self, code: str, message: str) -> None:
        self.code = code
        super().__init__(message)


class AdminOps:
    def __init__(self, daemon: AdminBackend) -> None:
        self.d = daemon
        self.ops: dict[str, Callable[[Any], Any]] = {
            "status": self.status, "jobs": self.jobs, "job": self.job, "job-add": self.job_add,
            "job-plan": self.job_plan, "decisions": self.decisions, "transitions": self.transitions,
            "transition": self.transition, "explain": self.explain, "alloc": self.alloc, "keys": self.keys,
            "events": self.events, "measurements": self.measurements,
        }

    def handle(self, op: str, args: Any) -> Any:
        try:
            parsed = protocol.admin_args(op, args)
        except protocol.ProtocolError as exc:
            raise AdminError(exc.code, str(exc).split(": ", 1)[1]) from None
        return self.ops[op](parsed)

    def _job(self, args: Any) -> dict[str, Any]:
        job_id = args.job
        row = self.d.store.job(job_id)
        if row is None:
            known = ", ".join(j["job_id"] for j in self.d.store.jobs()) or "none"
            raise AdminError("not-found", f"no job {job_id!r} (known: {known})")
        return row

    # --- ops ----------------------------------------------------------------------------------------
    def status(self, args: Any) -> dict[str, Any]:
        by_state: dict[str, int] = {}
        for j in self.d.store.jobs():
            by_state[j["state"]] = by_state.get(j["state"], 0) + 1
        nodes = self.d.store.all_nodes()
        return {**self.d.runtime(), "jobs": by_state, "jobs_damaged": self.d.damaged_jobs(),
                "nodes": {s: sum(1 for n in nodes if n["state"] == s) for s in ("alive", "lost", "released")},
                "store_schema_migrated_from": self.d.store.migrated_from}

    def jobs(self, args: Any) -> list[dict[str, Any]]:
        out = []
        for j in self.d.store.jobs():
            nodes = self.d.store.nodes(j["job_id"])
            last = self.d.store.events(j["job_id"], limit=1)  # any change (nodes, allocations), not only the state's
            updated = max(j["updated_at"], last[0]["at"]) if last else j["updated_at"]
            out.append({"job": j["job_id"], "user": j["user"], "state": j["state"], "slurm_job_id": j["slurm_job_id"],
                        "nodes_alive": sum(n["state"] == "alive" for n in nodes), "nodes": len(nodes),
                        "gpus": self.d.pool_gpus(j["job_id"]), "plan_version": j["plan_version"],
                        "updated_at": updated, "damaged": self.d.damaged_jobs().get(j["job_id"]),
                        "members_pending": len(getattr(self.d, "pending_members", lambda _: [])(j["job_id"]))})
        return out

    def job(self, args: Any) -> dict[str, Any]:
        j = self._job(args)
        draining = self.d.draining_nodes(j["job_id"])
        nodes = [{**n, "workers": self.d.node_workers(j["job_id"], n["node"]), "draining": draining.get(n["node"])}
                 for n in self.d.store.nodes(j["job_id"])]
        return {**j, "nodes": nodes, "history": self.d.store.history("job", j["job_id"]),
                "damaged": self.d.damaged_jobs().get(j["job_id"])}

    def job_add(self, args: protocol.JobAddArgs) -> dict[str, Any]:
        try:
            self.d.add_job(job_id=args.job, user=args.user, spec=args.spec, slurm_job_id=args.slurm_job_id)
        except NereusError as exc:
            raise AdminError("invalid", str(exc)) from None
        return {"job": args.job, "state": "pending"}

    def job_plan(self, args: Any) -> dict[str, Any]:
        """Per model-stage: the layout; ``predicted_s``, the running plan predicted with the efficiencies
        calibrated so far (re-predicted after each measurement; the plan's own prediction, ``planned_s``,
        until the first); ``measured_s``, the latest step's time; ``measured_median_s``, the median of
        the last 5 steps of this plan (one step on shared CPUs is noisy)."""
        recent_steps = 5
        j = self._job(args)
        row = self.d.store.plan(j["job_id"])
        recent = [m for m in self.d.store.measurements(j["job_id"], limit=recent_steps)
                  if m["plan_version"] == j["plan_version"]]
        last = self.d.store.measurements(j["job_id"], limit=1)
        measured = last[0] if last else None
        planned = (row["prediction"] or {}) if row else {}
        # the daemon's controller holds the calibrated re-prediction (a backend without controllers: none)
        ctl = getattr(self.d, "controllers", {}).get(j["job_id"])
        current = ctl.current_prediction() if ctl is not None else None
        pred_stages = dict(current[0].stage_seconds) if current else planned.get("stage_seconds") or {}
        stages = []
        if row and isinstance(row["plan"], dict):
            for s in row["plan"]["stages"]:
                name = s["model_stage"]
                times = [m["stage_times"][name] for m in recent if name in (m.get("stage_times") or {})]
                stages.append({"model_stage": name, "tp": s["tp"], "pp": s["pp"], "dp": len(s["gpu_sets"]),
                               "gpus": sorted(g for gs in s["gpu_sets"] for g in gs),
                               "micro_batch_size": s["micro_batch_size"], "grad_accum": s["grad_accum"],
                               "predicted_s": pred_stages.get(name),
                               "planned_s": (planned.get("stage_seconds") or {}).get(name),
                               "measured_s": (measured or {}).get("stage_times", {}).get(name),
                               "measured_median_s": statistics.median(times) if times else None})
        step_times = [m["step_latency_s"] for m in recent]
        return {"job": j["job_id"], "plan_version": j["plan_version"], "stages": stages,
                "predicted_step_s": (float(current[0].step_latency_s) if current else planned.get("step_latency_s"))
                if row and stages else None,
                "planned_step_s": planned.get("step_latency_s") if row and stages else None,
                "calibrated_at_step": current[1] if current else None,
                "measured_step_s": measured["step_latency_s"] if measured else None,
                "measured_median_step_s": statistics.median(step_times) if step_times else None,
                "measured_at_step": measured["step"] if measured else None}

    def decisions(self, args: Any) -> list[dict[str, Any]]:
        j = self._job(args)
        return [{**{k: v for k, v in d.items() if k != "inputs"}, "admitted": bool(d["admitted"]),
                 "urgent": bool(d["urgent"])} for d in self.d.store.decisions(j["job_id"])]

    def transitions(self, args: Any) -> list[dict[str, Any]]:
        j = self._job(args)
        return [{k: v for k, v in t.items() if k != "dag"} for t in self.d.store.transitions(j["job_id"])]

    def transition(self, args: protocol.IdArgs) -> dict[str, Any]:
        t = self.d.store.transition(args.id, detail=True)
        if t is None:
            raise AdminError("not-found", f"no transition {args.id}")
        return {**t, "history": self.d.store.history("transition", str(args.id))}

    def explain(self, args: protocol.IdArgs) -> dict[str, Any]:
        d = self.d.store.decision(args.id)
        if d is None:
            raise AdminError("not-found", f"no decision {args.id}")
        trans = [t["id"] for t in self.d.store.transitions(d["job_id"]) if t["decision_id"] == args.id]
        return {**d, "admitted": bool(d["admitted"]), "urgent": bool(d["urgent"]), "transitions": trans}

    def alloc(self, args: protocol.AllocArgs) -> dict[str, Any]:
        """Show allocations; with ``grow``/``shrink`` ask the allocation source for a change, once the
        request was checked against what the job holds (a count within its max, nodes it holds). A shrink
        of nodes a plan uses drains them first: ``draining`` lists the nodes not given back yet."""
        if args.action != "show":
            assert args.job is not None  # AllocArgs requires it for grow/shrink
            if self.d.store.job(args.job) is None:
                raise AdminError("not-found", f"no job {args.job!r}")
            try:
                if args.action == "grow":
                    self.d.source_request("grow", args.job, args.nodes)
                else:
                    self.d.source_request("shrink", args.job, list(args.names or ()))
            except AllocationError as exc:
                raise AdminError("invalid", str(exc)) from None
        return {"source": self.d.source_name, "requested": args.action != "show",
                "draining": sorted(self.d.draining_nodes(args.job)) if args.job else [],
                "allocations": self.d.store.allocations(args.job)}

    def keys(self, args: Any) -> list[dict[str, Any]]:
        return [{"name": k.name, "user": k.user, "role": k.role, "public_key": k.public_key,
                 "created_at": k.created_at} for k in self.d.keys.clients()]

    def events(self, args: Any) -> list[dict[str, Any]]:
        return self.d.store.events(args.job, limit=args.limit)

    def measurements(self, args: protocol.MeasurementsArgs) -> list[dict[str, Any]]:
        """The job's latest step measurements, oldest first (what ``nereusctl plot`` draws)."""
        j = self._job(args)
        keep = ("step", "at", "node", "plan_version", "step_latency_s", "predicted_step_s", "stage_times",
                "response_tokens", "rl")
        return [{k: m.get(k) for k in keep} for m in self.d.store.measurements(j["job_id"], limit=args.limit)]
