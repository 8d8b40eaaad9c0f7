"""The job controller's transitions in flight (``JobController`` mixes it in): an admitted decision
ordered to every alive node, stored as ordered before any order leaves; an order sent again to a node
that registers again (rebuilt, DAG parts included, when an earlier daemon ordered it); the nodes'
reports; and the end, in one commit with what follows from it (the plan committed, or an urgent
replan with back-off after a failure). Order timeouts fail a transition that no node finishes.
"""

from __future__ import annotations

import time
from typing import Any

from nereusd.controller_parts import ControllerState
from nereusd.plan_records import TransitionObserver, TransitionSketch, _latency, plan_from_dict, plan_to_dict
from nereusd.wire import protocol
from planner import admission
from planner.errors import InfeasibleError, NereusError, SpecError
from planner.plan import GlobalPlan

RETRY_BASE_S, RETRY_MAX_S = 1.0, 60.0  # replan back-off after the 1st, 2nd, ... failed transition in a row


class TransitionOrders(ControllerState):
    """Ordering, re-sending, reporting and finishing the job's transitions (its state is the controller's)."""

    def check_order_timeouts(self, timeout_s: float, now: float | None = None) -> None:
        """Fail every ordered transition older than ``timeout_s`` (wall time, as the store keeps it): the job
        goes back to running and the next pass replans urgently. No transition stays ordered forever."""
        now = time.time() if now is None else now
        for t in self.store.open_transitions(self.job_id):
            if t["state"] == "ordered" and now - float(t["created_at"]) > timeout_s:
                late = ", ".join(t["parts_pending"]) or "none"
                self._finish_transition(t, ok=False, reason=f"node(s) {late} did not finish within {timeout_s:g} s")

    def resend_orders(self, node: str) -> int:
        """Orders the node has not reported, sent again (its agent registered again: restarted, reconnected,
        or the daemon restarted); returns how many."""
        sent = 0
        driver_side = self._holds_driver(node)
        for t in self.store.open_transitions(self.job_id):
            if t["state"] != "ordered" or (node not in t["parts_pending"] and not driver_side):
                continue
            order = self._orders.get(t["id"], {}).get(node) or self._rebuild_order(t, node)
            if order is not None and "incarnations" in order.part:
                # the agents of now (one just registered again): its workers are the ones to take
                now = {n["node"]: n["incarnation"] for n in self.store.node_states(self.job_id)
                       if n["node"] in order.part["incarnations"]}
                order = order.model_copy(update={"part": {**order.part, "incarnations": now}})
            if order is not None and self.send_order(node, order):
                sent += 1
                self.log.info("order-resent", transition=t["id"], node=node)
        return sent

    def _holds_driver(self, node: str) -> bool:
        """The node is the anchor Slurm job's (the job's driver runs there): a requeued anchor's new driver
        takes over the open orders, its own node a part of them or not (agent.driver adopts the survivors)."""
        anchor = self.job.get("slurm_job_id")
        row = self.store.node(self.job_id, node)
        return bool(anchor) and row is not None and str(row.get("slurm_job_id")) == str(anchor)

    def on_transition_report(self, msg: protocol.TransitionReport) -> None:
        t = self.store.transition(msg.transition_id)
        if t is None or t["job_id"] != self.job_id or t["state"] != "ordered":
            self.log.warning("stale-transition-report", transition=msg.transition_id, node=msg.node)
            return
        if not msg.ok:
            self._finish_transition(t, ok=False, reason=f"node {msg.node}: {msg.error}")
            return
        pending = [n for n in t["parts_pending"] if n != msg.node]
        measured = max(float(t["measured_s"] or 0.0), msg.measured_s)
        # the last part and the transition's end in one commit: a daemon killed between them came back
        # with every part done and the transition still ordered, which nothing would ever finish
        with self.store.transaction():
            self.store.set_transition_state(t["id"], "ordered", f"{msg.node} done", measured_s=measured,
                                            parts_pending=pending)
            if not pending:
                self._finish_transition_rows(self.store.transition(t["id"]) or t, ok=True, reason="every part done")

    def _order_restore(self, decision_id: int, restore: admission.Candidate, exc: InfeasibleError) -> None:
        """Order ``restore``'s plan with no DAG: the driver finds the last copy gone too and loads the
        plan's units from its checkpoint. Its time is not a transition's (L_tran learns nothing from it)."""
        parts: dict[str, dict[str, Any]] = {}
        for gpu in sorted(restore.plan.gpus):
            parts.setdefault(self._node_of_gpu(gpu), {"gpus": []})["gpus"].append(gpu)
        dag = {"kind": "restore", "new_version": restore.plan.version,
               "reasons": list(exc.reasons) or [str(exc).splitlines()[0]]}
        self.store.add_plan(job_id=self.job_id, version=restore.plan.version, plan=plan_to_dict(restore.plan),
                            prediction=admission._plain(restore.prediction))
        self._order(decision_id, restore.plan, restore.prediction,
                    TransitionSketch(predicted_s=0.0, bytes_moved=0, dag=dag, parts=parts))

    def _order(self, decision_id: int, new_plan: GlobalPlan, prediction: Any, sketch: TransitionSketch | None) -> None:
        sketch = sketch or TransitionSketch(predicted_s=0.0, bytes_moved=0, dag={})
        states = self.store.node_states(self.job_id)
        alive = [n["node"] for n in states if n["state"] == "alive"]
        from_version = self.plan.version if self.plan else 0
        # Stored as ordered (and the job as transitioning) in one commit *before* any order leaves: a
        # daemon killed in between comes back knowing the transition its agents may already be running.
        with self.store.transaction():
            tid = self.store.add_transition(job_id=self.job_id, decision_id=decision_id, from_version=from_version,
                                            to_version=new_plan.version, dag=sketch.dag,
                                            bytes_moved=sketch.bytes_moved, predicted_s=sketch.predicted_s,
                                            parts=alive)
            self.store.set_transition_state(tid, "ordered", f"sent to {len(alive)} node(s)")
            self._set_state("transitioning", f"transition {tid} ordered (v{from_version} -> v{new_plan.version})")
        self.metrics.transition_cost.labels("predicted").observe(sketch.predicted_s)
        self._pending_prediction = prediction
        orders = self._orders[tid] = {}
        shared = self._order_common(new_plan, states)  # the nodes' rows as read above (no write touched them)
        for node in alive:
            orders[node] = self._make_order(tid, from_version, new_plan, sketch.parts.get(node, {}), shared)
            self.send_order(node, orders[node])
        if sketch.detail is not None:  # the DAG record's body, for nereusctl and the simulator: no order waits
            self.store.add_transition_detail(tid, sketch.detail())

    def _order_common(self, new_plan: GlobalPlan, states: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """What every node's part carries: the plan, the pool map (node -> global GPU ids of every alive node,
        draining ones included), gpus_per_node and the draining nodes. With the map the job's driver turns
        (node, device index) into the global GPU id, which is the worker id. ``states``: the job's
        Store.node_states, where the caller has just read them."""
        pool: dict[str, list[int]] = {}
        for gpu, owner in sorted(self.gpu_owner.items()):
            pool.setdefault(owner, []).append(gpu)
        # each node's agent incarnation: a driver takes only workers that agent started (a node released
        # and granted again has new workers; the old ones' beats may not have stopped yet)
        states = self.store.node_states(self.job_id) if states is None else states
        incarnations = {n["node"]: n["incarnation"] for n in states if n["node"] in pool}
        return {"plan": plan_to_dict(new_plan), "pool": pool, "gpus_per_node": self.gpus_per_node,
                "draining": sorted(self.draining), "incarnations": incarnations}

    def _make_order(self, tid: int, from_version: int, new_plan: GlobalPlan, node_part: dict[str, Any],
                    shared: dict[str, Any]) -> protocol.TransitionOrder:
        part = {"plan": shared["plan"], **node_part, **{k: v for k, v in shared.items() if k != "plan"}}
        return protocol.TransitionOrder(job_id=self.job_id, transition_id=tid, from_version=from_version,
                                        to_version=new_plan.version, part=part)

    def _rebuild_order(self, t: dict[str, Any], node: str) -> protocol.TransitionOrder | None:
        """The order of a transition ordered by an earlier daemon (this one kept no copy): the same plan and
        pool map, and the DAG parts built again (the build is deterministic). The build is done once per
        transition, for every node it still waits on: each node registering again after a restart then
        finds its order kept, instead of the serve loop building the whole DAG once per node."""
        row = self.store.plan(self.job_id, t["to_version"])
        if row is None:
            return None
        new = plan_from_dict(row["plan"])
        old_row = self.store.plan(self.job_id, t["from_version"]) if t["from_version"] else None
        parts: dict[str, dict[str, Any]] = {}
        self._refresh_pool()  # the pool map of now, whether or not a planner is bound to build the DAG again
        if self.planner is not None:
            try:
                sketch = self.planner.transition(self._spec_now(), plan_from_dict(old_row["plan"]) if old_row else None,
                                                 new, self._participants(), self._node_of_gpu)
                parts = dict(sketch.parts)
            except (InfeasibleError, SpecError) as exc:
                self.log.warning("order-rebuild-without-dag", transition=t["id"], error=str(exc))
        shared = self._order_common(new)
        kept = self._orders.setdefault(int(t["id"]), {})
        for pending in {*t["parts_pending"], node}:
            kept[pending] = self._make_order(int(t["id"]), int(t["from_version"]), new, parts.get(pending, {}), shared)
        return kept[node]

    def _finish_transition(self, t: dict[str, Any], *, ok: bool, reason: str) -> None:
        """The transition ends, in one commit with what follows from it (the plan version committed, the
        job running again): a daemon killed in between comes back with all of it or none of it (a kill
        between the transition's row and the plan's left a done transition under a job stuck transitioning)."""
        with self.store.transaction():
            self._finish_transition_rows(t, ok=ok, reason=reason)

    def _finish_transition_rows(self, t: dict[str, Any], *, ok: bool, reason: str) -> None:
        self.store.set_transition_state(t["id"], "done" if ok else "failed", reason)
        self._orders.pop(int(t["id"]), None)
        self.metrics.transitions.labels(self.job_id, "done" if ok else "failed").inc()
        if ok:
            self.failed_in_row, self.retry_at = 0, -float("inf")
            self.metrics.transition_cost.labels("measured").observe(float(t["measured_s"] or 0.0))
            self.metrics.transition_bytes.labels(self.job_id).inc(int(t["bytes_moved"]))
            self._observe_transition(self.store.transition(t["id"]) or t)
            row = self.store.plan(self.job_id, t["to_version"])
            if row is not None:
                self.plan = plan_from_dict(row["plan"])
                self.store.commit_plan_version(self.job_id, self.plan.version)
                self.prediction = self._pending_prediction or self._predict(self.plan)
                if self.prediction is not None:
                    self.metrics.step_latency.labels(self.job_id, "predicted").set(_latency(self.prediction) or 0)
        else:
            self.pool_dirty = True  # a lost node changes the pool, which triggers the next replan ...
            # ... and a failure with the pool unchanged (a part failed, an order timed out) replans too
            self.urgent_reasons.append(f"transition {t['id']} failed: {reason}")
            self.urgent_reasons.extend(f"drain {n}" for n in self.draining if n not in self._release_asked)
            self.failed_in_row += 1
            backoff = min(RETRY_MAX_S, RETRY_BASE_S * 2 ** (self.failed_in_row - 1))
            self.retry_at = self.clock() + backoff
            self.log.warning("transition-failed", transition=t["id"], reason=reason, failed_in_row=self.failed_in_row,
                             retry_in_s=backoff)
        if self.job["state"] == "transitioning":
            alive = self.store.count_nodes(self.job_id, "alive") > 0
            self._set_state("running" if alive else "lost", f"transition {t['id']} {'done' if ok else 'failed'}")

    def _observe_transition(self, t: dict[str, Any]) -> None:
        if not isinstance(self.planner, TransitionObserver):
            return
        if (t.get("dag") or {}).get("kind") == "restore":
            return  # no DAG ran: a checkpoint load says nothing about L_tran
        try:
            self.planner.observe_transition(self._spec_now(), t)
        except NereusError as exc:  # a malformed row must not stop the daemon; the correction stays as it was
            self.log.warning("transition-calibration-skipped", transition=t.get("id"), error=str(exc))
