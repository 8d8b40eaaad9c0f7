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
- Failover (``_adopt``): a driver started after another one went (a requeued anchor's) finds the workers
  of the surviving nodes re-dialled with their worker ids and units (``agent.hub.WorkerLink``). Before
  its first order it adopts them: the plan they are bound to, the RL steps they reached (which must
  agree, else the state is torn and comes from the checkpoint), the latest committed checkpoint; the
  plan's workers that did not come back are dead, and the order moves the state from the intact
  replicas (or restores it) as after any loss. Steps go on from the step reached.
"""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agent.coordinator import WorkerDied
from agent.hub import HubCoordinator
from planner.errors import NereusError
from planner.plan import GlobalPlan


@dataclass(slots=True)
class _Checkpoint:
    tag: str
    step: int  # steps done when it was saved: the loop resumes here


def adoption_state(ctx: Any) -> dict[str, Any]:
    """What a re-dialled worker holds (runs on the worker): its bound plan, RL steps, torn flag, units."""
    from agent.engine.live import LiveEngine

    engine = ctx.engine
    bound = isinstance(engine, LiveEngine)
    return {"plan": engine.plan if bound else None, "rl_steps": engine.rl_steps if bound else None,
            "updating": bool(bound and engine.loop.updating), "units": sorted(ctx.units)}


def latest_checkpoint(url: str) -> _Checkpoint | None:
    """The newest committed ``stepNNNNNN`` checkpoint under ``url`` (an earlier driver's), or None."""
    from fsspec.core import url_to_fs

    from transitions.checkpoint import is_committed

    fs, path = url_to_fs(url)
    try:
        names = [str(n).rstrip("/").rsplit("/", 1)[-1] for n in fs.ls(path, detail=False)]
    except (FileNotFoundError, OSError):
        return None
    tags = sorted(n for n in names if re.fullmatch(r"step\d{6}", n) and is_committed(url, n))
    return _Checkpoint(tag=tags[-1], step=int(tags[-1][4:])) if tags else None


def renamed_lost(old: GlobalPlan, new: GlobalPlan, lost: set[int]) -> tuple[GlobalPlan, frozenset[int]]:
    """``old`` and ``lost`` for the DAG where ``new`` places units on lost workers' ids again (a node that
    came back, a requeued anchor: new processes under the ids of the dead): in ``old`` those ids become
    spare ones above every id in use, so the dead units are lost there and the new ones are built fresh.
    Unit uids do not depend on GPU ids, so the intact units are the ones the workers hold."""
    again = sorted(lost & set(new.gpus))
    if not again:
        return old, frozenset(lost)
    top = max(set(old.gpus) | set(new.gpus)) + 1
    spare = {g: top + i for i, g in enumerate(again)}
    stages = tuple(dataclasses.replace(sp, gpu_sets=tuple(tuple(spare.get(g, g) for g in gs) for gs in sp.gpu_sets))
                   for sp in old.stages)
    return dataclasses.replace(old, stages=stages), frozenset(spare.get(g, g) for g in lost)


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

    def _adopt(self, new: GlobalPlan, wait_s: float) -> bool:
        """Take over the workers an earlier driver left (see the module's doc); False: none came back.
        Waits (bounded) until every device of ``new`` has said hello, and once any worker re-dialled, every
        device of the order's pool: a survivor still finishing the command the old driver sent re-dials
        when it is done."""
        deadline = time.monotonic() + wait_s
        planned = [k for k, w in self.ids.items() if w in new.gpus]

        def ready() -> bool:
            resumed_any = any(p.resumed for p in self.hub.peers.values())
            return all(k in self.hub.peers for k in (self.ids if resumed_any else planned))

        while not ready() and time.monotonic() < deadline:
            self.hub.pump(0.5)
        resumed = sorted(p.worker_id for p in self.hub.peers.values()
                         if p.resumed and p.worker_id is not None and not self.hub._stale(p))
        if not resumed:
            return False
        try:
            states = self.hub.call(adoption_state, workers=resumed, timeout_s=60.0)
        except WorkerDied as exc:
            self.event("adopt-failed", workers=resumed, error=str(exc)[:2000])
            return False
        plans = {s["plan"].version: s["plan"] for s in states.values() if s["plan"] is not None}
        if not plans:
            self.event("adopt-failed", workers=resumed, error="no re-dialled worker is bound to a plan")
            return False
        plan = plans[max(plans)]
        steps = {int(s["rl_steps"]) for s in states.values() if s["plan"] is not None}
        torn = [w for w, s in states.items() if s["updating"]]
        self.plan, self.version, self.step = plan, plan.version, max(steps)
        self.torn = bool(torn) or len(plans) > 1 or len(steps) > 1  # not one step's state: from the checkpoint
        self.dead = set(plan.gpus) - set(resumed)
        self.broken = True
        self.checkpoint = latest_checkpoint(self.dc.checkpoint_url)
        self.event("adopted", workers=resumed, plan_version=plan.version, step=self.step, dead=sorted(self.dead),
                   torn=self.torn, versions=sorted(plans), steps=sorted(steps),
                   checkpoint=self.checkpoint.tag if self.checkpoint else None)
        if self.dc.verify and not self.torn:
            self._snapshot_of(resumed)
        return True

    if TYPE_CHECKING:  # agent.driver_verify.Verification's
        def _snapshot_of(self, workers: list[int], digests: dict[str, str] | None = None) -> None: ...

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
        """After a failed step: did the survivors begin the step's optimizer updates, or finish the step
        (a peer died before answering)? Then what they hold is not the step the driver is at, and the
        next plan is loaded from the checkpoint instead of moved."""
        from agent.engine.live import torn

        assert self.plan is not None
        alive = [w for w in sorted(self.plan.gpus) if w in self.hub.alive]
        try:
            answers = self.hub.call(torn, workers=alive, timeout_s=60.0, step=self.step)
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
