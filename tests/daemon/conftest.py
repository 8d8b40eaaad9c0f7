"""A real nereusd process per test (loopback, free ports, short time-outs), plus keys and clients.

The daemon is started exactly as systemd would (``nereusd serve --config``) with $NOTIFY_SOCKET
pointing at a datagram socket of the test, so start-up waits for READY=1 rather than sleeping.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from nereusd.wire import protocol
from nereusd.wire.client import CurveClient
from nereusd.wire.keys import KeyStore, load_bundle

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
ADMIN_REPLY_S = 30.0  # the bound on one admin reply (see DaemonHandle.admin_reply)
# the bound on a start-up to READY=1 (imports, store, keys, sockets: ~1 s idle; under a load ~15 deep on
# 2 cores it passed 20 s): how fast nereusd starts is bench/daemon.py's to measure, not a test's
READY_S = 60.0


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A free port below the kernel's ephemeral range (32768+) and ZeroMQ's random ports (49152+), in a
    band of its own per xdist worker: a port handed out here is not taken by another test's port-0
    socket, or by the other worker, before its daemon binds it."""
    import random

    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0) % 4
    low = 20000 + worker * 3000
    for _ in range(200):
        port = random.randrange(low, low + 3000)
        if port in _HANDED_OUT:  # e.g. control and admin port of one config: never the same
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _HANDED_OUT.add(port)
            return port
    raise AssertionError(f"no free port in {low}..{low + 2999}")


def store_rows(state_dir: Path, sql: str) -> list[tuple[Any, ...]]:
    """``sql`` on the daemon's store, opened read-only beside it (what is really on disk)."""
    import sqlite3

    db = sqlite3.connect(f"file:{state_dir / 'nereusd.db'}?mode=ro", uri=True)
    try:
        return db.execute(sql).fetchall()
    finally:
        db.close()


def wait_for(cond: Callable[[], Any], timeout_s: float = 10.0, what: str = "condition") -> Any:
    """Poll ``cond`` until it returns something truthy; fail after ``timeout_s`` (no bare sleeps)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


@dataclass
class DaemonHandle:
    tmp: Path
    config: Path
    state_dir: Path
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    endpoints: dict[str, Any] = field(default_factory=dict)
    ready_s: float = 0.0
    clients: list[CurveClient] = field(default_factory=list)

    def start(self) -> DaemonHandle:
        notify = self.tmp / f"notify-{time.monotonic_ns()}.sock"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(notify))
        sock.settimeout(READY_S)
        self.log_path = self.tmp / "nereusd.log"
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([str(BIN / "nereusd"), "serve", "--config", str(self.config)],
                                         stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "NOTIFY_SOCKET": str(notify)})
        try:
            msg = sock.recv(4096).decode()
        except TimeoutError:
            raise AssertionError(f"nereusd sent no READY=1 within {READY_S:g} s; log:\n{self.log()}") from None
        finally:
            sock.close()
            notify.unlink()
        self.ready_s = time.monotonic() - t0
        assert "READY=1" in msg, msg
        self.endpoints = json.loads((self.state_dir / "endpoints.json").read_text())
        return self

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path and self.log_path.exists() else ""

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.terminate()
        return self.proc.wait(15)

    def client(self, who: str, socket_name: str = "control", **kw: Any) -> CurveClient:
        c = CurveClient(self.endpoints[socket_name], load_bundle(self.tmp / who), **kw)
        self.clients.append(c)
        return c

    def admin_reply(self, op: str, **args: Any) -> protocol.AdminReply:
        """The daemon's reply to one admin request, refused or not."""
        c = self.client("admin", "admin")
        try:
            # 30 s: a daemon just started answers once its planner warm-up is done (imports and a small
            # decision, ~0.5 s of CPU); on a machine loaded ~15 deep that has taken over 10 s of wall time
            reply = c.request(protocol.AdminRequest(op=op, args=args), timeout_s=ADMIN_REPLY_S)
        finally:
            c.close()
            self.clients.remove(c)
        assert isinstance(reply, protocol.AdminReply), reply
        return reply

    def admin(self, op: str, **args: Any) -> Any:
        reply = self.admin_reply(op, **args)
        assert reply.ok, reply.error
        return reply.data

    def ctl(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(BIN / "nereusctl"), *argv, "--state-dir", str(self.state_dir),
                               "--keys", str(self.tmp / "admin")], text=True, capture_output=True, timeout=60)

    def acking_agent(self, who: str, job: str, node: str, *extra: str) -> subprocess.Popen[bytes]:
        """A real agent process with a stand-in for its workers: it acknowledges every transition order
        at once without moving any state (``--ack-orders``). For tests about the daemon alone; the real
        path (workers, the driver, the DAG run on live state) is tests/live/test_live_job.py."""
        return self.agent(who, job, node, "--ack-orders", *extra)

    def agent(self, who: str, job: str, node: str, *extra: str) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"agent-{node}.log", "ab")  # noqa: SIM115 (closed with the process)
        return subprocess.Popen([sys.executable, "-m", "agent.node", "--endpoint", self.endpoints["control"],
                                 "--keys", str(self.tmp / who), "--job", job, "--node", node, "--cpu-slots", "2",
                                 "--log-format", "json", *extra], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def write_config(path: Path, state_dir: Path, *, port: int = 0, admin_port: int = 0, timeout_s: float = 1.5,
                 interval_s: float = 0.25, max_bytes: int = 4096) -> None:
    path.write_text(f"""
[daemon]
state_dir = "{state_dir}"
log_format = "json"
log_level = "debug"
[control]
port = {port}
admin_port = {admin_port}
max_message_bytes = {max_bytes}
heartbeat_interval_s = {interval_s}
heartbeat_timeout_s = {timeout_s}
[metrics]
port = 0
[slurm]
enabled = false
[planner]
pool_settle_s = 0.3
""")


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonHandle]:
    """A configured (not yet started) daemon on fixed free ports, with keys for admin, alice and bob."""
    state = tmp_path / "state"
    cfg = tmp_path / "nereusd.toml"
    write_config(cfg, state, port=free_port(), admin_port=free_port())
    ks = KeyStore(state / "keys")
    ks.init()
    ks.create_client(name="admin", user="root", role="admin", out_dir=tmp_path / "admin")
    ks.create_client(name="alice-agent", user="alice", role="agent", out_dir=tmp_path / "alice")
    ks.create_client(name="bob-agent", user="bob", role="agent", out_dir=tmp_path / "bob")
    handle = DaemonHandle(tmp=tmp_path, config=cfg, state_dir=state)
    yield handle
    for c in handle.clients:
        c.close()
    handle.stop()
