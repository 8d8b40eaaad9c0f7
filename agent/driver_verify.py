"""The job driver's check that transitions keep the state (``agent.driver.JobDriver`` mixes it in;
``--verify``): after every step and transition the logical digests of every tensor of the stateful
model-stages (weights, AdamW moments, counters), assembled from all workers' shards
(``transitions.executor.logical``), are kept, those of checkpointed steps longer (a restore is
checked against them), and each transition's result is compared with the step it moved.
"""

from __future__ import annotations

from typing import Any

from agent.coordinator import WorkerDied
from agent.hub import HubCoordinator
from planner.plan import GlobalPlan
from transitions.executor.logical import logical_digests


class Verification:
    """The verification half of ``JobDriver`` (its state is the driver's: declared here for the checker)."""

    hub: HubCoordinator
    dc: Any  # agent.driver.DriverConfig
    plan: GlobalPlan | None
    version: int
    step: int
    checkpoint: Any  # agent.driver_recovery._Checkpoint | None
    snapshots: dict[int, dict[str, str]]
    _verified_digests: dict[str, str] | None

    def event(self, kind: str, **data: Any) -> None:
        raise NotImplementedError

    def _snapshot(self) -> None:
        """Keep the logical digests of the state now (after a step or transition): the latest, and
        those of checkpointed steps (a restore is checked against them)."""
        assert self.plan is not None
        self._snapshot_of(sorted(self.plan.gpus))

    def _snapshot_of(self, workers: list[int], digests: dict[str, str] | None = None) -> None:
        """``digests``: the state's, when the caller has just taken them (a transition's verification)."""
        keep = {self.checkpoint.step} if self.checkpoint is not None else set()
        self.snapshots = {s: d for s, d in self.snapshots.items() if s in keep}
        if digests is None:
            try:
                digests = logical_digests(self.hub.dump(workers))
            except WorkerDied as exc:  # a node went just now: the next step fails and recovery takes it
                self.event("snapshot-skipped", step=self.step, error=str(exc))
                return
        self.snapshots[self.step] = digests
        # in the events too: a later driver's (failover) state is checked against them
        self.event("snapshot", step=self.step, plan_version=self.version, digests=digests)

    def _verify(self, new: GlobalPlan) -> dict[str, Any] | None:
        """Every logical tensor after the transition equals what the old layout held at this step."""
        if not self.dc.verify:
            return None
        want = self.snapshots.get(self.step)
        got = self._verified_digests = logical_digests(self.hub.dump(sorted(new.gpus)))
        if want is None:
            return {"equal": None, "why": f"no snapshot of step {self.step}"}
        differ = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
        return {"equal": not differ, "tensors": len(got), "differ": differ[:8]}
