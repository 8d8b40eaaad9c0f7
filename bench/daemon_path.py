"""A decision as nereusd's controller pays it, from the event arriving to the orders ready. Pure driver.

Used by bench/decisions.py. One JobController per job on a real SQLite store (nereusd.store), with
the daemon's PlannerBinding (nereusd.planning: search, admission, the transition DAG with every
node's part, ``to_dict``, the L_tran correction) shared by the jobs as the daemon shares it. Nodes of
8 H200s register as agents do; ``send_order`` stands in for the socket and stamps the time the last
order is ready. The timed span is the controller's own: ``on_measurement`` (stored, calibrated) or
``on_node_lost`` / ``on_node_joined``, then ``step()`` (trigger, replan, admission, DAG, the decision,
plan and transition rows written, one order per node). Acknowledging an ordered transition (untimed)
goes through the controller's own report handling, once per node (``reports_cpu_ms``: what the
parts' reports cost the controller, apart from the decision).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from nereusd.controller import JobController
from nereusd.metrics import Metrics
from nereusd.planning import PlannerBinding
from nereusd.store import Store
from nereusd.wire import protocol
from planner import admission

GPUS_PER_NODE = 8
_DEVICES = [{"index": i, "kind": "gpu", "name": "h200", "memory_bytes": 141 << 30} for i in range(GPUS_PER_NODE)]


class _Quiet:
    """The controller's log, discarded (the bench prints JSON only)."""

    def bind(self, **_: Any) -> _Quiet:
        return self

    def info(self, *_: Any, **__: Any) -> None:
        pass

    warning = error = debug = info


def job_spec(model: str, response_tokens: int = 3072) -> dict[str, Any]:
    return {"model": model, "algo": "ppo", "device": "h200", "gpus_per_node": GPUS_PER_NODE,
            "workload": {"prompts_per_step": 1024, "prompt_tokens": 1024, "response_tokens": response_tokens}}


class DaemonJob:
    """One job under a controller, its nodes named n0000.. in registration order."""

    def __init__(self, model: str, nodes: int, binding: PlannerBinding, state_dir: Path | None = None,
                 response_tokens: int = 3072) -> None:
        self.dir = state_dir or Path(tempfile.mkdtemp(prefix="nereus-bench-"))
        self.store = Store(self.dir / "state.db")
        self.binding = binding
        self.orders: list[tuple[str, protocol.TransitionOrder]] = []
        self.last_order_at = 0.0
        self.step_no = 10
        if self.store.job("j") is None:
            self.store.add_job(job_id="j", user="bench", spec=job_spec(model, response_tokens))
        self.next_node = len(self.store.nodes("j"))  # a store reopened by a fresh daemon keeps its nodes
        self.ctl = self._controller()
        for _ in range(nodes):
            self.join()

    def _controller(self) -> JobController:
        def send(node: str, order: protocol.TransitionOrder) -> bool:
            self.orders.append((node, order))
            self.last_order_at = time.perf_counter()
            return True

        return JobController(job_id="j", store=self.store, metrics=Metrics(), planner=self.binding, gamma=0.5,
                             thresholds=dict(admission.DEFAULT_THRESHOLDS), log=_Quiet(), send_order=send)

    def join(self) -> None:
        name = f"n{self.next_node:04d}"
        self.next_node += 1
        self.store.register_node(job_id="j", node=name, devices=_DEVICES, slurm_job_id=None, host=name,
                                 incarnation="1")
        self.ctl.on_node_joined(name, "new")

    def gpus(self) -> int:
        return len(self.ctl.pool)

    def finish(self) -> float | None:
        """Every node reports its part of the ordered transition done, through the controller's own
        ``on_transition_report`` (untimed in the decision's figures); returns the CPU ms those reports
        cost the controller (None: nothing was ordered)."""
        if not self.orders:
            return None
        tid = self.orders[0][1].transition_id
        c0 = time.process_time()
        for node in dict.fromkeys(n for n, _ in self.orders):
            self.ctl.on_transition_report(protocol.TransitionReport(job_id="j", node=node, transition_id=tid, ok=True,
                                                                    measured_s=1.0))
        took = (time.process_time() - c0) * 1e3
        t = self.store.transition(tid)
        assert t is not None and t["state"] == "done", t
        self.orders.clear()
        return took

    def _timed(self, case: str, event: Any) -> dict[str, Any]:
        before = {d["id"] for d in self.store.decisions("j")}
        shapes = self.binding.planning_cache.class_shapes
        shapes_before = len(shapes)
        self.last_order_at = 0.0
        t0, c0 = time.perf_counter(), time.process_time()
        event()
        did = self.ctl.step()
        t1, c1 = time.perf_counter(), time.process_time()
        dec = self.store.decision(did) if did is not None and did not in before else None
        ordered = len(self.orders)
        end = self.last_order_at if ordered else t1
        row = {"case": case, "gpus": self.gpus(), "ms": round((end - t0) * 1e3, 2),
               "cpu_ms": round((c1 - c0) * 1e3, 2), "step_ms": round((t1 - t0) * 1e3, 2), "orders": ordered,
               "decided": dec is not None, "admitted": bool(dec and dec["admitted"]), "rule": dec and dec["rule"],
               "decision_ms": dec and round(dec["decision_ms"], 2),
               # replica-class shapes whose footprints this decision derived (0: every target shape was
               # met before in this process; the memo empties when full, hence the floor)
               "new_class_shapes": max(0, len(shapes) - shapes_before)}
        reports = self.finish()
        row["reports_cpu_ms"] = None if reports is None else round(reports, 2)
        return row

    def place(self) -> dict[str, Any]:
        return self._timed("initial-placement", lambda: None)

    def new_length(self, response_tokens: int) -> dict[str, Any]:
        """A step measurement whose mean response length was never seen (a sequence-length drift)."""
        self.step_no += 1
        plan = self.ctl.plan
        assert plan is not None
        msg = protocol.Measurement(job_id="j", node="n0000", step=self.step_no, plan_version=plan.version,
                                   step_latency_s=400.0, stage_times_s={}, response_tokens=response_tokens)
        return self._timed("new-response-length", lambda: self.ctl.on_measurement(msg))

    def grow(self, nodes: int) -> dict[str, Any]:
        """``nodes`` new agents register: a GPU count never seen."""
        def event() -> None:
            for _ in range(nodes):
                self.join()
        return self._timed("new-gpu-count", event)

    def lose(self, node: str) -> dict[str, Any]:
        """One node's heartbeats stop: its units' state is gone, the DAG rebuilds from the survivors."""
        def event() -> None:
            self.store.set_node_state("j", node, "lost", "bench: heartbeats missed")
            self.ctl.on_node_lost(node, "bench: heartbeats missed")
        return self._timed("node-loss", event)
