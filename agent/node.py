"""The node agent: one per node of a job; registers with nereusd, heartbeats, supervises workers.

    python -m agent.node --endpoint tcp://HEAD:7501 --keys DIR --job JOB [--node NAME]
        [--slurm-job-id ID] [--cpu-slots N] [--worker-cmd 'python -m agent.worker --device {device}']
        [--driver tcp://HOST:PORT] [--driver-cmd 'python -m agent.driver --job-file JOB.toml'] [--ack-orders]
        [--leave-grace-s 25]

Defaults come from the environment where Slurm or the launcher set it (SLURMD_NODENAME, SLURM_JOB_ID,
NEREUS_ENDPOINT, NEREUS_KEYS, NEREUS_JOB_ID). Devices (agent/devices.py): GPUs from NVML, else those
the allocation grants (Slurm's GRES), else CPU worker slots. One worker process per device; the agent
restarts a worker that fails (up to ``max_restarts``) and reports worker states in every heartbeat.

Relays: the job driver and the workers PUSH Measurement and TransitionReport messages to the
agent's local ipc socket ($NEREUS_AGENT_IPC; ``AgentLink``, agent/link.py, is their side). Measurements go on to the
daemon; an order is reported done for the node once every local worker reported it (or failed at the
first failure). Transition orders from the daemon are PUBlished on $NEREUS_AGENT_ORDERS (workers
SUBscribe), again every beat until the node reported them. ``--driver`` is the job driver's endpoint,
handed to every worker (NEREUS_DRIVER) so that it dials the driver; ``--driver-cmd`` (the anchor
node's agent only) also starts the driver itself, as one more child with the workers' environment
(its relay is this agent: its measurements go out, the daemon's orders come in). ``--ack-orders`` reports
every order done at once (simulated nodes, tests, benchmarks: no executor attached).

SIGTERM (Slurm's notice ahead of a preemption, GraceTime, or a time limit, KillWait: 30 s by default)
does not stop the agent at once: it tells the daemon ``Leaving`` (again every beat) and keeps beating,
relaying orders and supervising its workers while the daemon moves the node's state away, until the
daemon answers ``Release`` or ``--leave-grace-s`` passes (0: stop at once); then it stops as before,
exit 0. A second SIGTERM, or SIGINT, stops it at once.

After a daemon restart the agent's connection comes back by itself (same CURVE key, same routing id);
the daemon answers the first heartbeat with ``unknown-session`` and the agent registers again,
without restarting anything. ``forbidden`` or ``unknown-job`` on register is fatal (exit 3).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from agent.devices import allocated_gpus, discover_devices  # noqa: F401  (re-exported: agent.node's API)
from agent.ipc import clean_stale_ipc, ipc_endpoint  # noqa: F401  (re-exported: agent.node's API)
from agent.link import AgentLink  # noqa: F401  (re-exported: workers and the driver import it from here)
from nereusd.wire import protocol
from nereusd.wire.client import AuthRefused, CurveClient
from nereusd.wire.keys import ClientBundle, load_bundle
from nereusd.wire.logs import configure_logging, get_logger
from planner.errors import SpecError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_REFUSED = 0, 1, 2, 3
OUTBOX_MAX = 4096  # reports held while unregistered; past this the oldest go (logged)


class AgentRefused(Exception):
    """The daemon refused this agent for good (forbidden, unknown job, key refused)."""


@dataclass(slots=True)
class _Worker:
    device: protocol.Device
    proc: subprocess.Popen[bytes] | None = None
    state: str = "starting"
    exit_code: int | None = None
    restarts: int = 0


@dataclass(kw_only=True, slots=True)
class AgentConfig:
    endpoint: str
    bundle: ClientBundle
    job_id: str
    node: str
    slurm_job_id: str | None = None
    devices: tuple[protocol.Device, ...] = ()
    worker_cmd: Sequence[str] = ()  # '{device}' is replaced by the device index; empty: no workers
    max_restarts: int = 3
    ack_orders: bool = False
    driver: str | None = None  # the job driver's endpoint, for the workers
    driver_cmd: Sequence[str] = ()  # start the job driver here (the anchor node)
    keys_dir: Path | None = None  # handed to children (NEREUS_KEYS): the hub's CURVE keys
    ipc_dir: Path = field(default_factory=lambda: Path(tempfile.gettempdir()))
    silent_after_s: float = 10.0  # no reply for this long: log that the daemon is silent, keep trying
    leave_grace_s: float = 25.0  # after SIGTERM: at most this long until the daemon releases the node

    def __post_init__(self) -> None:
        if not 0 <= self.leave_grace_s <= protocol.MAX_GRACE_S:
            raise ValueError(f"leave_grace_s must be 0..{protocol.MAX_GRACE_S:g} s, got {self.leave_grace_s}")


def leave_reason(env: Mapping[str, str] = os.environ, now: float | None = None,
                 grace_s: float = 25.0) -> protocol.LeaveReason:
    """Why a SIGTERM came: a time limit when Slurm's job end time ($SLURM_JOB_END_TIME) is near, a
    preemption under Slurm otherwise, else a plain shutdown."""
    end = env.get("SLURM_JOB_END_TIME", "")
    now = time.time() if now is None else now
    if end.isdigit() and int(end) - now <= 2 * grace_s + 60:
        return "time-limit"
    return "preempt" if env.get("SLURM_JOB_ID") else "shutdown"


class NodeAgent:
    def __init__(self, cfg: AgentConfig, on_order: Callable[[protocol.TransitionOrder], None] | None = None) -> None:
        self.cfg = cfg
        self.log = get_logger("agent", job=cfg.job_id, node=cfg.node)
        self.incarnation = uuid.uuid4().hex
        self.ctx = zmq.Context()
        # a random routing id, kept across reconnects: a name others can guess could be squatted
        self.client = CurveClient(cfg.endpoint, cfg.bundle, identity=f"agent-{uuid.uuid4().hex}".encode(),
                                  context=self.ctx, immediate=True)
        clean_stale_ipc(cfg.ipc_dir)
        tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.ipc_in = ipc_endpoint(cfg.ipc_dir, f"nereus-agent-{tag}.in")
        self.ipc_orders = ipc_endpoint(cfg.ipc_dir, f"nereus-agent-{tag}.orders")
        self.relay_in = self.ctx.socket(zmq.PULL)
        self.relay_in.bind(self.ipc_in)
        self.orders_out = self.ctx.socket(zmq.PUB)
        self.orders_out.bind(self.ipc_orders)
        self.on_order = on_order
        self.workers = [_Worker(device=d) for d in cfg.devices] if cfg.worker_cmd else []
        self.driver: subprocess.Popen[bytes] | None = None
        self.driver_exit: int | None = None
        self.stop = threading.Event()
        self.leave_asked = threading.Event()  # the first SIGTERM: leave gracefully (see on_signal)
        self.leave_deadline: float | None = None  # monotonic; set once the leave began
        self.leave_signal_at = float("inf")
        self.leave_why: protocol.LeaveReason = "shutdown"
        self.released = False  # the daemon answered Release: the node may go
        self.registered = threading.Event()
        self.welcomes = 0  # how many times the daemon welcomed us (1 + reconnections)
        self.plan_version = 0
        self.seq = 0
        self.orders: list[protocol.TransitionOrder] = []
        # orders not yet reported done by a local worker: re-published every beat, because a SUB socket
        # that connects after a PUBlish never sees it (workers drop repeats by transition id)
        self.pending_orders: dict[int, protocol.TransitionOrder] = {}
        self.reports: dict[int, list[protocol.TransitionReport]] = {}  # per order, from local workers
        # reports (measurements, transition results) wait here until the daemon has welcomed this agent:
        # sent before the welcome, the daemon refuses them as ``unknown-session`` and they are gone
        self.outbox: deque[protocol.Measurement | protocol.TransitionReport] = deque(maxlen=OUTBOX_MAX)

    # --- workers ------------------------------------------------------------------------------------
    def _child_env(self) -> dict[str, str]:
        env = {**os.environ, "NEREUS_JOB_ID": self.cfg.job_id, "NEREUS_NODE": self.cfg.node,
               "NEREUS_AGENT_IPC": self.ipc_in, "NEREUS_AGENT_ORDERS": self.ipc_orders,
               "NEREUS_AGENT_INCARNATION": self.incarnation}
        if self.cfg.driver:
            env["NEREUS_DRIVER"] = self.cfg.driver
        if self.cfg.keys_dir is not None:
            env["NEREUS_KEYS"] = str(self.cfg.keys_dir)
        return env

    def _spawn_driver(self) -> None:
        self.driver = subprocess.Popen(list(self.cfg.driver_cmd), env=self._child_env())
        self.log.info("driver-started", pid=self.driver.pid)

    def _spawn(self, w: _Worker) -> None:
        cmd = [a.replace("{device}", str(w.device.index)) for a in self.cfg.worker_cmd]
        env = {**self._child_env(), "NEREUS_DEVICE": str(w.device.index)}
        if w.device.kind == "gpu":
            env["CUDA_VISIBLE_DEVICES"] = str(w.device.index)
        w.proc = subprocess.Popen(cmd, env=env)
        w.state = "running"
        self.log.info("worker-started", device=w.device.index, pid=w.proc.pid)

    def _supervise(self) -> None:
        if self.cfg.driver_cmd and self.driver is None:
            self._spawn_driver()
        if self.driver is not None and self.driver_exit is None and (code := self.driver.poll()) is not None:
            self.driver_exit = code  # not restarted: a driver holds the job's step loop, a new one would not
            (self.log.info if code == 0 else self.log.error)("driver-exited", exit_code=code)
        for w in self.workers:
            if w.proc is None:
                self._spawn(w)
                continue
            code = w.proc.poll()
            if code is None or w.state in ("exited", "failed"):
                continue
            w.exit_code = code
            if code == 0:
                w.state = "exited"
            elif w.restarts < self.cfg.max_restarts:
                w.restarts += 1
                self.log.warning("worker-restart", device=w.device.index, exit_code=code, restarts=w.restarts)
                self._spawn(w)
            else:
                w.state = "failed"
                self.log.error("worker-failed", device=w.device.index, exit_code=code)

    def _stop_workers(self) -> None:
        procs = [w.proc for w in self.workers if w.proc is not None]
        procs += [self.driver] if self.driver is not None else []
        for proc in procs:
            if proc.poll() is None:
                # SIGINT, not SIGTERM: the agent's children ignore SIGTERM (Slurm sends it to every process
                # of the step at a preemption or time limit, and the node's state must first move away)
                proc.send_signal(signal.SIGINT)
        for proc in procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    # --- daemon conversation ------------------------------------------------------------------------
    def _register(self) -> None:
        self.client.send(protocol.Register(job_id=self.cfg.job_id, node=self.cfg.node,
                                           slurm_job_id=self.cfg.slurm_job_id, host=socket.gethostname(),
                                           pid=os.getpid(), incarnation=self.incarnation, devices=self.cfg.devices))

    def _heartbeat(self) -> None:
        workers = tuple(protocol.WorkerState(device=w.device.index, pid=w.proc.pid if w.proc else 0,
                                             state=w.state, exit_code=w.exit_code,  # type: ignore[arg-type]
                                             restarts=w.restarts) for w in self.workers)
        self.seq += 1
        self.client.send(protocol.Heartbeat(job_id=self.cfg.job_id, node=self.cfg.node, seq=self.seq,
                                            workers=workers))

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, protocol.Welcome):
            self.welcomes += 1
            self.plan_version = msg.plan_version
            self.interval_s = msg.heartbeat_interval_s
            self.registered.set()
            self.log.info("registered", reconnected=msg.reconnected, plan_version=msg.plan_version)
            self._flush_outbox()
        elif isinstance(msg, protocol.Release):
            if not self.released:
                self.log.info("released", reason=msg.reason)
            self.released = True
        elif isinstance(msg, protocol.ErrorReply):
            if msg.code == "unknown-session":
                self.registered.clear()
                self.log.info("re-registering", reason=msg.message)
                self._register()
            elif msg.code in ("forbidden", "unknown-job"):
                raise AgentRefused(f"{msg.code}: {msg.message}")
            else:
                self.log.warning("daemon-error", code=msg.code, error=msg.message)
        elif isinstance(msg, protocol.TransitionOrder):
            self.orders.append(msg)
            self.log.info("transition-order", transition=msg.transition_id, to_version=msg.to_version)
            self.orders_out.send(protocol.encode(msg))
            if not self.cfg.ack_orders:
                self.pending_orders[msg.transition_id] = msg
            if self.on_order is not None:
                self.on_order(msg)
            if self.cfg.ack_orders:
                self.plan_version = msg.to_version
                self.client.send(protocol.TransitionReport(job_id=self.cfg.job_id, node=self.cfg.node,
                                                           transition_id=msg.transition_id, ok=True, measured_s=0.0))

    def _worker_report(self, msg: protocol.TransitionReport) -> None:
        """The node is done with an order when every local worker is (or at its first failure)."""
        if msg.transition_id not in self.pending_orders:
            return  # already reported (failed early) or never ordered here
        got = self.reports.setdefault(msg.transition_id, [])
        got.append(msg)
        expected = max(1, len(self.workers))
        if msg.ok and len(got) < expected:
            return
        failed = [r for r in got if not r.ok]
        self.pending_orders.pop(msg.transition_id)
        self.reports.pop(msg.transition_id)
        self._send_report(protocol.TransitionReport(
            job_id=self.cfg.job_id, node=self.cfg.node, transition_id=msg.transition_id, ok=not failed,
            measured_s=max(r.measured_s for r in got), bytes_moved=sum(r.bytes_moved for r in got),
            error="; ".join(r.error for r in failed)))

    def _send_report(self, msg: protocol.Measurement | protocol.TransitionReport) -> None:
        """Send now if the daemon knows this agent, else hold it until the welcome."""
        if not self.registered.is_set():
            if len(self.outbox) == self.outbox.maxlen:
                self.log.warning("outbox-full-dropping-oldest", held=len(self.outbox))
            self.outbox.append(msg)
            return
        self.client.send(msg)

    def _flush_outbox(self) -> None:
        while self.outbox and self.registered.is_set():
            self.client.send(self.outbox.popleft())

    def on_signal(self, signum: int, _frame: Any = None) -> None:
        """The first SIGTERM asks for a graceful leave (none with a zero grace); anything more stops now."""
        if signum == signal.SIGTERM and not self.leave_asked.is_set() and self.cfg.leave_grace_s > 0:
            self.leave_signal_at = time.monotonic()  # the grace counts from the signal, not the next beat
            self.leave_asked.set()
        else:
            self.stop.set()

    def _leave_step(self, now: float) -> bool:
        """While leaving: tell the daemon (every beat, once registered); True once the node may go."""
        if self.leave_deadline is None:
            self.leave_deadline = min(now, self.leave_signal_at) + self.cfg.leave_grace_s
            self.leave_why = leave_reason(grace_s=self.cfg.leave_grace_s)
            self.log.info("leaving", reason=self.leave_why, grace_s=self.cfg.leave_grace_s)
        if self.released:
            return True
        if now >= self.leave_deadline:
            self.log.warning("leave-grace-over", grace_s=self.cfg.leave_grace_s)
            return True
        if self.registered.is_set():
            self.client.send(protocol.Leaving(job_id=self.cfg.job_id, node=self.cfg.node, reason=self.leave_why,
                                              grace_s=round(self.leave_deadline - now, 3)))
        return False

    def report(self, msg: protocol.Measurement | protocol.TransitionReport) -> None:
        """Send a report from this process (the driver on node 0 may run inside the agent)."""
        self._send_report(msg)

    def run(self) -> int:
        self.interval_s = 1.0
        poller = zmq.Poller()
        poller.register(self.client.sock, zmq.POLLIN)
        if self.client.monitor is not None:
            poller.register(self.client.monitor, zmq.POLLIN)
        poller.register(self.relay_in, zmq.POLLIN)
        last_reply = time.monotonic()
        next_beat = time.monotonic()
        silent_logged = False
        try:
            while not self.stop.is_set():
                now = time.monotonic()
                if self.released or (self.leave_deadline is not None and now >= self.leave_deadline):
                    self._leave_step(now)  # logs why
                    break
                if self.leave_asked.is_set() and self.leave_deadline is None:
                    next_beat = now  # the first Leaving goes out now, not at the next beat
                if now >= next_beat:
                    if self.registered.is_set():
                        self._heartbeat()
                        for order in self.pending_orders.values():
                            self.orders_out.send(protocol.encode(order))
                    else:
                        self._register()
                    if self.leave_asked.is_set() and self._leave_step(now):
                        break
                    self._supervise()
                    # until welcomed, retry soon: the first register may go out before the connection is up
                    next_beat = now + (self.interval_s if self.registered.is_set() else min(0.2, self.interval_s))
                    if now - last_reply > self.cfg.silent_after_s and not silent_logged:
                        self.log.warning("daemon-silent", seconds=round(now - last_reply, 1))
                        silent_logged = True
                wake = next_beat if self.leave_deadline is None else min(next_beat, self.leave_deadline)
                ready = dict(poller.poll(max(1, int((wake - time.monotonic()) * 1e3))))
                if self.client.monitor is not None and self.client.monitor in ready:
                    self.client._drain_monitor()
                    if self.client.auth_failed:
                        raise AgentRefused(self.client.auth_failed)
                if self.client.sock in ready:
                    while self.client.sock.poll(0):
                        try:
                            msg = protocol.decode(self.client.sock.recv(), self.client.max_message_bytes)
                        except protocol.ProtocolError as exc:
                            self.log.warning("bad-daemon-message", error=str(exc))
                            continue
                        last_reply, silent_logged = time.monotonic(), False
                        self._handle(msg)
                if self.relay_in in ready:
                    while self.relay_in.poll(0):
                        frame = self.relay_in.recv()
                        try:
                            msg = protocol.decode(frame, self.client.max_message_bytes)
                        except protocol.ProtocolError as exc:
                            self.log.warning("bad-local-report", error=str(exc))
                            continue
                        if isinstance(msg, protocol.TransitionReport):
                            self._worker_report(msg)
                        elif isinstance(msg, protocol.Measurement):
                            self._send_report(msg)
            return EXIT_OK
        except (AgentRefused, AuthRefused) as exc:
            self.log.error("refused", error=str(exc))
            return EXIT_REFUSED
        finally:
            self._stop_workers()
            self.close()

    def close(self) -> None:
        self.client.close()
        self.relay_in.close(linger=0)
        self.orders_out.close(linger=0)
        self.ctx.term()
        for endpoint in (self.ipc_in, self.ipc_orders):  # zmq leaves ipc socket files behind
            with contextlib.suppress(FileNotFoundError):
                os.unlink(endpoint.removeprefix("ipc://"))


def main(argv: Sequence[str] | None = None) -> int:
    env = os.environ
    p = argparse.ArgumentParser(prog="python -m agent.node", description="Nereus node agent")
    p.add_argument("--endpoint", default=env.get("NEREUS_ENDPOINT"), help="tcp://HEAD:PORT of nereusd's agents")
    p.add_argument("--keys", default=env.get("NEREUS_KEYS"), help="agent key bundle directory")
    p.add_argument("--job", default=env.get("NEREUS_JOB_ID"), help="the Nereus job id")
    p.add_argument("--node", default=env.get("SLURMD_NODENAME") or socket.gethostname())
    p.add_argument("--slurm-job-id", default=env.get("SLURM_JOB_ID"))
    p.add_argument("--cpu-slots", type=int, help="use N CPU worker slots instead of GPUs")
    p.add_argument("--worker-cmd", default="", help="worker command; {device} is the device index")
    p.add_argument("--driver", default=env.get("NEREUS_DRIVER"), help="the job driver's endpoint (for workers)")
    p.add_argument("--driver-cmd", default="", help="start the job driver with this command (anchor node)")
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--ack-orders", action="store_true", help="report every order done (no executor)")
    p.add_argument("--leave-grace-s", type=float, default=25.0,
                   help="after SIGTERM, wait at most this long for the daemon to move state off the node (0: stop "
                        "at once); keep it under Slurm's KillWait/GraceTime minus the workers' stop time (5 s)")
    p.add_argument("--log-format", choices=("auto", "json", "console"), default="auto")
    args = p.parse_args(argv)
    missing = [n for n in ("endpoint", "keys", "job") if not getattr(args, n)]
    if missing:
        print(f"agent: missing {', '.join('--' + m for m in missing)} (or NEREUS_ENDPOINT/NEREUS_KEYS/"
              "NEREUS_JOB_ID)", file=sys.stderr)
        return EXIT_USAGE
    configure_logging(args.log_format)
    try:
        cfg = AgentConfig(endpoint=args.endpoint, bundle=load_bundle(Path(args.keys)), job_id=args.job,
                          node=args.node, slurm_job_id=args.slurm_job_id, devices=discover_devices(args.cpu_slots),
                          worker_cmd=shlex.split(args.worker_cmd), max_restarts=args.max_restarts,
                          ack_orders=args.ack_orders, driver=args.driver, driver_cmd=shlex.split(args.driver_cmd),
                          keys_dir=Path(args.keys), leave_grace_s=args.leave_grace_s)
        agent = NodeAgent(cfg)
    except SpecError as exc:  # a bad key bundle, an ipc folder too deep: one line, not a traceback
        print(f"agent: {exc}", file=sys.stderr)
        return EXIT_USAGE
    signal.signal(signal.SIGTERM, agent.on_signal)
    signal.signal(signal.SIGINT, agent.on_signal)
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
