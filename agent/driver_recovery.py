"""The job driver's recovery (``agent.driver.JobDriver`` mixes it in): what it does when a step,
a transition or a worker fails.

- A failed command leaves the survivors in a new generation (``_after_failure``); the plan waits for
  the daemon's replan, or is bound again where nobody died (``_rebind``).
- A step that failed after its optimizer updates began leaves torn state (``_check_torn``): the next
  plan is loaded from the latest checkpoint instead of moved.
- Where the last copy of some state is gone, it comes back from the latest DCP checkpoint
  (``_restore``, saved every ``checkpoint_every`` steps by ``_checkpoint``) and the steps after it
  run again.
- A worker its agent restarted in place (the pool is unchanged: no order comes) is noticed by
  ``_restarted_in_place``; the driver then Extends the current plan onto it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from agent.coordinator import WorkerDied
from agent.hub import HubCoordinator
from planner.errors import NereusError
from planner.plan import GlobalPlan


@dataclass(slots=True)
class _Checkpoint:
    tag: str
    step: int  # steps done when it was saved: the loop resumes here


class Recovery:
    """The recovery half of ``JobDriver`` (its state is the driver's: declared here for the checker)."""

    cfg: Any
    hub: HubCoordinator
    dc: Any  # agent.driver.DriverConfig
    log: Any
    plan: GlobalPlan | None
    version: int
    ids: dict[tuple[str, int], int]
    dead: set[int]
    broken: bool
    torn: bool
    step: int
    checkpoint: _Checkpoint | None

    def event(self, kind: str, **data: Any) -> None:
        raise NotImplementedError

    def _cfg_now(self) -> Any:
        raise NotImplementedError

    def _restore(self, new: GlobalPlan, why: str, live_units: Any) -> None:
        if self.checkpoint is None:
            raise WorkerDied(f"the last copy of some state is gone ({why}) and no checkpoint exists yet")
        self.hub.load_checkpoint(self.dc.checkpoint_url, self.checkpoint.tag, live_units(self.cfg, new),
                                 workers=sorted(new.gpus))
        self.event("restored", tag=self.checkpoint.tag, step=self.checkpoint.step, reason=why)
        self.step = self.checkpoint.step

    def _after_failure(self) -> None:
        """Survivors leave the broken generation (their units stay); the plan waits for a replan."""
        self.broken = True
        members = self.hub.spec.members if self.hub.spec is not None else ()
        self.dead |= {w for w in members if self.hub.is_dead(w)}
        self.hub.forget(self.dead)
        survivors = [w for w in members if w not in self.dead]
        if survivors:
            try:
                self.hub.form_generation(survivors)
            except WorkerDied as exc:
                self.log.warning("survivor-generation-failed", error=str(exc))

    def _check_torn(self) -> None:
        """After a failed step: did the survivors begin the step's optimizer updates? Then what they
        hold is part of a step, and the next plan is loaded from the checkpoint instead of moved."""
        from agent.engine.live import torn

        assert self.plan is not None
        alive = [w for w in sorted(self.plan.gpus) if w in self.hub.alive]
        try:
            answers = self.hub.call(torn, workers=alive, timeout_s=60.0)
        except WorkerDied:
            answers = {0: True}  # cannot tell: assume the worst
        if any(answers.values()):
            self.torn = True
            self.event("torn", step=self.step, workers=sorted(w for w, t in answers.items() if t))

    def _rebind(self) -> None:
        """Bind the current plan again on its workers after a failure that killed nobody; where a failed
        DAG had already destroyed some of the plan's units, they come back from the checkpoint."""
        from agent.engine.live import bind, live_units

        assert self.plan is not None
        workers = sorted(self.plan.gpus)
        try:
            self.hub.form_generation(workers)
            try:
                if self.torn:
                    raise WorkerDied("units: a step failed after its optimizer updates began (torn state)")
                self.hub.call(bind, workers=workers, timeout_s=self.dc.step_timeout_s, collective=True, cfg=self._cfg_now(),
                              plan=self.plan)
            except WorkerDied as exc:
                if "units" not in str(exc):
                    raise
                self.hub.form_generation(workers)
                self._restore(self.plan, "units of the running plan were destroyed by a failed DAG", live_units)
                self.hub.call(bind, workers=workers, timeout_s=self.dc.step_timeout_s, collective=True, cfg=self._cfg_now(),
                              plan=self.plan)
        except (WorkerDied, NereusError) as exc:
            self.event("rebind-failed", error=str(exc)[:2000])
            self._after_failure()
            return
        self.broken = self.torn = False
        self.event("rebound", plan_version=self.version, workers=workers, step=self.step)

    def _restarted_in_place(self) -> bool:
        """Every dead worker of the plan has a live process on its device again (its agent restarted it)."""
        self.hub.pump(0.0)
        by_id = {w: k for k, w in self.ids.items()}
        for w in self.dead:
            peer = self.hub.peers.get(by_id.get(w, ("", -1)))
            if peer is None or peer.worker_id is not None or self.hub._stale(peer):
                return False
        return bool(self.dead)

    def _checkpoint(self) -> None:
        assert self.plan is not None
        tag = f"step{self.step:06d}"
        try:
            t0 = time.perf_counter()
            self.hub.save_checkpoint(self.dc.checkpoint_url, tag, workers=sorted(self.plan.gpus))
        except WorkerDied as exc:
            self.event("checkpoint-failed", tag=tag, error=str(exc)[:2000])
            self._after_failure()
            return
        self.checkpoint = _Checkpoint(tag=tag, step=self.step)
        self.event("checkpoint", tag=tag, step=self.step, seconds=time.perf_counter() - t0)
