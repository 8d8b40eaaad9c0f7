"""The nereusd serve loop: one thread polls the agent and admin sockets and runs the job controllers.

Start-up: open the store (migrating it), load the CURVE keys (creating the server pair on first
start), start ZAP, bind the agent and admin ROUTERs and the metrics endpoint, write the bound
endpoints to ``<state_dir>/endpoints.json``, re-arm every stored job (its nodes get a fresh
heartbeat grace, so agents that survived a daemon crash reconnect without being marked lost), then
tell systemd READY=1 ($NOTIFY_SOCKET, if set).

The allocation source is polled in a worker thread (a slow or failing Slurm command must not stall
heartbeats); its events and the results of grow/shrink requests come back through a queue.
"""

from __future__ import annotations

import json
import os
import queue
import resource
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from nereusd import protocol
from nereusd.admin import AdminError, AdminOps
from nereusd.allocation import AllocationEvent, AllocationSource, ElasticJob
from nereusd.control import (
    ADMIN_DOMAIN,
    AGENT_DOMAIN,
    CurveRouter,
    Session,
    SessionTable,
    check_session,
    start_authenticator,
)
from nereusd.controller import JobController, PlannerPort
from nereusd.keys import KeyStore
from nereusd.logs import get_logger
from nereusd.metrics import Metrics
from nereusd.settings import Settings
from nereusd.store import TERMINAL_JOB_STATES, Store
from planner import admission
from planner.errors import NereusError

HEARTBEAT_FLUSH_S = 5.0  # last-heartbeat times reach the store this often (one transaction for all)
SLOW_HANDLER_S = 0.2


def sd_notify(state: str) -> bool:
    """systemd readiness protocol without a dependency: one datagram to $NOTIFY_SOCKET."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]  # abstract namespace
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        s.sendall(state.encode())
    return True


def raise_fd_limit(want: int = 65536) -> int:
    """Every agent is a TCP connection: lift the soft open-files limit toward the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return target
    return soft


def _write_atomic_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


class _SourceWorker(threading.Thread):
    """Runs the allocation source off the serve loop: periodic poll() plus queued grow/shrink calls."""

    def __init__(self, source: AllocationSource, interval_s: float, log: Any) -> None:
        super().__init__(name="allocation-source", daemon=True)
        self.source, self.interval_s, self.log = source, interval_s, log
        self.requests: queue.Queue[tuple[str, tuple[Any, ...]]] = queue.Queue()
        self.events: queue.Queue[AllocationEvent] = queue.Queue()
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                while True:
                    op, args = self.requests.get_nowait()
                    try:
                        getattr(self.source, op)(*args)
                    except NereusError as exc:
                        self.log.warning("allocation-request-failed", op=op, args=str(args), error=str(exc))
            except queue.Empty:
                pass
            try:
                for ev in self.source.poll():
                    self.events.put(ev)
            except Exception as exc:  # the source promises not to raise; if it does, log and keep going
                self.log.error("allocation-poll-crashed", error=repr(exc))
            self.stop_event.wait(self.interval_s)


class Daemon:
    def __init__(self, settings: Settings, *, source: AllocationSource | None = None,
                 planner: PlannerPort | None = None, planner_name: str = "none") -> None:
        t0 = time.monotonic()
        self.settings = settings
        self.log = get_logger("daemon")
        self.state_dir = Path(settings.daemon.state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.store = Store(self.state_dir / "nereusd.db")
        self.store.start_checkpointer()
        self.keys = KeyStore(self.state_dir / "keys")
        if self.keys.init():
            self.log.info("server-keys-created", path=str(self.keys.root))
        self.metrics = Metrics()
        self.source = source
        self.planner = planner
        self.planner_name = planner_name
        self.sessions = SessionTable()
        self.controllers: dict[str, JobController] = {}
        self.node_state: dict[tuple[str, str], str] = {}
        self.last_seen: dict[tuple[str, str], float] = {}  # monotonic time of the last message per node
        self.heartbeats_to_flush: dict[tuple[str, str], float] = {}
        self.worker_states: dict[tuple[str, str], list[dict[str, Any]]] = {}  # as last reported per node
        self.admin_ops = AdminOps(self)
        self.stopping = threading.Event()
        self.started_at = time.time()
        self.started_monotonic = t0

        ctl = settings.control
        fd_limit = raise_fd_limit()
        self.ctx = zmq.Context()
        self.ctx.set(zmq.MAX_SOCKETS, max(1024, fd_limit))
        self.auth = start_authenticator(self.ctx, self.keys, self.log)
        server_keys = self.keys.server_keys()
        self.agents = CurveRouter(self.ctx, domain=AGENT_DOMAIN, server_keys=server_keys, host=ctl.bind_host,
                                  port=ctl.port, max_message_bytes=ctl.max_message_bytes, log=self.log,
                                  on_reject=lambda code: self.metrics.rejected.labels(code).inc())
        self.admin = CurveRouter(self.ctx, domain=ADMIN_DOMAIN, server_keys=server_keys, host=ctl.bind_host,
                                 port=ctl.admin_port, max_message_bytes=ctl.max_message_bytes, log=self.log,
                                 on_reject=lambda code: self.metrics.rejected.labels(code).inc())
        self.endpoints = {"control": f"tcp://{ctl.bind_host}:{self.agents.port}",
                          "admin": f"tcp://{ctl.bind_host}:{self.admin.port}", "metrics": None}
        if settings.metrics.enabled:
            port = self.metrics.serve(ctl.bind_host, settings.metrics.port)
            self.endpoints["metrics"] = f"http://{ctl.bind_host}:{port}/metrics"
        _write_atomic_json(self.state_dir / "endpoints.json", {**self.endpoints, "pid": os.getpid()})

        self.worker: _SourceWorker | None = None
        if source is not None:
            interval = settings.slurm.poll_interval_s if source.name == "slurm" else 0.2
            self.worker = _SourceWorker(source, interval, self.log)
        self._restore()
        self.startup_s = time.monotonic() - t0

    # --- start-up and shutdown ----------------------------------------------------------------------
    def _restore(self) -> None:
        now = time.monotonic()
        for job in self.store.jobs(include_terminal=False):
            self._start_controller(job["job_id"])
            if self.source is not None and "elastic" in job["spec"]:
                self.source.track(ElasticJob.from_dict(job["spec"]["elastic"]))
            for n in self.store.nodes(job["job_id"]):
                key = (job["job_id"], n["node"])
                self.node_state[key] = n["state"]
                if n["state"] == "alive":
                    self.last_seen[key] = now  # a fresh grace period: the agent may just not have spoken yet

    def _start_controller(self, job_id: str) -> JobController:
        p = self.settings.planner
        thresholds = dict(admission.DEFAULT_THRESHOLDS)
        thresholds[admission.Signal.SEQUENCE_LENGTH] = p.seq_len_drift_threshold
        ctl = JobController(job_id=job_id, store=self.store, metrics=self.metrics, planner=self.planner,
                            gamma=p.gamma, thresholds=thresholds, log=self.log,
                            send_order=lambda node, order: self._send_to_node(job_id, node, order),
                            pool_settle_s=p.pool_settle_s)
        self.controllers[job_id] = ctl
        return ctl

    def add_job(self, *, job_id: str, user: str, spec: dict[str, Any], slurm_job_id: str | None = None) -> None:
        elastic = spec.get("elastic")
        if elastic is not None:
            ej = ElasticJob.from_dict({**elastic, "job_id": job_id, "slurm_user": elastic.get("slurm_user", user)})
            if ej.slurm_user != user:
                raise NereusError(f"job user {user!r} differs from its Slurm user {ej.slurm_user!r}")
            slurm_job_id = slurm_job_id or ej.anchor_job_id
            spec = {**spec, "elastic": ej.to_dict()}
        self.store.add_job(job_id=job_id, user=user, spec=spec, slurm_job_id=slurm_job_id)
        self.store.add_event("job-added", {"user": user, "slurm_job_id": slurm_job_id}, job_id=job_id)
        self._start_controller(job_id)
        if self.source is not None and elastic is not None:
            self.source.track(ElasticJob.from_dict(spec["elastic"]))
        self.log.info("job-added", job=job_id, user=user, slurm_job_id=slurm_job_id)

    def source_request(self, op: str, *args: Any) -> None:
        if self.worker is None:
            raise AdminError("invalid", "the daemon runs without an allocation source")
        self.worker.requests.put((op, args))

    def close(self) -> None:
        if self.worker is not None:
            self.worker.stop_event.set()
            self.worker.join(timeout=5)
        self._flush_heartbeats()
        self.agents.close()
        self.admin.close()
        self.auth.stop()
        self.ctx.term()
        self.metrics.close()
        self.store.close()

    # --- the loop -----------------------------------------------------------------------------------
    def serve(self, ready: Callable[[], None] | None = None) -> None:
        ctl = self.settings.control
        tick_s = max(0.02, min(0.25, ctl.heartbeat_timeout_s / 4))
        poller = zmq.Poller()
        poller.register(self.agents.sock, zmq.POLLIN)
        poller.register(self.admin.sock, zmq.POLLIN)
        if self.worker is not None:
            self.worker.start()
        self.log.info("serving", startup_ms=round(self.startup_s * 1e3, 1), **self.endpoints)
        sd_notify("READY=1\nSTATUS=serving")
        warm_up = getattr(self.planner, "warm_up", None)
        if warm_up is not None:
            threading.Thread(target=warm_up, name="planner-warm-up", daemon=True).start()
        if ready is not None:
            ready()
        next_tick = next_flush = time.monotonic()
        while not self.stopping.is_set():
            timeout_ms = max(0, int((next_tick - time.monotonic()) * 1e3))
            for sock, _ in poller.poll(timeout_ms):
                # drain a bounded batch per socket, so the admin socket is never starved by agents
                for _ in range(256):
                    if sock is self.agents.sock:
                        self._guarded(self._agent_message)
                    else:
                        self._guarded(self._admin_message)
                    if not sock.poll(0):
                        break
            now = time.monotonic()
            if now >= next_tick:
                self._guarded(self._tick)
                next_tick = now + tick_s
            if now >= next_flush:
                self._guarded(self._flush_heartbeats)
                next_flush = now + HEARTBEAT_FLUSH_S
        sd_notify("STOPPING=1")
        self.log.info("stopping")

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

    def _tick(self) -> None:
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
                ctl.on_allocation(ev)
                for n in ev.nodes:
                    key = (ev.job_id, n.node)
                    if key in self.node_state:
                        self.node_state[key] = next(r["state"] for r in self.store.nodes(ev.job_id)
                                                    if r["node"] == n.node)
        self._check_heartbeats()
        for job_id, ctl in list(self.controllers.items()):
            try:
                ctl.step()
            except NereusError as exc:
                self.log.error("controller-step-failed", job=job_id, error=str(exc))
            if self.store.job(job_id)["state"] in TERMINAL_JOB_STATES:  # type: ignore[index]
                del self.controllers[job_id]
        self._update_gauges()

    def _check_heartbeats(self) -> None:
        timeout = self.settings.control.heartbeat_timeout_s
        now = time.monotonic()
        for key, seen in list(self.last_seen.items()):
            if self.node_state.get(key) == "alive" and now - seen > timeout:
                job_id, node = key
                reason = f"no heartbeat for {now - seen:.1f} s (> {timeout:g} s)"
                self.store.set_node_state(job_id, node, "lost", reason)
                self.node_state[key] = "lost"
                self.store.add_event("node-lost", {"node": node, "reason": reason}, job_id=job_id)
                self.log.warning("node-lost", job=job_id, node=node, reason=reason)
                ctl = self.controllers.get(job_id)
                if ctl is not None:
                    ctl.on_node_lost(node, reason)

    def _flush_heartbeats(self) -> None:
        if self.heartbeats_to_flush:
            batch = [(j, n, t) for (j, n), t in self.heartbeats_to_flush.items()]
            self.heartbeats_to_flush = {}
            self.store.touch_heartbeats(batch)

    def _update_gauges(self) -> None:
        counts: dict[str, int] = {}
        for j in self.store.jobs():
            counts[j["state"]] = counts.get(j["state"], 0) + 1
        for state in ("pending", "running", "transitioning", "lost", "finished", "failed", "cancelled"):
            self.metrics.jobs.labels(state).set(counts.get(state, 0))
        self.metrics.agents_connected.set(len(self.sessions))

    # --- agent messages -----------------------------------------------------------------------------
    def _agent_message(self) -> None:
        got = self.agents.receive()
        if got is None:
            return
        inc, msg = got
        reply = self._on_agent(inc.identity, inc.user, inc.encoding, msg)
        if isinstance(reply, protocol.ErrorReply):
            self.agents.reject(inc, reply.code, reply.message)
        else:
            self.metrics.messages.labels(msg.type).inc()
            if reply is not None:
                self.agents.send(inc.identity, reply, inc.encoding)

    def _on_agent(self, identity: bytes, user: str, enc: protocol.Encoding, msg: Any) -> Any:
        if isinstance(msg, protocol.Register):
            return self._register(identity, user, enc, msg)
        if not isinstance(msg, (protocol.Heartbeat, protocol.Measurement, protocol.TransitionReport)):
            return protocol.ErrorReply(code="invalid", message=f"agents may not send {msg.type!r}")
        denied = check_session(self.sessions, identity, user, msg.job_id, msg.node)
        if denied is not None:
            return protocol.ErrorReply(code=denied[0], message=denied[1])
        key = (msg.job_id, msg.node)
        self.last_seen[key] = time.monotonic()
        self.heartbeats_to_flush[key] = time.time()
        ctl = self.controllers.get(msg.job_id)
        if self.node_state.get(key) == "lost":
            self.store.set_node_state(msg.job_id, msg.node, "alive", "heartbeats resumed")
            self.node_state[key] = "alive"
            self.store.add_event("node-back", {"node": msg.node}, job_id=msg.job_id)
            if ctl is not None:
                ctl.on_node_joined(msg.node, "heartbeats resumed")
        if ctl is None:
            return protocol.ErrorReply(code="unknown-job", message=f"job {msg.job_id} has ended")
        if isinstance(msg, protocol.Heartbeat):
            workers = [w.model_dump() for w in msg.workers]
            if self.worker_states.get(key) != workers:  # stored on change only: 1 Hz x 1,024 nodes otherwise
                self.worker_states[key] = workers
                self.store.add_event("workers", {"node": msg.node, "workers": workers}, job_id=msg.job_id)
            return protocol.Ack(ref="heartbeat", seq=msg.seq)
        if isinstance(msg, protocol.Measurement):
            ctl.on_measurement(msg)
            return protocol.Ack(ref="measurement", seq=msg.step)
        ctl.on_transition_report(msg)
        return protocol.Ack(ref="transition-report", seq=msg.transition_id)

    def _register(self, identity: bytes, user: str, enc: protocol.Encoding, msg: protocol.Register) -> Any:
        job = self.store.job(msg.job_id)
        if job is None:
            return protocol.ErrorReply(code="unknown-job", message=f"no job {msg.job_id!r}: add it first "
                                       "(nereusctl job-add, or submit it through the Slurm tracker)")
        if job["user"] != user:
            self.store.add_event("register-forbidden", {"node": msg.node, "user": user}, job_id=msg.job_id)
            return protocol.ErrorReply(code="forbidden",
                                       message=f"user {user!r} may not act on job {msg.job_id!r}")
        if job["state"] in TERMINAL_JOB_STATES:
            return protocol.ErrorReply(code="unknown-job", message=f"job {msg.job_id!r} is {job['state']}")
        if msg.slurm_job_id is not None and "elastic" in job["spec"]:
            held = ElasticJob.from_dict(job["spec"]["elastic"]).slurm_job_ids
            tracked = {j.job_id: j for j in self.source.jobs()} if self.source is not None else {}
            if msg.job_id in tracked:
                held = tracked[msg.job_id].slurm_job_ids
            if msg.slurm_job_id not in held:
                return protocol.ErrorReply(code="forbidden", message=f"Slurm job {msg.slurm_job_id} is not part "
                                           f"of job {msg.job_id!r} (its Slurm jobs: {', '.join(held)})")
        how = self.store.register_node(job_id=msg.job_id, node=msg.node,
                                       devices=[d.model_dump() for d in msg.devices], slurm_job_id=msg.slurm_job_id,
                                       host=msg.host, incarnation=msg.incarnation)
        key = (msg.job_id, msg.node)
        self.sessions.bind(identity, Session(job_id=msg.job_id, node=msg.node, user=user, encoding=enc))
        self.node_state[key] = "alive"
        self.last_seen[key] = time.monotonic()
        self.store.add_event("node-registered", {"node": msg.node, "how": how, "devices": len(msg.devices),
                                                 "host": msg.host}, job_id=msg.job_id)
        self.log.info("agent-registered", job=msg.job_id, node=msg.node, how=how, devices=len(msg.devices))
        ctl = self.controllers.get(msg.job_id) or self._start_controller(msg.job_id)
        ctl.on_node_joined(msg.node, how)
        job = self.store.job(msg.job_id) or job
        return protocol.Welcome(job_id=msg.job_id, node=msg.node, heartbeat_interval_s=self.settings.control.
                                heartbeat_interval_s, plan_version=job["plan_version"], reconnected=how != "new")

    def _send_to_node(self, job_id: str, node: str, msg: Any) -> bool:
        ident = self.sessions.by_node.get((job_id, node))
        if ident is None:
            self.log.warning("order-undeliverable", job=job_id, node=node)
            return False
        self.agents.send(ident, msg, self.sessions.by_identity[ident].encoding)
        return True

    # --- admin messages -----------------------------------------------------------------------------
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
        self.admin.send(inc.identity, reply, inc.encoding)
        if time.monotonic() - t0 > SLOW_HANDLER_S:
            self.log.warning("slow-admin-op", op=msg.op, ms=round((time.monotonic() - t0) * 1e3, 1))
