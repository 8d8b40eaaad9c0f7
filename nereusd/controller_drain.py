"""The job controller's graceful releases (``JobController`` mixes it in): a drained node stays alive
and takes part in the transition that moves its state away, while its GPUs leave the pool plans are
made for; once no plan, committed or ordered, uses it, the allocation source is asked to take it. A
drain that would leave no GPU, or no plan that fits, is refused and changes nothing.
"""

from __future__ import annotations

from nereusd.allocation import AllocationError
from nereusd.controller_parts import ControllerState
from nereusd.plan_records import plan_from_dict
from planner.errors import InfeasibleError, SpecError


class Drains(ControllerState):
    """Draining nodes and giving them back (its state is the controller's)."""

    def drain(self, nodes: list[str], reason: str) -> list[str]:
        """A graceful release of ``nodes``: returns those the source may take at once (no plan, committed or
        ordered, uses them); the others drain first: an urgent replan on the pool without them, a transition
        ordered to every alive node (the draining ones send their state away), and the source is asked to
        release them once that transition is done (``step``). A drain that would leave no GPU, or no plan
        that fits, is refused with AllocationError and changes nothing."""
        before = self.pool
        self._refresh_pool()
        if self.pool != before:
            self.pool_changed_at = self.clock()
        used = self._gpus_in_use()
        new = [n for n in dict.fromkeys(nodes) if n not in self.draining]
        now = [n for n in new if not (self._gpus_of(n) & used)]
        later = [n for n in new if n not in now]
        if later:
            what = f"drain {', '.join(later)} of job {self.job_id}"
            remaining = frozenset(g for g, n in self.gpu_owner.items() if n not in self.draining and n not in new)
            if not remaining:
                raise AllocationError(f"{what}: no GPU would be left to hold the job's state; the node(s) stay "
                                      "(give the job more nodes first, or end the job)")
            if self.planner is None:
                raise AllocationError(f"{what}: no planner is bound to the daemon to plan without them")
            try:
                self.planner.search(self._spec_now(), remaining, self.store.max_plan_version(self.job_id) + 1)
            except (InfeasibleError, SpecError) as exc:
                raise AllocationError(f"{what}: no plan fits on the {len(remaining)} GPU(s) left ("
                                      f"{str(exc).splitlines()[0]}); the node(s) stay") from None
        for n in new:
            self.draining[n] = reason
        self._release_asked.update(now)
        if later:
            self.urgent_reasons.extend(f"drain {n}" for n in later)
            self.store.add_event("node-draining", {"nodes": later, "reason": reason}, job_id=self.job_id)
            self.log.info("node-draining", nodes=later, reason=reason)
        if new:
            self.pool_dirty = True
            self._save()
        return now

    def on_release_refused(self, nodes: list[str], reason: str) -> None:
        """The source refused to give drained nodes back: they stay in the job and rejoin its pool."""
        back = [n for n in nodes if self.draining.pop(n, None) is not None]
        self._release_asked.difference_update(nodes)
        if back:
            self.pool_dirty = True
            self._save()

    def drained(self, node: str) -> bool:
        """The node was drained and its release asked of the source: no plan uses it any more."""
        return node in self._release_asked

    def on_node_left(self, node: str, reason: str) -> None:
        """A drained node that goes by itself (Slurm takes it: a preemption, a time limit): released in the
        store without asking the source, and no longer draining."""
        self.store.set_node_state(self.job_id, node, "released", reason)
        self._release_asked.discard(node)
        if self.draining.pop(node, None) is not None:
            self._save()
        self.pool_dirty = True

    def _release_drained(self) -> None:
        """Ask the source for the draining nodes that no plan uses any more (none while a transition is open)."""
        waiting = [n for n in self.draining if n not in self._release_asked]
        if not waiting or self.release_nodes is None or self.store.open_transitions(self.job_id):
            return
        used = self._gpus_in_use()
        ready = [n for n in waiting if not (self._gpus_of(n) & used)]
        if ready:
            self._release_asked.update(ready)
            self.store.add_event("node-drained", {"nodes": ready, "plan_version": self.plan.version if self.plan
                                                  else None}, job_id=self.job_id)
            self.log.info("node-drained", nodes=ready)
            self.release_nodes(ready)

    def _refuse_drain(self, nodes: list[str], decision_id: int) -> None:
        """The drain's replan ordered no transition (nothing fit, or no DAG reaches it): the nodes stay."""
        if not nodes:
            return
        d = self.store.decision(decision_id) or {}
        reason = f"decision {decision_id} ordered no transition away from them: {d.get('reason', '?')}"
        for n in nodes:
            self.draining.pop(n, None)
        self.pool_dirty = True
        self._save()
        self.store.add_event("alloc-refused", {"op": "shrink", "nodes": nodes, "reason": reason}, job_id=self.job_id)
        self.log.warning("alloc-refused", op="shrink", nodes=nodes, reason=reason)

    def _gpus_of(self, node: str) -> set[int]:
        return {g for g, n in self.gpu_owner.items() if n == node}

    def _gpus_in_use(self) -> set[int]:
        """GPUs of the committed plan and of the plans of ordered transitions."""
        used = set(self.plan.gpus) if self.plan is not None else set()
        for t in self.store.open_transitions(self.job_id):
            row = self.store.plan(self.job_id, t["to_version"]) if t["state"] == "ordered" else None
            if row is not None:
                used |= plan_from_dict(row["plan"]).gpus
        return used
