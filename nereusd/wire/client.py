"""A CURVE DEALER client of the daemon, shared by node agents, nereusctl, tests and the benchmark.

The client watches its socket's monitor for ZeroMQ's handshake events, so a refused key surfaces as
``AuthRefused`` right away instead of a silent time-out (CURVE never lets an unauthorised peer send).
"""

from __future__ import annotations

import time
from typing import Any

import zmq
from pydantic import BaseModel
from zmq.utils.monitor import parse_monitor_message

from nereusd.wire import protocol
from nereusd.wire.keys import ClientBundle
from planner.errors import NereusError


class Unreachable(NereusError):
    """No reply within the time-out (daemon down, wrong endpoint)."""


class AuthRefused(NereusError):
    """The daemon refused this client's CURVE key (unknown key, wrong role, wrong server key)."""


class CurveClient:
    def __init__(self, endpoint: str, bundle: ClientBundle, *, identity: bytes | None = None,
                 context: zmq.Context | None = None, max_message_bytes: int = 64 << 20,
                 encoding: protocol.Encoding = "msgpack", immediate: bool = False, monitor: bool = True) -> None:
        self.ctx = context or zmq.Context.instance()
        self.endpoint = endpoint
        self.encoding: protocol.Encoding = encoding
        self.max_message_bytes = max_message_bytes
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.curve_serverkey = bundle.server_public_key
        self.sock.curve_publickey = bundle.public_key
        self.sock.curve_secretkey = bundle.secret_key
        if identity is not None:
            self.sock.identity = identity  # stable across reconnects: the daemon can find the session again
        self.sock.linger = 0
        # immediate: queue nothing while disconnected (an agent's stale heartbeats must not pile up and
        # flood a restarted daemon); a one-shot CLI request wants the message queued until connected.
        self.sock.immediate = immediate
        self.sock.reconnect_ivl = 100
        self.sock.reconnect_ivl_max = 2000
        # the monitor costs two more sockets; simulated fleets (bench) go without it
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                                    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                                    | zmq.EVENT_HANDSHAKE_SUCCEEDED) if monitor else None
        self.sock.connect(endpoint)
        self.auth_failed: str | None = None
        self.handshakes = 0

    def close(self) -> None:
        if self.monitor is not None:
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
        self.sock.close(linger=0)

    def _drain_monitor(self) -> None:
        while self.monitor is not None and self.monitor.poll(0):
            ev = parse_monitor_message(self.monitor.recv_multipart())
            if ev["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.handshakes += 1
                self.auth_failed = None
            else:
                self.auth_failed = f"handshake refused by {self.endpoint} (ZMTP status {ev['value']})"

    def send(self, msg: BaseModel) -> bool:
        """False when the message could not be queued (no connection, with ``immediate``)."""
        try:
            self.sock.send(protocol.encode(msg, self.encoding), flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def send_raw(self, frame: bytes) -> None:
        self.sock.send(frame)

    def recv(self, timeout_s: float) -> Any | None:
        """The next message, or None after ``timeout_s``; raises AuthRefused when the key was refused."""
        deadline = time.monotonic() + timeout_s
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        if self.monitor is not None:
            poller.register(self.monitor, zmq.POLLIN)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready = dict(poller.poll(int(left * 1e3) + 1))
            if self.monitor is not None and self.monitor in ready:
                self._drain_monitor()
                if self.auth_failed:
                    raise AuthRefused(self.auth_failed)
            if self.sock in ready:
                return protocol.decode(self.sock.recv(), self.max_message_bytes)

    def request(self, msg: BaseModel, timeout_s: float = 5.0) -> Any:
        self.send(msg)
        reply = self.recv(timeout_s)
        if reply is None:
            raise Unreachable(f"no reply from {self.endpoint} within {timeout_s:g} s: is nereusd running "
                              "(systemctl status nereusd) and is this the right endpoint?")
        return reply
