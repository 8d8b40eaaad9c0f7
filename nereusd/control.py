"""The control plane: agents talk to nereusd over a ZeroMQ ROUTER socket with CURVE.

Three gates, in order, for every frame:
1. CURVE (ZAP): the client's public key must be an authorised key of the right role (agent keys on
   the agent socket, admin keys on the admin socket); anyone else never gets a message through.
   The frame's User-Id is ``"<user> <public key>"``: the daemon knows who sent it from the key alone.
2. ``protocol.decode``: oversized, malformed, wrong-version and invalid messages get an ErrorReply
   naming the field, and the loop goes on.
3. Authorisation: a message about a job is accepted only from that job's (Slurm) user, and a
   heartbeat/report only from the connection and key that registered the node.

Routing ids are never trusted as identity: the ROUTER refuses a second connection that claims a
routing id already in use (no ZMQ handover), so no key can take over another's connection, and a
session is bound to (routing id, key), never to a name the client picked. Dead connections are
dropped by ZMTP heartbeats, so an agent that reconnects with its routing id gets it back.

``ControlServer`` does transport and those gates; what a message *means* is the ``on_message`` hook
that the daemon supplies (nereusd/daemon.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.auth.thread
from pydantic import BaseModel

from nereusd.wire import protocol
from nereusd.wire.keys import KeyStore, Role

AGENT_DOMAIN = "nereus-agent"
ADMIN_DOMAIN = "nereus-admin"
_DOMAIN_ROLE: dict[str, Role] = {AGENT_DOMAIN: "agent", ADMIN_DOMAIN: "admin"}


class _KeyAuthenticator(zmq.auth.thread.ThreadAuthenticator):
    """ZAP handler: authorised keys by role per domain; the User-Id is "<user> <public key>".

    Nothing a client or a key file does may raise here: an exception would end the ZAP thread and
    leave the daemon deaf to every new connection. A bad key file is skipped and reported by KeyStore;
    any other failure refuses that one handshake and is logged."""

    def __init__(self, context: zmq.Context, keys: KeyStore, log: Any) -> None:
        super().__init__(context)
        self._keys = keys
        self._nlog = log
        self._reported: tuple[str, ...] = ()

    def _authorised(self) -> dict[bytes, Any]:
        found = self._keys.authorised()
        problems = tuple(self._keys.problems)
        if problems != self._reported:
            for p in problems:
                self._nlog.error("key-file-skipped", problem=p)
            self._reported = problems
        return found

    def callback(self, domain: str, key: bytes) -> bool:
        try:
            client = self._authorised().get(key)
            ok = client is not None and client.role == _DOMAIN_ROLE.get(domain)
            if not ok:
                self._nlog.warning("curve-refused", domain=domain, key=key.decode(errors="replace")[:8] + "...",
                                   reason="unknown key" if client is None else f"role {client.role} on {domain}")
            return ok
        except Exception as exc:  # refuse this handshake; the thread must live on
            self._nlog.error("curve-check-failed", domain=domain, error=repr(exc))
            return False

    def curve_user_id(self, client_public_key: bytes) -> str:
        import zmq.utils.z85 as z85

        try:
            z = z85.encode(client_public_key)
            client = self._authorised().get(z)
            return f"{client.user} {z.decode()}" if client is not None else ""
        except Exception as exc:
            self._nlog.error("curve-user-id-failed", error=repr(exc))
            return ""


def start_authenticator(context: zmq.Context, keys: KeyStore, log: Any,
                        domains: tuple[str, ...] = tuple(_DOMAIN_ROLE)) -> _KeyAuthenticator:
    """The ZAP handler of ``context`` for ``domains``. ZAP is per context and serves one handshake at a
    time, in a Python thread that waits for the GIL whenever the serve loop is busy (a few ms per
    handshake): the daemon gives the admin socket a context, I/O thread and handler of its own, so a
    storm of agent handshakes never queues a nereusctl connection behind it."""
    auth = _KeyAuthenticator(context, keys, log)
    auth.start()
    for domain in domains:
        auth.configure_curve_callback(domain, credentials_provider=auth)
    return auth


@dataclass(slots=True)
class Incoming:
    identity: bytes
    user: str  # from the CURVE key (ZAP), never from the message
    key: str  # the client's public key (z85): what a session is bound to
    frame_bytes: int
    encoding: protocol.Encoding
    fd: int = -1  # the connection's descriptor (ZMQ_SRCFD): what per-key connection limits count


class CurveRouter:
    """A ROUTER socket bound with CURVE on one domain; decodes frames and replies in kind."""

    def __init__(self, context: zmq.Context, *, domain: str, server_keys: tuple[bytes, bytes], host: str,
                 port: int, max_message_bytes: int, log: Any, on_reject: Callable[[str], None],
                 heartbeat_s: float = 2.0, heartbeat_timeout_s: float = 6.0) -> None:
        self.sock = context.socket(zmq.ROUTER)
        self.sock.curve_server = True
        self.sock.curve_publickey, self.sock.curve_secretkey = server_keys
        self.sock.zap_domain = domain.encode()
        self.sock.linger = 0
        self.sock.router_mandatory = False  # replies to peers that went away are dropped, not raised
        # A routing id in use is never handed to a second connection (another key could take it over);
        # ZMTP heartbeats drop dead connections, so an agent reconnecting with its routing id gets it back.
        self.sock.router_handover = False
        self.sock.heartbeat_ivl = int(heartbeat_s * 1e3)
        self.sock.heartbeat_timeout = int(heartbeat_timeout_s * 1e3)
        # A hard guard far above the protocol limit: messages between the two get an ErrorReply, only
        # absurd ones make ZeroMQ drop the connection (which must not buffer a gigabyte first).
        self.sock.setsockopt(zmq.MAXMSGSIZE, 16 * max_message_bytes)
        self.sock.sndhwm = 100_000
        try:
            if port == 0:
                self.port = self.sock.bind_to_random_port(f"tcp://{host}")
            else:
                self.sock.bind(f"tcp://{host}:{port}")
                self.port = port
        except zmq.ZMQError:
            self.sock.close(linger=0)  # an open socket would keep the context from terminating
            raise
        self.max_message_bytes = max_message_bytes
        self.log = log
        self.on_reject = on_reject
        # (fd, routing id, user, key) -> None, or why this connection may not speak (nereusd.connections)
        self.admit: Callable[[int, bytes, str, str], str | None] | None = None

    def close(self) -> None:
        self.sock.close(linger=0)

    def receive(self) -> tuple[Incoming, Any] | None:
        """One message, decoded; None (after replying with an error) when it was rejected."""
        frames = self.sock.recv_multipart(copy=False)
        identity = frames[0].bytes
        body = frames[-1]
        user, _, key = (body.get("User-Id") or "").partition(" ")
        data = body.bytes
        enc = protocol.encoding_of(data)
        inc = Incoming(identity=identity, user=user, key=key, frame_bytes=len(data), encoding=enc,
                       fd=body.get(zmq.SRCFD))
        if not key:
            self.reject(inc, "forbidden", "this connection's key is no longer authorised (revoked?)")
            return None
        refused = self.admit(inc.fd, identity, user, key) if self.admit is not None else None
        if refused is not None:
            self.reject(inc, "forbidden", refused)
            return None
        if len(frames) != 2:
            self.reject(inc, "malformed", f"expected one body frame, got {len(frames) - 1}")
            return None
        try:
            return inc, protocol.decode(data, self.max_message_bytes)
        except protocol.ProtocolError as exc:
            self.reject(inc, exc.code, str(exc))
            return None

    def reject(self, inc: Incoming, code: str, message: str) -> None:
        self.log.warning("message-rejected", code=code, user=inc.user, bytes=inc.frame_bytes, error=message)
        self.on_reject(code)
        self.send(inc.identity, protocol.ErrorReply(code=code, message=message), inc.encoding)

    def send(self, identity: bytes, msg: BaseModel, encoding: protocol.Encoding = "msgpack") -> None:
        try:
            self.sock.send_multipart([identity, protocol.encode(msg, encoding)], flags=zmq.NOBLOCK)
        except zmq.Again:  # the peer's queue is full: it is not reading; heartbeats will tell
            self.log.warning("send-dropped", peer=identity[:32].hex())


@dataclass(slots=True)
class Session:
    """An agent connection: which node of which job, for which user and key; the encoding it speaks."""

    job_id: str
    node: str
    user: str
    key: str  # the CURVE public key that registered the node
    encoding: protocol.Encoding


class SessionTable:
    """Agent connection (routing id) <-> (job, node), one node per connection. Authorisation of
    follow-up messages checks against it."""

    def __init__(self) -> None:
        self.by_identity: dict[bytes, Session] = {}
        self.by_node: dict[tuple[str, str], bytes] = {}

    def bind(self, identity: bytes, session: Session) -> None:
        old = self.by_node.get((session.job_id, session.node))
        if old is not None and old != identity:
            self.by_identity.pop(old, None)
        self.by_identity[identity] = session
        self.by_node[(session.job_id, session.node)] = identity

    def drop_node(self, job_id: str, node: str) -> None:
        ident = self.by_node.pop((job_id, node), None)
        if ident is not None:
            self.by_identity.pop(ident, None)

    def identities_of(self, job_id: str) -> dict[str, bytes]:
        return {node: ident for (j, node), ident in self.by_node.items() if j == job_id}

    def __len__(self) -> int:
        return len(self.by_identity)


def check_session(sessions: SessionTable, identity: bytes, key: str, job_id: str, node: str) -> tuple[str, str] | None:
    """None when (connection, key) may speak for (job, node); else an (error code, message)."""
    s = sessions.by_identity.get(identity)
    if s is None:
        return "unknown-session", "this agent is not registered (the daemon restarted?): send register again"
    if s.key != key or s.job_id != job_id or s.node != node:
        return "forbidden", f"this session speaks for {s.job_id}/{s.node}, not {job_id}/{node}"
    return None
