"""The nereusd serve loop: one thread polls the agent and admin sockets and runs the job controllers.

Start-up: open the store (migrating it), load the CURVE keys (creating the server pair on first
start), start ZAP, bind the agent and admin ROUTERs and the metrics endpoint (nereusd.transport), write the bound
endpoints to ``<state_dir>/endpoints.json``, re-arm every stored job (its nodes get a fresh
heartbeat grace, so agents that survived a daemon crash reconnect without being marked lost), then
tell systemd READY=1 ($NOTIFY_SOCKET, if set).

The allocation source is polled in a worker thread (a slow or failing Slurm command must not stall
heartbeats); its events, and the grow/shrink requests it refused, come back through queues (a refusal,
at once or from that thread, is stored as an ``alloc-refused`` event). A shrink is graceful: nodes a
plan uses are drained first (``JobController.drain``) and released once the transition away from them
is done. A node that leaves by itself (``Leaving``: Slurm's SIGTERM ahead of a preemption or a time
limit) drains the same way, but is never released through the source (Slurm takes it anyway): once
no plan uses it the daemon answers its agent ``Release`` and marks it released. Each tick fails
ordered transitions older than ``daemon.order_timeout_s``, and an agent that registers again is sent
the orders it has not reported.

Agents and nereusctl have a ZeroMQ context each (an I/O thread and a ZAP handler of their own), so a
storm of agent handshakes never delays an admin connection; one agent key holds a bounded number of
connections (``nereusd.connections``: its user's jobs' node limits plus control.spare_connections_per_key;
silent ones are closed after control.silent_connection_s).

Nothing from outside may stop the loop: a stored job that cannot be loaded or whose controller fails
is marked damaged (``nereusctl jobs`` shows the reason) and the others are served; a message whose
handler fails gets an ``internal`` error reply. Each pass serves the admin socket first and agents
for at most ``AGENT_BATCH_S``, so admin calls answer promptly under any agent traffic. Start-up
problems (state dir, store, key permissions, ports) raise ``StartupError``: one line, exit code 3.
"""

from __future__ import annotations

import gc
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from nereusd.admin import AdminBackend, AdminError, AdminOps
from nereusd.agent_sessions import TRANSIENT, AgentSessions
from nereusd.allocation import (
    AllocationSource,
    ElasticJob,
)
from nereusd.control import (
    SessionTable,
)
from nereusd.controller import JobController, PlannerPort
from nereusd.growth import make_growth
from nereusd.metrics import Metrics
from nereusd.settings import Settings
from nereusd.source_requests import SourceRequests
from nereusd.source_worker import _SourceWorker, replay_allocation  # noqa: F401 (re-exported)
from nereusd.startup import (  # noqa: F401 (re-exported: the CLI, benches and tests import them here)
    STORE_MARKER,
    StartupError,
    _open_store,
    _write_atomic_json,
    raise_fd_limit,
    sd_notify,
)
from nereusd.store import TERMINAL_JOB_STATES
from nereusd.transport import Transport
from nereusd.wire import protocol
from nereusd.wire.job_models import JobSpecModel
from nereusd.wire.keys import KeyStore
from nereusd.wire.logs import get_logger
from planner import admission
from planner.errors import NereusError, SpecError

HEARTBEAT_FLUSH_S = 5.0  # last-heartbeat times reach the store this often (one transaction for all)
SLOW_HANDLER_S = 0.2
AGENT_BATCH_S = 0.05  # agent messages served per pass before the admin socket is looked at again
ADMIN_BATCH = 16
RESTART_GRACE_S = 5.0  # added to the heartbeat time-out for nodes restored from the store


class Daemon(AgentSessions, SourceRequests, Transport):

    def __init__(self, settings: Settings, *, source: AllocationSource | None = None,
                 planner: PlannerPort | None = None, planner_name: str = "none", new_store: bool = False) -> None:
        t0 = time.monotonic()
        self.settings = settings
        self.log = get_logger("daemon")
        self.state_dir = Path(settings.daemon.state_dir)
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StartupError(f"cannot create daemon.state_dir {self.state_dir}: {exc.strerror}") from None
        if not self.state_dir.is_dir():
            raise StartupError(f"daemon.state_dir {self.state_dir} is not a directory")
        self.keys = KeyStore(self.state_dir / "keys")
        try:
            self.keys.check_permissions()
            created = self.keys.init()
        except SpecError as exc:
            raise StartupError(str(exc)) from None
        except OSError as exc:
            raise StartupError(f"cannot set up the keys in {self.keys.root}: {exc.strerror}") from None
        if created:
            self.log.info("server-keys-created", path=str(self.keys.root))
        self.store = _open_store(self.state_dir, new_store=new_store, log=self.log)
        self.metrics = Metrics()
        self.source = source
        self.planner = planner
        self.planner_name = planner_name
        self.sessions = SessionTable()
        self.controllers: dict[str, JobController] = {}
        self.damaged: dict[str, str] = {}  # job -> why it cannot be served (shown by nereusctl)
        self.restored: set[tuple[str, str]] = set()  # nodes alive in the store at start: given a grace
        self.node_state: dict[tuple[str, str], str] = {}
        self.last_seen: dict[tuple[str, str], float] = {}  # monotonic time of the last message per node
        self.heartbeats_to_flush: dict[tuple[str, str], float] = {}
        self.worker_states: dict[tuple[str, str], list[dict[str, Any]]] = {}  # as last reported per node
        self.resend_to: list[tuple[str, str]] = []  # nodes that registered again: their unreported orders
        # nodes whose agent sent Leaving: "draining" (state moving away), "refused" (no plan fits without
        # it: it goes at its grace end, abruptly), "released" (it may go; the agent is told Release)
        self.leaving: dict[tuple[str, str], str] = {}
        self.admin_ops = AdminOps(self)
        self.stopping = threading.Event()
        self.signalled: int | None = None  # SIGTERM/SIGINT's number, set by nereusd.cli's handler (no lock there)
        self.fatal: str | None = None  # set when the daemon must stop with an error (exit 1)
        self.started_at = time.time()
        self.started_monotonic = t0
        self.ctx: zmq.Context | None = None
        self.admin_ctx: zmq.Context | None = None
        try:
            self._bind(settings)
        except BaseException:
            self._close_transport()
            self.store.close()
            raise

        # The serve loop calls the source too (track, jobs, allocation) while its thread polls: the local
        # source locks itself; the Slurm source's serve-loop calls only read or replace whole values. No
        # lock is shared with the poll thread, so a slow squeue never stalls the loop.
        self.worker: _SourceWorker | None = None
        if source is not None:
            interval = settings.slurm.poll_interval_s if source.name == "slurm" else 0.2
            self.worker = _SourceWorker(source, interval, self.log)
        self.growth = make_growth(self)  # a Slurm job grows toward max_gpus by itself (nereusd/growth.py)
        self._restore()
        self.startup_s = time.monotonic() - t0

    # --- start-up and shutdown ----------------------------------------------------------------------
    def _restore(self) -> None:
        for job in self.store.jobs(include_terminal=False):
            try:
                self._restore_job(job)
            except Exception as exc:  # one unreadable job must not keep the others from being served
                self._mark_damaged(job["job_id"], f"cannot be restored: {type(exc).__name__}: {exc}")
        for job in self.store.jobs():
            if job.get("damaged") and job["job_id"] not in self.damaged:
                self._mark_damaged(job["job_id"], str(job["damaged"]))

    def _restore_job(self, job: dict[str, Any]) -> None:
        job_id = job["job_id"]
        if job.get("damaged"):
            raise ValueError(job["damaged"])
        self._start_controller(job_id)
        if self.source is not None and "elastic" in job["spec"]:
            ej = ElasticJob.from_dict(job["spec"]["elastic"])
            # the stored allocation, so a restart grants nothing again and keeps grown nodes; Slurm's source
            # then reports only what changed while the daemon was away (a member that ended, a node DOWN)
            self.source.track(ej, replay_allocation(job_id, self.store.allocation_events(job_id)))
        now = time.monotonic()
        for n in self.store.nodes(job_id):
            key = (job_id, n["node"])
            self.node_state[key] = n["state"]
            if n["state"] == "alive":  # a fresh grace period (restarted in serve()): the agent reconnects
                self.last_seen[key] = now
                self.restored.add(key)

    def _mark_damaged(self, job_id: str, reason: str) -> None:
        reason = reason.splitlines()[0][:400] if reason else "unknown"
        self.damaged[job_id] = reason
        self.controllers.pop(job_id, None)
        self.log.error("job-damaged", job=job_id, reason=reason)
        try:
            self.store.add_event("job-damaged", {"reason": reason}, job_id=job_id)
        except Exception as exc:  # the store itself may be what is broken
            self.log.error("job-damaged-not-recorded", job=job_id, error=repr(exc))

    def damaged_jobs(self) -> dict[str, str]:
        return dict(self.damaged)

    # --- what the admin ops see (nereusd.admin.AdminBackend) -----------------------------------------
    @property
    def source_name(self) -> str | None:
        return self.source.name if self.source else None

    def runtime(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "uptime_s": round(time.monotonic() - self.started_monotonic, 3),
                "started_at": self.started_at, "state_dir": str(self.state_dir), "endpoints": self.endpoints,
                "allocation_source": self.source_name, "planner": self.planner_name,
                "agents_connected": len(self.sessions), "agent_connections": self.connections.counts(),
                "planner_warm_up_ms": self.warm_up_ms}

    def _warm_up_planner(self) -> None:
        """The planner's bounded warm-up (imports, one small decision, what the running jobs' next
        decisions read: under 1 s), run before serving so the first decision pays none of it; then
        everything alive so far is moved out of the cyclic collector's reach (gc.freeze: start-up
        objects and the planner's caches are not scanned again by every full collection). Its time is
        logged and shown by ``status``."""
        warm_up = getattr(self.planner, "warm_up", None)
        t0 = time.monotonic()
        running = [(ctl._spec_now(), ctl.plan) for ctl in self.controllers.values() if ctl.plan is not None]
        steps = warm_up(running=running) if warm_up is not None else None
        gc.freeze()
        self.warm_up_ms = round((time.monotonic() - t0) * 1e3, 1)
        self.log.info("planner-warm-up", ms=self.warm_up_ms, steps=steps)

    warm_up_ms: float | None = None  # the planner's warm-up at start-up (None before serve)

    def pool_gpus(self, job_id: str) -> int:
        ctl = self.controllers.get(job_id)
        return len(ctl.pool) if ctl else 0

    def node_workers(self, job_id: str, node: str) -> list[dict[str, Any]]:
        return self.worker_states.get((job_id, node), [])

    def draining_nodes(self, job_id: str) -> dict[str, str]:
        ctl = self.controllers.get(job_id)
        return dict(ctl.draining) if ctl else {}

    def _start_controller(self, job_id: str) -> JobController:
        p = self.settings.planner
        thresholds = dict(admission.DEFAULT_THRESHOLDS)
        thresholds[admission.Signal.SEQUENCE_LENGTH] = p.seq_len_drift_threshold
        ctl = JobController(job_id=job_id, store=self.store, metrics=self.metrics, planner=self.planner,
                            gamma=p.gamma, thresholds=thresholds, log=self.log,
                            send_order=lambda node, order: self._send_to_node(job_id, node, order),
                            pool_settle_s=p.pool_settle_s,
                            release_nodes=lambda nodes: self._queue_release(job_id, nodes), restore_by_order=True)
        self.controllers[job_id] = ctl
        return ctl

    def add_job(self, *, job_id: str, user: str, spec: JobSpecModel,
                slurm_job_id: str | None = None) -> None:
        """Validate the job fully (structure, planner presets, elastic relations, the allocation source)
        and only then store it; a refusal raises NereusError naming what is wrong."""
        if self.store.job(job_id) is not None:
            raise SpecError("job", f"job {job_id!r} exists", "a new job name")
        stored = spec.stored()
        check = getattr(self.planner, "check_spec", None)
        if check is not None and spec.model is not None:
            check(stored)  # model, algo, device, workload resolve to presets and fit together
        ej: ElasticJob | None = None
        if spec.elastic is not None:
            elastic = stored["elastic"]
            owner = elastic.get("slurm_user", user)
            if owner != user:
                raise SpecError("spec.elastic.slurm_user", f"{owner!r} differs from the job's user {user!r}",
                                "the job's user (or leave it out)")
            ej = ElasticJob.from_dict({**elastic, "job_id": job_id, "slurm_user": user})
            slurm_job_id = slurm_job_id or ej.anchor_job_id
            stored["elastic"] = ej.to_dict()
            if self.source is not None:
                self.source.track(ej)
        try:
            self.store.add_job(job_id=job_id, user=user, spec=stored, slurm_job_id=slurm_job_id)
            self.store.add_event("job-added", {"user": user, "slurm_job_id": slurm_job_id}, job_id=job_id)
        except BaseException:
            if self.source is not None and ej is not None:
                self.source.untrack(job_id)
            raise
        self._start_controller(job_id)
        self.log.info("job-added", job=job_id, user=user, slurm_job_id=slurm_job_id)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.stop_event.set()
            if self.worker.is_alive():
                self.worker.join(timeout=5)
        try:
            self._flush_heartbeats()
        except Exception as exc:  # a full disk at shutdown: the next heartbeats write them again
            self.log.error("heartbeat-flush-failed", error=repr(exc))
        self._close_transport()
        self.store.close()

    # --- the loop -----------------------------------------------------------------------------------
    def serve(self, ready: Callable[[], None] | None = None) -> None:
        ctl = self.settings.control
        tick_s = max(0.02, min(0.25, ctl.heartbeat_timeout_s / 4))
        poller = zmq.Poller()
        poller.register(self.agents.sock, zmq.POLLIN)
        poller.register(self.admin.sock, zmq.POLLIN)
        poller.register(self.connections.monitor, zmq.POLLIN)
        if self.worker is not None:
            self.worker.start()  # the source's first poll (mostly waiting on Slurm) overlaps the warm-up
        # warmed before anything is served or READY is told: the first decision pays none of it, and a
        # supervisor's (or a test's) "ready" means decisions at full speed from the first message on
        self._warm_up_planner()
        self.log.info("serving", startup_ms=round(self.startup_s * 1e3, 1), warm_up_ms=self.warm_up_ms,
                      **self.endpoints)
        sd_notify("READY=1\nSTATUS=serving")
        if ready is not None:
            ready()
        next_tick = next_flush = time.monotonic()
        # the grace of restored nodes counts from now, plus the agents' reconnect back-off (up to 2 s,
        # nereusd.wire.client): a daemon down for a while must not mark every node lost on coming back
        for key in self.restored:
            if self.last_seen.get(key) is not None:
                self.last_seen[key] = next_tick + RESTART_GRACE_S
        self.restored.clear()
        while not self.stopping.is_set() and self.signalled is None:
            timeout_ms = max(0, int((next_tick - time.monotonic()) * 1e3))
            ready_socks = dict(poller.poll(timeout_ms))
            # admin first and bounded agent batches: nereusctl answers promptly under any agent traffic
            if self.admin.sock in ready_socks:
                for _ in range(ADMIN_BATCH):
                    self._guarded(self._admin_message)
                    if not self.admin.sock.poll(0):
                        break
            if self.connections.monitor in ready_socks:
                self.connections.pump()
            if self.agents.sock in ready_socks:
                until = time.monotonic() + AGENT_BATCH_S
                while True:
                    self._guarded(self._agent_message)
                    if time.monotonic() >= until or not self.agents.sock.poll(0):
                        break
            now = time.monotonic()
            if now >= next_tick:
                self._guarded(self._tick)
                next_tick = now + tick_s
            if now >= next_flush:
                self._guarded(self._flush_heartbeats)
                next_flush = now + HEARTBEAT_FLUSH_S
        sd_notify("STOPPING=1")
        if self.signalled is not None:
            self.log.info("signal", signal=signal.Signals(self.signalled).name)
        self.log.info("stopping", error=self.fatal)

    def _guarded(self, fn: Callable[[], None]) -> None:
        """A bug in one handler is logged and the daemon keeps serving (never an assert that kills it)."""
        t0 = time.monotonic()
        try:
            fn()
        except Exception:
            self.log.exception("handler-failed", handler=fn.__name__)
        took = time.monotonic() - t0
        if took > SLOW_HANDLER_S:  # everything shares one loop: a slow handler delays heartbeats and nereusctl
            self.log.warning("slow-handler", handler=fn.__name__, ms=round(took * 1e3, 1))
            # the heartbeats that came meanwhile wait in the socket: this silence is the daemon's, not theirs
            for key in self.last_seen:
                self.last_seen[key] += took

    def _tick(self) -> None:
        dead = [n for n, a in (("agent", self.auth), ("admin", self.admin_auth)) if not a.is_alive()]
        if dead:  # deaf to every new connection: fail loudly, let systemd restart us
            self.fatal = f"the {dead[0]} CURVE authenticator thread stopped: no new connection could be accepted"
            self.log.error("authenticator-died")
            self.stopping.set()
            return
        if self.worker is not None:
            while True:
                try:
                    ev = self.worker.events.get_nowait()
                except queue.Empty:
                    break
                ctl = self.controllers.get(ev.job_id)
                if ctl is None:
                    self.log.warning("allocation-event-for-unknown-job", job=ev.job_id, kind=ev.kind.value)
                    continue
                try:
                    ctl.on_allocation(ev)
                except (NereusError, *TRANSIENT) as exc:
                    self.log.error("allocation-event-failed", job=ev.job_id, error=str(exc))
                except Exception as exc:
                    self._mark_damaged(ev.job_id, f"allocation event failed: {type(exc).__name__}: {exc}")
                    continue
                for n in ev.nodes:
                    key = (ev.job_id, n.node)
                    if key in self.node_state:
                        row = self.store.node(ev.job_id, n.node)
                        if row is not None:
                            self.node_state[key] = row["state"]
            self._take_refusals(self.worker)
        self.connections.service()
        self._check_heartbeats()
        for job_id, ctl in list(self.controllers.items()):
            try:
                ctl.check_order_timeouts(self.settings.daemon.order_timeout_s)
                ctl.step()
            except (NereusError, *TRANSIENT) as exc:  # the next tick tries again
                self.log.error("controller-step-failed", job=job_id, error=str(exc))
            except Exception as exc:  # a bug or an unreadable record: this job stops, the others go on
                self._mark_damaged(job_id, f"controller step failed: {type(exc).__name__}: {exc}")
                continue
            row = self.store.job(job_id)
            if row is None or row["state"] in TERMINAL_JOB_STATES:
                del self.controllers[job_id]
                self.metrics.forget_job(job_id)
        if self.growth is not None:
            self._guarded(self.growth.tick)
        self._update_gauges()

    def _update_gauges(self) -> None:
        counts: dict[str, int] = {}
        for j in self.store.jobs():
            counts[j["state"]] = counts.get(j["state"], 0) + 1
        for state in ("pending", "running", "transitioning", "lost", "finished", "failed", "cancelled"):
            self.metrics.jobs.labels(state).set(counts.get(state, 0))
        self.metrics.agents_connected.set(len(self.sessions))

    # --- agent messages -----------------------------------------------------------------------------
    def _admin_message(self) -> None:
        got = self.admin.receive()
        if got is None:
            return
        inc, msg = got
        if not isinstance(msg, protocol.AdminRequest):
            self.admin.reject(inc, "invalid", f"the admin endpoint takes 'admin' requests, not {msg.type!r}")
            return
        t0 = time.monotonic()
        try:
            data = self.admin_ops.handle(msg.op, msg.args)
            reply = protocol.AdminReply(ok=True, data=data)
        except AdminError as exc:
            self.metrics.rejected.labels(exc.code).inc()
            reply = protocol.AdminReply(ok=False, code=exc.code, error=str(exc))
        except Exception as exc:  # never no reply, never a dead loop
            self.log.exception("admin-op-failed", op=msg.op)
            reply = protocol.AdminReply(ok=False, code="internal",
                                        error=f"the daemon failed on {msg.op}: {type(exc).__name__}: {exc}"[:500])
        self.admin.send(inc.identity, reply, inc.encoding)
        if time.monotonic() - t0 > SLOW_HANDLER_S:
            self.log.warning("slow-admin-op", op=msg.op, ms=round((time.monotonic() - t0) * 1e3, 1))


def _admin_backend(d: Daemon) -> AdminBackend:  # checked by mypy: the daemon is what the admin ops need
    return d
