"""The control plane: agents talk to nereusd over a ZeroMQ ROUTER socket with CURVE.

Three gates, in order, for every frame:
1. CURVE (ZAP): the client's public key must be an authorised key of the right role (agent keys on
   the agent socket, admin keys on the admin socket); anyone else never gets a message through.
   The key's user name becomes the frame's User-Id.
2. ``protocol.decode``: oversized, malformed, wrong-version and invalid messages get an ErrorReply
   and a log line, and the loop goes on.
3. Authorisation: a message about a job is accepted only from that job's (Slurm) user, and a
   heartbeat/report only from the agent session that registered the node.

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

from nereusd import protocol
from nereusd.keys import KeyStore, Role

AGENT_DOMAIN = "nereus-agent"
ADMIN_DOMAIN = "nereus-admin"
_DOMAIN_ROLE: dict[str, Role] = {AGENT_DOMAIN: "agent", ADMIN_DOMAIN: "admin"}


class _KeyAuthenticator(zmq.auth.thread.ThreadAuthenticator):
    """ZAP handler: authorised keys by role per domain; the User-Id is the key's user name."""

    def __init__(self, context: zmq.Context, keys: KeyStore, log: Any) -> None:
        super().__init__(context)
        self._keys = keys
        self._nlog = log

    def callback(self, domain: str, key: bytes) -> bool:
        client = self._keys.authorised().get(key)
        ok = client is not None and client.role == _DOMAIN_ROLE.get(domain)
        if not ok:
            self._nlog.warning("curve-refused", domain=domain, key=key.decode()[:8] + "...",
                               reason="unknown key" if client is None else f"role {client.role} on {domain}")
        return ok

    def curve_user_id(self, client_public_key: bytes) -> str:
        import zmq.utils.z85 as z85

        return self._keys.authorised()[z85.encode(client_public_key)].user


def start_authenticator(context: zmq.Context, keys: KeyStore, log: Any) -> _KeyAuthenticator:
    auth = _KeyAuthenticator(context, keys, log)
    auth.start()
    for domain in _DOMAIN_ROLE:
        auth.configure_curve_callback(domain, credentials_provider=auth)
    return auth


@dataclass(slots=True)
class Incoming:
    identity: bytes
    user: str
    frame_bytes: int
    encoding: protocol.Encoding


class CurveRouter:
    """A ROUTER socket bound with CURVE on one domain; decodes frames and replies in kind."""

    def __init__(self, context: zmq.Context, *, domain: str, server_keys: tuple[bytes, bytes], host: str,
                 port: int, max_message_bytes: int, log: Any, on_reject: Callable[[str], None]) -> None:
        self.sock = context.socket(zmq.ROUTER)
        self.sock.curve_server = True
        self.sock.curve_publickey, self.sock.curve_secretkey = server_keys
        self.sock.zap_domain = domain.encode()
        self.sock.linger = 0
        self.sock.router_mandatory = False  # replies to peers that went away are dropped, not raised
        # An agent keeps its routing id across reconnects; a restarted agent process takes the id over.
        self.sock.router_handover = True
        # A hard guard far above the protocol limit: messages between the two get an ErrorReply, only
        # absurd ones make ZeroMQ drop the connection (which must not buffer a gigabyte first).
        self.sock.setsockopt(zmq.MAXMSGSIZE, 16 * max_message_bytes)
        self.sock.sndhwm = 100_000
        if port == 0:
            self.port = self.sock.bind_to_random_port(f"tcp://{host}")
        else:
            self.sock.bind(f"tcp://{host}:{port}")
            self.port = port
        self.max_message_bytes = max_message_bytes
        self.log = log
        self.on_reject = on_reject

    def close(self) -> None:
        self.sock.close(linger=0)

    def receive(self) -> tuple[Incoming, Any] | None:
        """One message, decoded; None (after replying with an error) when it was rejected."""
        frames = self.sock.recv_multipart(copy=False)
        identity = frames[0].bytes
        body = frames[-1]
        user = body.get("User-Id")
        data = body.bytes
        enc = protocol.encoding_of(data)
        inc = Incoming(identity=identity, user=user, frame_bytes=len(data), encoding=enc)
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
    """An agent connection: which node of which job, for which user; encoding the agent speaks."""

    job_id: str
    node: str
    user: str
    encoding: protocol.Encoding


class SessionTable:
    """Agent identity <-> (job, node). Authorisation of follow-up messages checks against it."""

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


def check_session(sessions: SessionTable, identity: bytes, user: str, job_id: str, node: str) -> tuple[str, str] | None:
    """None when (identity, user) may speak for (job, node); else an (error code, message)."""
    s = sessions.by_identity.get(identity)
    if s is None:
        return "unknown-session", "this agent is not registered (the daemon restarted?): send register again"
    if s.user != user or s.job_id != job_id or s.node != node:
        return "forbidden", f"this session speaks for {s.job_id}/{s.node}, not {job_id}/{node}"
    return None
