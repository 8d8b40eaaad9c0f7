"""Per-key connection limits on the agent socket.

Every agent is one TCP connection, registered or not; without a bound, one agent key could open
thousands (each a descriptor, buffers and a CURVE handshake) and take them from every other user.
ZeroMQ hides connections behind the ROUTER, but tells enough to account for them:

- the socket's monitor reports each accepted and each closed connection by its file descriptor;
- every received frame carries the descriptor it came from (``ZMQ_SRCFD``), and its CURVE User-Id
  names the key (``nereusd.control``).

So a connection's first message binds its descriptor to (routing id, key). A key may hold
``limit_of(user)`` connections: the node limits of its user's live jobs plus
``control.spare_connections_per_key`` (reconnects while a dead connection lingers, an agent that
starts before its job is added). The message that would pass the limit is answered ``forbidden``,
naming the limit, and that connection is closed once the reply is out; the key's other connections,
and every other key's, are untouched. A connection that sends nothing within
``control.silent_connection_s`` of being accepted is closed too (its key is never known).

Closing is ``shutdown(2)`` of the connection's socket (ZeroMQ then drops it as if the peer had gone).
The monitor drops events when it falls behind, so a descriptor is only shut down while it still has
the peer address recorded for it (never a later connection that reused the number), and a key at its
limit first forgets connections whose descriptors no longer hold their peer.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

CUT_DELAY_S = 0.1  # a refused connection is closed this long after its reply was queued
LIMIT_CACHE_S = 1.0  # a user's limit is recomputed (from the store) at most this often
MONITOR_BATCH = 10_000  # monitor events read per pump


def _peer(fd: int) -> Any:
    """The remote address of socket ``fd``, or None (closed, not a socket)."""
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            return s.getpeername()
    except OSError:
        return None


@dataclass(slots=True)
class Conn:
    identity: bytes
    key: str
    user: str
    peer: Any


class ConnectionGuard:
    def __init__(self, sock: zmq.Socket, *, limit_of: Callable[[str], tuple[int, str]], silent_s: float,
                 log: Any) -> None:
        self.monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.monitor.rcvhwm = 0
        self.limit_of = limit_of
        self.silent_s = silent_s
        self.log = log
        self.opened: dict[int, tuple[float, Any]] = {}  # fd -> (accepted at, peer): no message yet
        self.conns: dict[int, Conn] = {}  # fd -> the connection its first message named
        self.to_cut: list[tuple[float, int, Any]] = []  # (due, fd, peer)
        self._limits: dict[str, tuple[float, tuple[int, str]]] = {}
        self.refused = 0
        self.cut = 0

    def close(self) -> None:
        self.monitor.close(linger=0)

    # --- what the monitor says ---------------------------------------------------------------------
    def pump(self) -> None:
        for _ in range(MONITOR_BATCH):
            try:
                frames = self.monitor.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            event, fd = struct.unpack("=HI", frames[0][:6])  # ZMTP monitor frame: event id, value (the fd)
            self.conns.pop(fd, None)  # accepted or closed: whatever this fd was before is gone
            if event == zmq.EVENT_ACCEPTED:
                self.opened[fd] = (time.monotonic(), _peer(fd))
            else:
                self.opened.pop(fd, None)

    # --- each message ------------------------------------------------------------------------------
    def admit(self, fd: int, identity: bytes, user: str, key: str) -> str | None:
        """None when this message's connection may speak; else why not (the caller replies forbidden)."""
        if fd < 0:
            return None
        known = self.conns.get(fd)
        if known is not None:
            if known.identity == identity and known.key == key:
                return None
            del self.conns[fd]  # the number now belongs to another connection (its close was missed)
        if fd not in self.opened:
            self.pump()  # its accept may still be queued on the monitor
        _, peer = self.opened.pop(fd, (0.0, None))
        peer = peer if peer is not None else _peer(fd)
        limit, why = self._limit(user)
        held = self._held(key)
        if held >= limit:
            held = self._forget_dead(key)
        if held >= limit:
            self.refused += 1
            self.to_cut.append((time.monotonic() + CUT_DELAY_S, fd, peer))
            self.log.warning("connection-refused", user=user, key=key[:8] + "...", held=held, limit=limit)
            return (f"this key ({key[:8]}...) already holds {held} connections, its limit {limit} ({why}); "
                    "this connection is closed")
        self.conns[fd] = Conn(identity=identity, key=key, user=user, peer=peer)
        return None

    def _limit(self, user: str) -> tuple[int, str]:
        now = time.monotonic()
        cached = self._limits.get(user)
        if cached is None or now - cached[0] > LIMIT_CACHE_S:
            cached = (now, self.limit_of(user))
            self._limits[user] = cached
        return cached[1]

    def _held(self, key: str) -> int:
        return sum(1 for c in self.conns.values() if c.key == key)

    def _forget_dead(self, key: str) -> int:
        """Drop the key's connections whose descriptor no longer holds their peer (missed closes)."""
        for fd in [fd for fd, c in self.conns.items() if c.key == key]:
            if _peer(fd) != self.conns[fd].peer:
                del self.conns[fd]
        return self._held(key)

    # --- each tick ---------------------------------------------------------------------------------
    def service(self) -> None:
        """Close refused connections whose reply is out, and connections silent past ``silent_s``."""
        self.pump()
        now = time.monotonic()
        due = [c for c in self.to_cut if c[0] <= now]
        self.to_cut = [c for c in self.to_cut if c[0] > now]
        for fd, (since, peer) in list(self.opened.items()):
            if now - since > self.silent_s:
                del self.opened[fd]
                due.append((now, fd, peer))
                self.log.info("connection-silent", seconds=round(now - since, 1))
        for _, fd, peer in due:
            self._shutdown(fd, peer)

    def _shutdown(self, fd: int, peer: Any) -> None:
        if peer is None:
            return
        try:
            with socket.socket(fileno=os.dup(fd)) as s:
                if s.getpeername() != peer:  # closed meanwhile and the number reused: not ours to cut
                    return
                s.shutdown(socket.SHUT_RDWR)
        except OSError:  # already closed
            return
        self.conns.pop(fd, None)
        self.cut += 1

    def counts(self) -> dict[str, int]:
        return {"identified": len(self.conns), "silent": len(self.opened), "refused": self.refused,
                "closed": self.cut}
