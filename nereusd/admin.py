"""The admin endpoint's operations: what nereusctl can ask the daemon (admin CURVE keys only).

Each op takes the request's ``args`` and returns plain data (the CLI renders tables or --json).
A bad request raises ``AdminError`` with a protocol error code; the daemon turns it into an
``AdminReply(ok=False)`` and keeps serving.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from planner.errors import NereusError

if TYPE_CHECKING:
    from nereusd.daemon import Daemon


class AdminError(NereusError):
    def __init__(self, code: str, message: str) -> None:
        self.code = code
        super().__init__(message)


def _arg(args: dict[str, Any], name: str, kind: type = str) -> Any:
    if name not in args:
        raise AdminError("invalid", f"missing argument {name!r}")
    try:
        return kind(args[name])
    except (TypeError, ValueError):
        raise AdminError("invalid", f"argument {name!r} must be {kind.__name__}, got {args[name]!r}") from None


class AdminOps:
    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon
        self.ops: dict[str, Callable[[dict[str, Any]], Any]] = {
            "status": self.status, "jobs": self.jobs, "job": self.job, "job-add": self.job_add,
            "job-plan": self.job_plan, "decisions": self.decisions, "transitions": self.transitions,
            "transition": self.transition, "explain": self.explain, "alloc": self.alloc, "keys": self.keys,
            "events": self.events,
        }

    def handle(self, op: str, args: dict[str, Any]) -> Any:
        fn = self.ops.get(op)
        if fn is None:
            raise AdminError("invalid", f"unknown op {op!r} (known: {', '.join(sorted(self.ops))})")
        return fn(args)

    def _job(self, args: dict[str, Any]) -> dict[str, Any]:
        job_id = _arg(args, "job")
        row = self.d.store.job(job_id)
        if row is None:
            known = ", ".join(j["job_id"] for j in self.d.store.jobs()) or "none"
            raise AdminError("not-found", f"no job {job_id!r} (known: {known})")
        return row

    # --- ops ----------------------------------------------------------------------------------------
    def status(self, args: dict[str, Any]) -> dict[str, Any]:
        by_state: dict[str, int] = {}
        for j in self.d.store.jobs():
            by_state[j["state"]] = by_state.get(j["state"], 0) + 1
        nodes = self.d.store.all_nodes()
        return {"pid": os.getpid(), "uptime_s": round(time.monotonic() - self.d.started_monotonic, 3),
                "started_at": self.d.started_at, "state_dir": str(self.d.state_dir), "endpoints": self.d.endpoints,
                "allocation_source": self.d.source.name if self.d.source else None,
                "planner": self.d.planner_name, "jobs": by_state,
                "agents_connected": len(self.d.sessions),
                "nodes": {s: sum(1 for n in nodes if n["state"] == s) for s in ("alive", "lost", "released")},
                "store_schema_migrated_from": self.d.store.migrated_from}

    def jobs(self, args: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        for j in self.d.store.jobs():
            nodes = self.d.store.nodes(j["job_id"])
            ctl = self.d.controllers.get(j["job_id"])
            out.append({"job": j["job_id"], "user": j["user"], "state": j["state"], "slurm_job_id": j["slurm_job_id"],
                        "nodes_alive": sum(n["state"] == "alive" for n in nodes), "nodes": len(nodes),
                        "gpus": len(ctl.pool) if ctl else 0, "plan_version": j["plan_version"],
                        "updated_at": j["updated_at"]})
        return out

    def job(self, args: dict[str, Any]) -> dict[str, Any]:
        j = self._job(args)
        nodes = [{**n, "workers": self.d.worker_states.get((j["job_id"], n["node"]), [])}
                 for n in self.d.store.nodes(j["job_id"])]
        return {**j, "nodes": nodes, "history": self.d.store.history("job", j["job_id"])}

    def job_add(self, args: dict[str, Any]) -> dict[str, Any]:
        job_id, user = _arg(args, "job"), _arg(args, "user")
        spec = args.get("spec") or {}
        if not isinstance(spec, dict):
            raise AdminError("invalid", "argument 'spec' must be an object")
        try:
            self.d.add_job(job_id=job_id, user=user, spec=spec, slurm_job_id=args.get("slurm_job_id"))
        except NereusError as exc:
            raise AdminError("invalid", str(exc)) from None
        return {"job": job_id, "state": "pending"}

    def job_plan(self, args: dict[str, Any]) -> dict[str, Any]:
        j = self._job(args)
        row = self.d.store.plan(j["job_id"])
        last = self.d.store.measurements(j["job_id"], limit=1)
        measured = last[0] if last else None
        stages = []
        if row:
            pred_stages = (row["prediction"] or {}).get("stage_seconds") or {}
            for s in row["plan"]["stages"]:
                name = s["model_stage"]
                stages.append({"model_stage": name, "tp": s["tp"], "pp": s["pp"], "dp": len(s["gpu_sets"]),
                               "gpus": sorted(g for gs in s["gpu_sets"] for g in gs),
                               "micro_batch_size": s["micro_batch_size"], "grad_accum": s["grad_accum"],
                               "predicted_s": pred_stages.get(name),
                               "measured_s": (measured or {}).get("stage_times", {}).get(name)})
        return {"job": j["job_id"], "plan_version": j["plan_version"], "stages": stages,
                "predicted_step_s": (row["prediction"] or {}).get("step_latency_s") if row else None,
                "measured_step_s": measured["step_latency_s"] if measured else None,
                "measured_at_step": measured["step"] if measured else None}

    def decisions(self, args: dict[str, Any]) -> list[dict[str, Any]]:
        j = self._job(args)
        return [{**{k: v for k, v in d.items() if k != "inputs"}, "admitted": bool(d["admitted"]),
                 "urgent": bool(d["urgent"])} for d in self.d.store.decisions(j["job_id"])]

    def transitions(self, args: dict[str, Any]) -> list[dict[str, Any]]:
        j = self._job(args)
        return [{k: v for k, v in t.items() if k != "dag"} for t in self.d.store.transitions(j["job_id"])]

    def transition(self, args: dict[str, Any]) -> dict[str, Any]:
        tid = _arg(args, "id", int)
        t = self.d.store.transition(tid)
        if t is None:
            raise AdminError("not-found", f"no transition {tid}")
        return {**t, "history": self.d.store.history("transition", str(tid))}

    def explain(self, args: dict[str, Any]) -> dict[str, Any]:
        did = _arg(args, "id", int)
        d = self.d.store.decision(did)
        if d is None:
            raise AdminError("not-found", f"no decision {did}")
        trans = [t["id"] for t in self.d.store.transitions(d["job_id"]) if t["decision_id"] == did]
        return {**d, "admitted": bool(d["admitted"]), "urgent": bool(d["urgent"]), "transitions": trans}

    def alloc(self, args: dict[str, Any]) -> dict[str, Any]:
        """Show allocations; with ``grow``/``shrink`` ask the allocation source for a change."""
        job_id = args.get("job")
        action = args.get("action", "show")
        if action != "show":
            if job_id is None or self.d.store.job(str(job_id)) is None:
                raise AdminError("not-found", f"no job {job_id!r}")
            if self.d.source is None:
                raise AdminError("invalid", "the daemon runs without an allocation source")
            if action == "grow":
                self.d.source_request("grow", str(job_id), _arg(args, "nodes", int))
            elif action == "shrink":
                names = args.get("names")
                if not isinstance(names, list) or not names:
                    raise AdminError("invalid", "shrink needs 'names': a non-empty list of node names")
                self.d.source_request("shrink", str(job_id), [str(n) for n in names])
            else:
                raise AdminError("invalid", f"unknown action {action!r} (allowed: show, grow, shrink)")
        return {"source": self.d.source.name if self.d.source else None, "requested": action != "show",
                "allocations": self.d.store.allocations(str(job_id) if job_id else None)}

    def keys(self, args: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"name": k.name, "user": k.user, "role": k.role, "public_key": k.public_key,
                 "created_at": k.created_at} for k in self.d.keys.clients()]

    def events(self, args: dict[str, Any]) -> list[dict[str, Any]]:
        return self.d.store.events(args.get("job"), limit=int(args.get("limit", 200)))
