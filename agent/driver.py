"""The job driver: runs one RL job's step loop on the workers the node agents started, under nereusd.

    python -m agent.driver --job-file etc/jobs/live.toml     # started by the anchor node's agent

The anchor node's agent starts it (``--driver-cmd``) with the agent's relay in its environment: the
driver's measurements go to the daemon through that agent, and the daemon's transition orders come
back through it. Workers of every node dial the driver (``agent.hub``); the driver hosts the
generations' rendezvous store and commands them:

1. The first order (initial placement) says the plan and the pool (node -> global GPU ids): the
   driver gives each (node, device) its worker id, forms a generation of the plan's workers and binds
   the engine on fresh EMU units (``agent.engine.live.bind``).
2. Every step is one ``train_step`` on every worker of the plan; the step's per-stage times, peak
   memory and response lengths go to the daemon as a Measurement (the calibration's input).
3. At the end of each step (the safe point) the driver looks for an order. An order moves the live
   state: a generation of the old and new plan's workers runs the TransitionDAG old -> new (Split,
   Merge, Extend onto joining workers, Destroy), the engine binds on the new plan over the moved
   buffers, and each worker reports its part (measured time, bytes) to its agent, so the daemon sees
   the transition done and learns L_tran from it.
4. A worker that dies (a killed process, a node gone) fails the step: the survivors form a new
   generation and the driver waits for the daemon's replan, which it runs from the intact replicas
   (the dead workers' units are lost). Where the last copy of some state is gone, the state comes
   back from the latest DCP checkpoint (every ``--checkpoint-every`` steps) and the steps after it are
   run again. A worker that its agent restarted in place (the pool is unchanged, so no order comes)
   receives its state by an Extend of the current plan onto it after ``--heal-after-s``
   (``agent.driver_recovery``).
5. Failover: the driver runs on the anchor's first node, and goes with it (a requeue). The workers of the
   surviving nodes keep their units and dial the driver published after it (NEREUS_DRIVER_FILE); a new
   driver adopts them before its first order: their plan, the RL steps they reached (a torn or
   disagreeing state comes from the checkpoint), the latest committed checkpoint; the order then moves
   the state from the intact replicas as after any loss (``agent.driver_recovery``), and the steps go on
   from the step reached.
6. Each step's RL figures (reward, KL, entropy, lengths, clip fractions, tokens/s, pool) go to
   ``--metrics-dir`` as metrics.jsonl and TensorBoard files, and with the Measurement to the daemon
   (``agent.metrics``).

Every wait is bounded (``--assign-timeout-s``, ``--order-wait-s``); a step or transition that
fails is reported, never left hanging. ``--events FILE`` writes one JSON line per step, transition
and recovery (what ``python -m nereusd.live`` displays).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.coordinator import WorkerDied
from agent.driver_recovery import Recovery, _Checkpoint, renamed_lost
from agent.driver_verify import Verification
from agent.hub import HubCoordinator
from nereusd.wire import protocol
from nereusd.wire.logs import configure_logging, get_logger
from planner.errors import NereusError
from planner.plan import GlobalPlan, Layout, StagePlan


def plan_from_part(data: dict[str, Any]) -> GlobalPlan:
    """The plan of an order's part (nereusd.controller.plan_to_dict's form)."""
    return GlobalPlan(version=int(data["version"]), stages=tuple(
        StagePlan(model_stage=s["model_stage"], layout=Layout(int(s["tp"]), int(s["pp"])),
                  gpu_sets=tuple(tuple(int(g) for g in gs) for gs in s["gpu_sets"]),
                  micro_batch_size=int(s["micro_batch_size"]), grad_accum=int(s.get("grad_accum", 1)),
                  recompute=bool(s.get("recompute", False)))
        for s in data["stages"]))


@dataclass(kw_only=True, slots=True)
class DriverConfig:
    steps: int
    checkpoint_url: str
    checkpoint_every: int = 5
    events_path: Path | None = None
    response_schedule: dict[int, int] = field(default_factory=dict)  # step -> max_new_tokens from then on
    assign_timeout_s: float = 300.0  # workers of a granted node import torch and dial in
    order_wait_s: float = 600.0  # the longest the driver waits for an order it needs
    heal_after_s: float = 20.0  # a dead worker, no order: Extend the current plan onto its restart
    step_timeout_s: float = 900.0
    # a JSON file ({"max_new_tokens": N, "steps": S}) read at every safe point: the workload changes from the
    # next step on, the run ends at S (how `make run` plays a response-length jump when it wants one, and ends
    # once its story is told)
    workload_path: Path | None = None
    # after every step and transition, hash every logical tensor of the stateful model-stages (weights,
    # AdamW moments, counters) assembled from all workers' shards, and check that a transition kept them
    verify: bool = False
    metrics_dir: Path | None = None  # metrics.jsonl and TensorBoard files (agent.metrics); None: none


class JobDriver(Recovery, Verification):
    def __init__(self, cfg: Any, hub: HubCoordinator, link: Any, dc: DriverConfig, *, job_id: str,
                 node: str) -> None:
        self.cfg, self.hub, self.link, self.dc = cfg, hub, link, dc
        self.job_id, self.node = job_id, node
        self.log = get_logger("driver", job=job_id)
        self.plan: GlobalPlan | None = None  # in worker ids (the daemon's GPU ids)
        self.version = 0
        self.ids: dict[tuple[str, int], int] = {}  # (node, device) -> worker id, from the latest order
        self.dead: set[int] = set()  # workers of the plan that died since it was bound
        self.incarnations: dict[str, str] = {}  # node -> agent incarnation, from the latest order
        self.broken = False  # the engine's binding is gone (a failed command re-formed the generation)
        self.torn = False  # a step failed mid-update: the state in memory is not a step's; restore it
        self.step = 0
        self.checkpoint: _Checkpoint | None = None
        self.snapshots: dict[int, dict[str, str]] = {}  # verify: steps done -> logical digests then
        self._workload_seen: float | None = None  # mtime of the workload file last applied
        self.stopping = False  # its agent stopped it (SIGINT: the node leaves): end at the next safe point
        self.metrics: Any = None
        if dc.metrics_dir is not None:
            from agent.metrics import MetricsLog

            self.metrics = MetricsLog(dc.metrics_dir)

    # --- reporting ----------------------------------------------------------------------------------
    def event(self, kind: str, **data: Any) -> None:
        self.log.info(kind, **{k: v for k, v in data.items() if not isinstance(v, (dict, list))})
        if self.dc.events_path is not None:
            with self.dc.events_path.open("a") as f:
                f.write(json.dumps({"event": kind, "t": time.time(), **data}, default=str) + "\n")

    def _measure(self, results: dict[int, Any]) -> None:
        from agent.metrics import rl_metrics, step_record

        r0 = results[min(results)]
        stages: dict[str, float] = {}
        for r in results.values():
            for name, s in r.stage_seconds.items():
                stages[name] = max(stages.get(name, 0.0), float(s))
        latency = max(float(r.seconds) for r in results.values())
        record = step_record(step=self.step, plan_version=self.version, pool_gpus=len(set(self.ids.values())),
                             workers=sorted(results), seconds=latency, stage_seconds=stages,
                             stats=[r.stats for r in results.values()])
        if self.metrics is not None:
            self.metrics.write(record)
        msg = protocol.Measurement(
            job_id=self.job_id, node=self.node, step=self.step, plan_version=self.version,
            step_latency_s=latency, rl=rl_metrics(record),
            stage_times_s={k: v for k, v in stages.items() if k != "weight-sync"},
            peak_memory_bytes={f"worker{w}": int(r.peak_memory_bytes) for w, r in results.items()},
            response_tokens=float(r0.mean_response_tokens))
        if self.link is not None:
            self.link.report(msg)
        self.event("step", step=self.step, plan_version=self.version, reward=r0.mean_score,
                   accuracy=r0.mean_accuracy, response_tokens=r0.mean_response_tokens,
                   seconds=msg.step_latency_s, stage_seconds=stages, workers=sorted(results))

    def _report(self, order: protocol.TransitionOrder, *, ok: bool, measured_s: float,
                bytes_by_worker: dict[int, int], error: str = "") -> None:
        """Every worker of the order's pool reports its part to its own agent (the daemon counts nodes)."""
        from agent.reports import report_transition

        pool = [w for w in self.ids.values() if w in self.hub.alive]
        for w in pool:
            try:
                self.hub.call(report_transition, workers=[w], timeout_s=30.0, transition_id=order.transition_id,
                              ok=ok, measured_s=measured_s, bytes_moved=bytes_by_worker.get(w, 0), error=error)
            except WorkerDied as exc:
                self.log.warning("report-failed", worker=w, error=str(exc))
        if not ok and self.link is not None:  # at least the anchor's agent fails it, whoever died
            self.link.report(protocol.TransitionReport(job_id=self.job_id, node=self.node,
                                                       transition_id=order.transition_id, ok=False,
                                                       measured_s=measured_s, error=error[:4000]))

    # --- orders -------------------------------------------------------------------------------------
    def next_order(self, wait_s: float) -> protocol.TransitionOrder | None:
        if self.link is None:
            return None
        deadline = time.monotonic() + wait_s
        while True:
            order = self.link.next_order(timeout_s=min(1.0, max(0.0, deadline - time.monotonic())))
            self.hub.pump(0.0)  # keep the workers' beats read while waiting
            if order is not None and order.job_id == self.job_id:
                return order
            if time.monotonic() >= deadline or self.stopping:
                return None

    def apply(self, order: protocol.TransitionOrder | None, new: GlobalPlan,
              pool: dict[str, list[int]] | None = None, per_node: int | None = None,
              incarnations: dict[str, str] | None = None) -> None:
        """Move the live state onto ``new`` (an order's, or the current plan again to heal)."""
        from agent.engine.live import bind, live_cluster, live_dag, live_units, release
        from transitions.errors import CoverageError
        from transitions.local_dag import LastCopyLostError

        if pool is not None and per_node is not None:
            self.ids = {(node, g % per_node): g for node, gpus in pool.items() for g in gpus}
            self.incarnations = dict(incarnations or {})
            gone = [p.worker_id for k, p in self.hub.peers.items() if k not in self.ids and p.worker_id is not None]
            self.hub.forget(gone)  # nodes that left the pool: their processes are not ours any more
        if self.plan is None and order is not None:
            self._adopt(new, self.dc.assign_timeout_s)  # a driver after another: the survivors' state goes on
        old = self.plan
        pool_gpus = set(self.ids.values())
        lost = set(self.dead) | ((set(old.gpus) - pool_gpus) if old is not None else set())
        needed = set(new.gpus) | ((set(old.gpus) - lost) if old is not None else set())
        tid = order.transition_id if order is not None else None
        self.event("transition-start", transition=tid, from_version=self.version,
                   to_version=new.version, lost=sorted(lost), workers=sorted(needed))
        try:
            self.hub.assign({k: w for k, w in self.ids.items() if w in needed}, self.dc.assign_timeout_s,
                            self.incarnations)
            t0 = time.perf_counter()
            sent: dict[int, int] = {}
            restored, dag_bytes = None, 0
            if old is None:
                self.hub.form_generation(sorted(new.gpus))
            else:
                self.hub.form_generation(sorted(needed))
                dag_old, dag_lost = renamed_lost(old, new, lost)
                cluster = live_cluster(self.cfg, dag_old, new)
                try:
                    dag = live_dag(self.cfg, dag_old, new, cluster=cluster, lost=dag_lost)
                except (LastCopyLostError, CoverageError) as exc:
                    dag, restored = None, str(exc).splitlines()[0]
                if self.torn:
                    dag, restored = None, "a step failed after its optimizer updates began (torn state)"
                if dag is not None:
                    from transitions.dag_pieces import DagMemo
                    from transitions.executor import IN_PLACE
                    from transitions.node_steps import dag_messages

                    memo = DagMemo()  # every worker's steps: their bytes reported, and shipped to each
                    dag_bytes = sum(m.num_bytes for m in dag_messages(dag, memo, early=IN_PLACE))
                    # the old views go first, in the same command (one round trip to the workers)
                    outcome = self.hub.run_dag(dag, cluster, before=release, derived=memo)
                    if not outcome.committed:
                        self.dead |= set(outcome.dead_workers)
                        raise WorkerDied(f"transition DAG failed: {outcome.errors}")
                    sent = {w: sum(r.bytes_sent for r in reps) for w, reps in outcome.reports.items()}
                members = self.hub.spec.members if self.hub.spec is not None else ()
                if tuple(sorted(new.gpus)) != members:  # only the new plan's workers step together
                    self.hub.form_generation(sorted(new.gpus))
                if restored is not None:
                    self._restore(new, restored, live_units)
            self.hub.call(bind, workers=sorted(new.gpus), timeout_s=self.dc.step_timeout_s, collective=True, cfg=self._cfg_now(),
                          plan=new)
            measured = time.perf_counter() - t0
            self._verified_digests: dict[str, str] | None = None
            verified = self._verify(new) if old is not None else None
        except (WorkerDied, NereusError) as exc:
            self.event("transition-failed", transition=tid, error=str(exc)[:2000])
            if order is not None:
                self._report(order, ok=False, measured_s=0.0, bytes_by_worker={}, error=str(exc))
            self._after_failure()
            return
        self.plan, self.dead, self.broken = new, set(), False
        self.torn = self.torn and restored is None
        if order is not None:
            self.version = order.to_version
            self._report(order, ok=True, measured_s=measured, bytes_by_worker=sent)
        self.event("transition-done", transition=tid, to_version=self.version, measured_s=measured,
                   bytes_sent=sum(sent.values()), dag_bytes=dag_bytes, lost=sorted(lost),
                   restored_from=self.checkpoint.tag if restored and self.checkpoint else None,
                   workers=sorted(new.gpus), verified=verified)
        if self.dc.verify:  # the verification's digests are this step's state: no second dump
            assert self.plan is not None
            self._snapshot_of(sorted(self.plan.gpus), self._verified_digests)

    def _cfg_now(self) -> Any:
        lengths = [t for s, t in sorted(self.dc.response_schedule.items()) if s <= self.step]
        return dataclasses.replace(self.cfg, max_new_tokens=lengths[-1]) if lengths else self.cfg

    def _workload_changed(self) -> int | None:
        """The workload file's max_new_tokens (taken into the schedule from this step on, if new) and
        steps (where the run ends)."""
        path = self.dc.workload_path
        if path is None or not path.exists() or path.stat().st_mtime == self._workload_seen:
            return None
        self._workload_seen = path.stat().st_mtime
        try:
            data = json.loads(path.read_text())
            tokens = int(data.get("max_new_tokens") or 0) or None
            steps = int(data["steps"]) if "steps" in data else None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            self.event("workload-refused", path=str(path), error=str(exc)[:500])
            return None
        if (tokens is not None and tokens < 1) or (steps is not None and steps < self.step):
            self.event("workload-refused", path=str(path), error=f"max_new_tokens {tokens} < 1 or steps {steps} "
                       f"< the {self.step} done")
            return None
        if steps is not None:
            self.dc.steps = steps  # the run ends there (the orchestrator's story is over)
        if tokens is None or self.dc.response_schedule.get(max(self.dc.response_schedule, default=-1)) == tokens:
            return None
        self.dc.response_schedule = {s: t for s, t in self.dc.response_schedule.items() if s < self.step}
        self.dc.response_schedule[self.step] = tokens
        return tokens

    # --- the loop -----------------------------------------------------------------------------------
    def step_once(self) -> bool:
        """One RL step on the bound plan (its measurement out, a checkpoint when due); False when it
        failed (the survivors are then in a new generation and the plan waits for a replan)."""
        from agent.engine.live import bind, train_step

        assert self.plan is not None
        workers = sorted(self.plan.gpus)
        self._workload_changed()
        try:
            if self.step in self.dc.response_schedule:
                self.hub.call(bind, workers=workers, timeout_s=self.dc.step_timeout_s, collective=True,
                              cfg=self._cfg_now(), plan=self.plan)
                self.event("workload", step=self.step, max_new_tokens=self.dc.response_schedule[self.step])
            results = self.hub.call(train_step, workers=workers, timeout_s=self.dc.step_timeout_s, collective=True,
                                    step=self.step)
        except WorkerDied as exc:
            self.event("step-failed", step=self.step, error=str(exc)[:2000])
            self._check_torn()
            self._after_failure()
            return False
        self._measure(results)
        self.step += 1
        if self.dc.checkpoint_every and self.step % self.dc.checkpoint_every == 0:
            self._checkpoint()
        if self.dc.verify:
            self._snapshot()
        return True

    def run(self) -> int:
        self.event("driver-started", steps=self.dc.steps, hub=self.hub.endpoint)
        waiting_since: float | None = None
        while self.step < self.dc.steps:
            if self.stopping:  # a safe point: the step in flight is done and logged; the workers go on
                self.event("stopped", step=self.step, plan_version=self.version,
                           reason="stopped by its agent (its node leaves the job)")
                return 0
            degraded = self.plan is None or bool(self.dead) or self.broken
            order = self.next_order(min(self.dc.heal_after_s, 5.0) if degraded else 0.0)
            if order is not None:
                waiting_since = None
                self.apply(order, plan_from_part(order.part["plan"]), order.part.get("pool") or {},
                           int(order.part.get("gpus_per_node") or 1), order.part.get("incarnations"))
                continue
            if degraded:
                waiting_since = waiting_since or time.monotonic()
                waited = time.monotonic() - waiting_since
                if waited > self.dc.order_wait_s:
                    self.event("gave-up", reason=f"no usable order within {self.dc.order_wait_s:g} s")
                    return 1
                if self.plan is not None and not self.dead:
                    self._rebind()  # nobody died (a join or DAG failed): the plan's state is where it was
                elif self.plan is not None and waited > self.dc.heal_after_s and self._restarted_in_place():
                    self.apply(None, self.plan)  # the pool did not change: Extend the plan onto the restart
                continue
            self.step_once()
        self.event("done", steps=self.step, plan_version=self.version)
        return 0


def _schedule(text: str) -> dict[int, int]:
    out: dict[int, int] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        step, _, tokens = item.partition(":")
        if not (step.isdigit() and tokens.isdigit() and int(tokens) > 0):
            raise SystemExit(f"driver: --response-schedule item {item!r} is not STEP:TOKENS")
        out[int(step)] = int(tokens)
    return out


def _default_checkpoints(job_id: str) -> str:
    """Beside the published driver file (the job's folder; a driver after a requeue finds them there),
    else a folder of this process's own under the temp dir."""
    published = os.environ.get("NEREUS_DRIVER_FILE")
    if published:
        return str(Path(published).parent / f"ckpt-{job_id}-{os.environ.get('SLURM_JOB_ID', 'local')}")
    return str(Path(os.environ.get("TMPDIR", "/tmp")) / f"nereus-ckpt-{job_id}-{os.getpid()}")


def main(argv: list[str] | None = None) -> int:
    env = os.environ
    p = argparse.ArgumentParser(prog="python -m agent.driver", description=__doc__.split("\n\n")[0])
    p.add_argument("--job-file", required=True, help="the engine job file (etc/jobs/*.toml)")
    p.add_argument("--bind", default=env.get("NEREUS_DRIVER"), help="tcp://HOST:PORT the workers dial")
    p.add_argument("--keys", default=env.get("NEREUS_KEYS"), help="the job's agent key bundle (hub CURVE keys)")
    p.add_argument("--steps", type=int, help="RL steps (default: the job file's)")
    p.add_argument("--checkpoint-dir", help="DCP checkpoints (default: beside NEREUS_DRIVER_FILE, else under the temp dir)")
    p.add_argument("--checkpoint-every", type=int, default=5, help="steps between checkpoints (0: never)")
    p.add_argument("--events", type=Path, help="append one JSON line per step/transition here")
    p.add_argument("--metrics-dir", type=Path, help="metrics.jsonl and TensorBoard files (default: runs/JOB-STAMP)")
    p.add_argument("--response-schedule", default="", help="STEP:TOKENS,... max_new_tokens from STEP on")
    p.add_argument("--workload-file", type=Path, help='JSON {"max_new_tokens": N}, read at each safe point')
    p.add_argument("--heal-after-s", type=float, default=20.0)
    p.add_argument("--verify", action="store_true",
                   help="check every transition kept every logical tensor (hashes; costs a dump per step)")
    p.add_argument("--log-format", choices=("auto", "json", "console"), default="auto")
    args = p.parse_args(argv)
    if not args.bind:
        print("driver: no --bind (or NEREUS_DRIVER): the endpoint the workers dial", file=sys.stderr)
        return 2
    configure_logging(args.log_format)
    from agent.engine.jobfile import load_job
    from nereusd.wire.keys import load_bundle

    try:
        cfg, steps = load_job(args.job_file)
    except NereusError as exc:
        print(f"driver: {args.job_file}: {exc}", file=sys.stderr)
        return 2
    job_id = env.get("NEREUS_JOB_ID", "local")
    link = None
    if "NEREUS_AGENT_IPC" in env:
        import signal

        # as the workers (agent.worker.main): the anchor's agent stops the driver when its node may go
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        from agent.node import AgentLink

        link = AgentLink.from_env()
    hub = HubCoordinator(args.bind, load_bundle(Path(args.keys)) if args.keys else None)
    ckpt = args.checkpoint_dir or _default_checkpoints(job_id)
    dc = DriverConfig(steps=args.steps or steps, checkpoint_url=ckpt, checkpoint_every=args.checkpoint_every,
                      events_path=args.events, response_schedule=_schedule(args.response_schedule),
                      heal_after_s=args.heal_after_s, verify=args.verify, workload_path=args.workload_file,
                      metrics_dir=args.metrics_dir or Path("runs") / f"{job_id}-{time.strftime('%Y%m%d-%H%M%S')}")
    driver = JobDriver(cfg, hub, link, dc, job_id=job_id, node=env.get("NEREUS_NODE", "local"))
    if link is not None:
        import signal

        # the agent stops the driver (SIGINT) when its node leaves: the step in flight ends, then the driver
        signal.signal(signal.SIGINT, lambda *_: setattr(driver, "stopping", True))
    ended = False
    try:
        code = driver.run()
        ended = not driver.stopping
        return code
    except BaseException as exc:
        import traceback

        driver.event("driver-failed", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc(limit=8))
        raise
    finally:
        # only a job that ended stops the workers: those of a driver that went (stopped with its node, or
        # failed) keep their state for the driver after it (a requeued anchor's adopts them)
        hub.close(stop_workers=ended)
        if driver.metrics is not None:
            driver.metrics.close()
        if link is not None:
            link.close()


if __name__ == "__main__":
    raise SystemExit(main())
