"""The job driver's link to workers that node agents started: a CURVE-encrypted ZeroMQ hub.

A worker started by its node agent (``python -m agent.worker``, NEREUS_DRIVER in its environment)
dials the job's driver, says hello with its node and device, and waits to be given its worker id
(the global GPU id the daemon's plan uses for that device); from then on it obeys the commands of
``agent.commands`` exactly as a spawned local worker does over its pipe (``agent.worker.worker_main``).
A small process beside the worker (``agent.beat``) beats every ``agent.beat.BEAT_S`` while the worker lives: a
worker whose beat stops for ``dead_after_s`` is dead to the driver (a killed process says nothing, and
ZeroMQ hides disconnects).

Security: the hub is a CURVE server whose key pair is the job's agent key bundle, and a ZAP handler
admits only clients that present that same public key, so only processes holding the user's agent
secret key can talk to the driver; every frame is encrypted. Commands are pickled (they carry DAGs
and functions), which is why nobody else may connect.

``HubCoordinator`` is a ``agent.coordinator.CommandDriver``: generations, DAG runs, checkpoints and
calls are the same code as the local coordinator's; only ``request`` and liveness differ.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth.thread

from agent.commands import Command, Reply, WorkerState
from agent.coordinator import CommandDriver, WorkerDied
from nereusd.wire.keys import ClientBundle

PUMP_MAX_FRAMES = 10_000
HELLO, ASSIGN, BEAT, BYE = b"hello", b"assign", b"beat", b"bye"
STOP = b"stop"  # to a worker's beat process (agent.beat.STOP)


@dataclass(slots=True)
class Peer:
    """One worker process as the hub knows it."""

    node: str
    device: int
    pid: int
    identity: bytes  # routing id of its command socket
    last_beat: float
    incarnation: str = ""  # of the node agent that started it
    worker_id: int | None = None
    ready: bool = False  # answered its assignment (its WorkerContext exists)
    resumed: bool = False  # it re-dialled from an earlier driver, with its worker id and units (failover)
    beat_identity: bytes | None = None  # routing id of its beat process (agent.beat), which can stop it


@dataclass(frozen=True, slots=True)
class Undecodable:
    """A command this worker could not unpickle (a function it cannot import): it is answered as an
    error reply naming why, instead of ending the worker."""

    why: str


class _Curve:
    """ZAP: admit exactly the job's agent key."""

    def __init__(self, allowed: bytes) -> None:
        self.allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:  # pyzmq hands the client key z85-encoded
        return bool(key == self.allowed)


class HubCoordinator(CommandDriver):
    """Drives the workers that dialled ``bind`` (``tcp://HOST:PORT``); hosts the generations' TCPStore."""

    def __init__(self, bind: str, bundle: ClientBundle | None, *, timeout_s: float = 60.0,
                 dead_after_s: float = 10.0, store_host: str | None = None,
                 stuck_after_s: float | None = None) -> None:
        import torch.distributed as dist

        self.timeout_s, self.dead_after_s = timeout_s, dead_after_s
        # a collective's survivors get the channel's time-out and as long again to fail by themselves
        self.stuck_after_s = 2 * timeout_s if stuck_after_s is None else stuck_after_s
        self.ctx = zmq.Context()
        self.auth: Any = None
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker may reuse nothing, but be safe
        if bundle is not None:
            self.auth = zmq.auth.thread.ThreadAuthenticator(self.ctx)
            self.auth.start()
            self.auth.configure_curve_callback(domain="*", credentials_provider=_Curve(bundle.public_key))
            self.sock.curve_server = True
            self.sock.curve_publickey = bundle.public_key
            self.sock.curve_secretkey = bundle.secret_key
        elif not bind.startswith(("tcp://127.0.0.1:", "ipc://", "inproc://")):
            raise WorkerDied(f"the driver hub binds {bind} without keys: only loopback may go unencrypted")
        self.sock.bind(bind)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        host = store_host or bind.split("://", 1)[1].rsplit(":", 1)[0]
        self.store_host = "127.0.0.1" if host in ("*", "0.0.0.0") else host
        self._store = dist.TCPStore(self.store_host, 0, is_master=True, wait_for_workers=False,
                                    timeout=__import__("datetime").timedelta(seconds=timeout_s))
        self.store_port = self._store.port
        self.generation = -1
        self.spec = None
        self.state: dict[int, WorkerState] = {}
        self.held: dict[int, tuple[str, ...]] = {}
        self.peers: dict[tuple[str, int], Peer] = {}  # (node, device) -> the latest process there
        self._by_identity: dict[bytes, Peer] = {}
        self._replies: dict[int, Reply] = {}  # worker -> latest reply not yet collected
        self._seq = 0

    # --- the wire -----------------------------------------------------------------------------------
    def pump(self, timeout_s: float = 0.0) -> None:
        """Take every frame waiting (hellos, beats, replies), waiting up to ``timeout_s`` for the first."""
        wait_ms = int(timeout_s * 1e3)
        for _ in range(PUMP_MAX_FRAMES):  # bounded: a flood of frames cannot keep the driver here
            if not self.sock.poll(wait_ms):
                break
            wait_ms = 0
            frames = self.sock.recv_multipart()
            if len(frames) != 3:
                continue
            ident, kind, body = frames
            now = time.monotonic()
            if kind == HELLO:
                info = pickle.loads(body)
                key = (str(info["node"]), int(info["device"]))
                old = self.peers.get(key)
                if old is not None:
                    self._by_identity.pop(old.identity, None)
                new = Peer(node=key[0], device=key[1], pid=int(info["pid"]), identity=ident, last_beat=now,
                           incarnation=str(info.get("incarnation", "")))
                if info.get("worker_id") is not None:  # a worker of the driver before this one: adopted as it is
                    new.worker_id, new.ready, new.resumed = int(info["worker_id"]), True, True
                self.peers[key] = new
                self._by_identity[ident] = new
            elif kind == BEAT:
                node, device, pid = pickle.loads(body)
                beating = self.peers.get((node, device))
                if beating is not None and beating.pid == pid:
                    beating.last_beat, beating.beat_identity = now, ident
            elif kind == b"reply":
                sender = self._by_identity.get(ident)
                if sender is None or sender.worker_id is None:
                    continue
                sender.last_beat = now
                reply: Reply = pickle.loads(body)
                if reply.seq == 0:
                    sender.ready = True
                    self.state[sender.worker_id] = reply.state
                    continue
                self._replies[sender.worker_id] = reply

    def _send(self, peer: Peer, kind: bytes, body: Any) -> None:
        self.sock.send_multipart([peer.identity, kind, pickle.dumps(body, protocol=pickle.HIGHEST_PROTOCOL)])

    # --- membership ---------------------------------------------------------------------------------
    def assign(self, ids: dict[tuple[str, int], int], timeout_s: float,
               incarnations: dict[str, str] | None = None) -> dict[int, Peer]:
        """Give each (node, device) its worker id; wait (bounded) until every one has said hello and
        answered. ``incarnations``: node -> the agent incarnation whose workers count (others are
        leftovers of an earlier grant of the node). Returns worker id -> peer. Raises WorkerDied naming
        the devices that never came."""
        deadline = time.monotonic() + timeout_s
        want = incarnations or {}

        def usable(p: Peer | None) -> bool:
            return p is not None and not self._stale(p) and want.get(p.node, p.incarnation) == p.incarnation

        while True:
            self.pump(0.0)
            for key, wid in ids.items():
                peer = self.peers.get(key)
                if peer is None or not usable(peer):
                    continue
                if peer.worker_id is None:
                    peer.worker_id = wid
                    self._send(peer, ASSIGN, wid)
                elif peer.worker_id != wid:
                    raise WorkerDied(f"worker on {key[0]} device {key[1]} is worker {peer.worker_id}, "
                                     f"the plan calls it {wid}")
            missing = [k for k in ids if not usable(p := self.peers.get(k)) or not (p and p.ready)]
            if not missing:
                return {ids[k]: self.peers[k] for k in ids}
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerDied(f"workers {', '.join(f'{n}:{d}' for n, d in missing)} did not come up "
                                 f"within {timeout_s:g} s")
            self.pump(min(left, 0.5))

    def _stale(self, peer: Peer) -> bool:
        return time.monotonic() - peer.last_beat > self.dead_after_s

    def _peer(self, worker: int) -> Peer | None:
        for p in self.peers.values():
            if p.worker_id == worker:
                return p
        return None

    @property
    def alive(self) -> tuple[int, ...]:
        self.pump(0.0)
        return tuple(sorted(p.worker_id for p in self.peers.values()
                            if p.worker_id is not None and p.ready and not self._stale(p)))

    def is_dead(self, worker: int) -> bool:
        """Dead: no beat for ``dead_after_s`` (waits that long for a beat, so a busy worker is not
        declared dead by a driver that had not read its socket)."""
        peer = self._peer(worker)
        if peer is None:
            return True
        deadline = time.monotonic() + self.dead_after_s
        seen = peer.last_beat
        while time.monotonic() < deadline:
            self.pump(0.2)
            current = self._peer(worker)
            if current is not peer:
                return True  # replaced by a restarted process
            if peer.last_beat > seen:
                return False
        return True

    # --- request ------------------------------------------------------------------------------------
    def request(self, commands: dict[int, Command], timeout_s: float | None = None) -> dict[int, Reply]:
        """Send each worker its command and wait for every reply; a worker whose beat stops, or that
        does not answer before the deadline, yields ok=False."""
        deadline = time.monotonic() + (timeout_s or 2 * self.timeout_s + 5.0)
        self._seq += 1
        seq = self._seq
        replies: dict[int, Reply] = {}
        waiting: dict[int, Peer] = {}
        for wid, cmd in commands.items():
            peer = self._peer(wid)
            if peer is None or self._stale(peer):
                replies[wid] = self._lost(wid, seq, "worker gone (no beat)")
                continue
            self._replies.pop(wid, None)
            self.sock.send_multipart([peer.identity, b"cmd", str(seq).encode(),
                                      pickle.dumps(cmd, protocol=pickle.HIGHEST_PROTOCOL)])
            waiting[wid] = peer
        collective = any(getattr(cmd, "collective", False) for cmd in commands.values())
        stuck_at: float | None = None  # a peer of a collective died: the others get the channel's bound
        while waiting:
            now = time.monotonic()
            if deadline - now <= 0:
                for wid in waiting:
                    replies[wid] = self._lost(wid, seq, "no reply before the timeout")
                break
            if stuck_at is not None and now >= stuck_at:
                self._stop_stuck(waiting, replies, seq)
                break
            self.pump(min(deadline - now, 0.2))
            for wid, peer in list(waiting.items()):
                got = self._replies.get(wid)
                if got is not None and got.seq == seq:
                    replies[wid] = self._replies.pop(wid)
                    del waiting[wid]
                elif self._peer(wid) is not peer or self._stale(peer):
                    replies[wid] = self._lost(wid, seq, f"worker died (no beat for {self.dead_after_s:g} s)")
                    del waiting[wid]
                    if collective and stuck_at is None:
                        stuck_at = time.monotonic() + self.stuck_after_s
        for wid, reply in replies.items():
            self.state[wid] = reply.state
            self.held[wid] = reply.units
        return replies

    def _stop_stuck(self, waiting: dict[int, Peer], replies: dict[int, Reply], seq: int) -> None:
        """Workers still in a collective ``stuck_after_s`` after a peer of it died: their channel's own
        time-out did not free them (a blocked wait without a bound), so nothing they hold can be reached
        any more. Their beat processes stop them (SIGKILL, on their own host); their agents restart them
        with nothing held, and the job goes on from intact replicas or its checkpoint."""
        for wid, peer in waiting.items():
            if peer.beat_identity is not None:
                self.sock.send_multipart([peer.beat_identity, STOP])
            peer.last_beat = -float("inf")  # dead to this hub from now on (a new hello replaces it)
            replies[wid] = Reply(worker=wid, seq=seq, ok=False, state=WorkerState.STOPPED, units=(),
                                 error=f"stuck in a collective {self.stuck_after_s:g} s after a peer died: stopped")
        waiting.clear()

    def _lost(self, worker: int, seq: int, error: str) -> Reply:
        peer = self._peer(worker)
        gone = peer is None or self._stale(peer)
        return Reply(worker=worker, seq=seq, ok=False, error=error,
                     state=WorkerState.STOPPED if gone else WorkerState.RUNNING,
                     units=() if gone else self.held.get(worker, ()))

    def forget(self, workers: Iterable[int]) -> None:
        """Drop dead workers (their device may come back as a new process, which says hello again)."""
        for key, peer in list(self.peers.items()):
            if peer.worker_id in set(workers):
                del self.peers[key]
                self._by_identity.pop(peer.identity, None)

    def close(self, stop_workers: bool = True) -> None:
        if stop_workers:
            for peer in self.peers.values():
                with contextlib.suppress(zmq.ZMQError):
                    self._send(peer, BYE, None)
        self.sock.close(linger=500 if stop_workers else 0)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()


class WorkerLink:
    """The worker's side: dial the driver, say hello, wait for the worker id, then one command in and
    one reply out (``send``/``recv`` as ``worker_main`` uses a pipe). A beat thread keeps the driver
    sure the process lives; ``recv`` raises EOFError on the driver's bye or when the agent (the
    parent) is gone.

    Failover: with NEREUS_DRIVER_FILE (the anchor's published driver record, agent.slurm_task) the worker
    dials the endpoint published there, and while idle re-reads it; a record published after the one it
    dialled (a requeued anchor's new driver) is dialled at once, the hello carrying the worker id, so the
    new driver adopts the worker with the units it holds."""

    def __init__(self, endpoint: str, bundle: ClientBundle | None, *, node: str, device: int) -> None:
        self.ctx = zmq.Context()
        self.node, self.device, self.pid, self.bundle = node, device, os.getpid(), bundle
        self.parent = os.getppid()
        self.worker_id: int | None = None
        # failover: the file where the anchor publishes the driver's endpoint (agent.slurm_task); a driver
        # published after this one (a requeued anchor's) is dialled again, with the worker id and units kept
        self.driver_file = os.environ.get("NEREUS_DRIVER_FILE") or None
        self.published = _published(self.driver_file)
        self._dial(str(self.published.get("endpoint") or endpoint) if self.published else endpoint)

    def _dial(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.sock = self._socket(endpoint, self.bundle, zmq.DEALER)
        hello = {"node": self.node, "device": self.device, "pid": self.pid, "worker_id": self.worker_id,
                 "incarnation": os.environ.get("NEREUS_AGENT_INCARNATION", "")}
        self.sock.send_multipart([HELLO, pickle.dumps(hello)])
        # the beats come from a process of their own (agent.beat): a thread here would fall silent
        # whenever torch holds the GIL in a long blocking call, and a busy worker would look dead
        import subprocess
        import sys

        bundle = self.bundle
        self._beat = subprocess.Popen([sys.executable, "-m", "agent.beat", endpoint, self.node, str(self.device),
                                       str(self.pid)], stdin=subprocess.PIPE)
        keys = b"\n".join((bundle.public_key, bundle.public_key, bundle.secret_key)) if bundle is not None else b""
        assert self._beat.stdin is not None
        self._beat.stdin.write(keys + b"\n")
        self._beat.stdin.close()

    def _redial_if_moved(self) -> None:
        """A new driver was published (the old one went with its node): dial it, keeping what is held."""
        now = _published(self.driver_file)
        if not now or not now.get("endpoint") or now == self.published:
            return
        self.published = now
        self._stop_beat()
        self.sock.close(linger=0)  # replies to a dead driver are dropped
        self._dial(str(now["endpoint"]))

    def _stop_beat(self) -> None:
        self._beat.terminate()
        try:
            self._beat.wait(5)
        except Exception:  # noqa: BLE001 - it exits with this process anyway
            self._beat.kill()

    def _socket(self, endpoint: str, bundle: ClientBundle | None, kind: int) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 1000)
        if bundle is not None:
            sock.curve_serverkey = bundle.public_key
            sock.curve_publickey = bundle.public_key
            sock.curve_secretkey = bundle.secret_key
        sock.connect(endpoint)
        return sock

    def _orphaned(self) -> bool:
        return os.getppid() != self.parent

    def wait_assignment(self) -> int:
        """The worker id the driver gives this device (raises EOFError if the agent goes first)."""
        while True:
            if self.sock.poll(1000):
                kind, body = self.sock.recv_multipart()
                if kind == ASSIGN:
                    self.worker_id = int(pickle.loads(body))
                    return self.worker_id
                if kind == BYE:
                    raise EOFError("the driver said bye before assigning this worker")
            elif self._orphaned():
                raise EOFError("the node agent is gone")
            else:
                self._redial_if_moved()

    def recv(self) -> tuple[int, Any]:
        while True:
            if self.sock.poll(1000):
                kind, *rest = self.sock.recv_multipart()
                if kind == b"cmd" and len(rest) == 2:
                    seq = int(rest[0])
                    try:
                        return seq, pickle.loads(rest[1])
                    except Exception as exc:  # noqa: BLE001 - answered as an error; the worker lives on
                        return seq, Undecodable(f"{type(exc).__name__}: {exc}")
                if kind == BYE:
                    raise EOFError("the driver said bye")
            elif self._orphaned():
                raise EOFError("the node agent is gone")
            else:
                self._redial_if_moved()

    def send(self, reply: Reply) -> None:
        self.sock.send_multipart([b"reply", pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)])

    def close(self) -> None:
        self._stop_beat()
        self.sock.close(linger=1000)
        self.ctx.term()


def _published(path: str | None) -> dict[str, Any] | None:
    """The driver record in ``path`` ({"endpoint", "written_at", ...}: agent.slurm_task.publish), or None."""
    if not path:
        return None
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
