"""The daemon's transport: the agent and admin CURVE ROUTERs (a ZeroMQ context each, with its own
I/O thread and ZAP handler, so nereusctl's handshake never waits behind a storm of agent handshakes),
the connection guard, the metrics endpoint and ``<state_dir>/endpoints.json``; bound at start-up and
closed at shutdown. A mixin of ``nereusd.daemon.Daemon``, which owns the state it reads (declared
below). Never imports torch."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from nereusd.connections import ConnectionGuard
from nereusd.control import ADMIN_DOMAIN, AGENT_DOMAIN, CurveRouter, start_authenticator
from nereusd.metrics import Metrics
from nereusd.settings import Settings
from nereusd.startup import StartupError, _write_atomic_json, raise_fd_limit
from nereusd.wire.keys import KeyStore
from planner.errors import SpecError


class Transport:
    # the Daemon's state these methods use (set in Daemon.__init__), and what _bind sets
    keys: KeyStore
    log: Any
    metrics: Metrics
    state_dir: Path
    connection_limit: Callable[..., Any]  # nereusd.agent_sessions.AgentSessions.connection_limit
    ctx: zmq.Context | None
    admin_ctx: zmq.Context | None
    agents: CurveRouter
    admin: CurveRouter
    connections: ConnectionGuard
    endpoints: dict[str, str | None]

    def _bind(self, settings: Settings) -> None:
        ctl = settings.control
        fd_limit = raise_fd_limit()
        # agents and admin each get a context: their own I/O thread (CURVE crypto) and ZAP handler, so
        # nereusctl's handshake never waits behind a storm of agent handshakes (control.start_authenticator)
        self.ctx = zmq.Context()
        self.admin_ctx = zmq.Context()
        self.ctx.set(zmq.MAX_SOCKETS, max(1024, fd_limit))
        self.auth = start_authenticator(self.ctx, self.keys, self.log, (AGENT_DOMAIN,))
        self.admin_auth = start_authenticator(self.admin_ctx, KeyStore(self.keys.root), self.log, (ADMIN_DOMAIN,))
        try:
            server_keys = self.keys.server_keys()
        except SpecError as exc:
            raise StartupError(str(exc)) from None
        # ZMTP pings drop a dead connection (a crashed host) so its agent can reconnect with its routing id;
        # no sooner than a node would be marked lost anyway, so a loaded client is never cut off early
        hb = max(1.0, ctl.heartbeat_interval_s * 2)
        hb_timeout = max(3 * hb, ctl.heartbeat_timeout_s)
        for name, port in (("agents", ctl.port), ("admin", ctl.admin_port)):
            try:
                router = CurveRouter(self.ctx if name == "agents" else self.admin_ctx,
                                     domain=AGENT_DOMAIN if name == "agents" else ADMIN_DOMAIN,
                                     server_keys=server_keys, host=ctl.bind_host, port=port,
                                     max_message_bytes=ctl.max_message_bytes, log=self.log, heartbeat_s=hb,
                                     heartbeat_timeout_s=hb_timeout,
                                     on_reject=lambda code: self.metrics.rejected.labels(code).inc())
            except zmq.ZMQError as exc:
                key = "control.port" if name == "agents" else "control.admin_port"
                raise StartupError(f"cannot bind the {name} socket to tcp://{ctl.bind_host}:{port} ({exc}): "
                                   f"check control.bind_host (an address of this host) and {key} (a free port)"
                                   ) from None
            setattr(self, name, router)
        self.connections = ConnectionGuard(self.agents.sock, limit_of=self.connection_limit,
                                           silent_s=ctl.silent_connection_s, log=self.log)
        self.agents.admit = self.connections.admit
        self.endpoints = {"control": f"tcp://{ctl.bind_host}:{self.agents.port}",
                          "admin": f"tcp://{ctl.bind_host}:{self.admin.port}", "metrics": None}
        if settings.metrics.enabled:
            try:
                port = self.metrics.serve(ctl.bind_host, settings.metrics.port)
            except OSError as exc:
                raise StartupError(f"cannot serve metrics on {ctl.bind_host}:{settings.metrics.port} "
                                   f"({exc.strerror or exc}): set metrics.port to a free port, or "
                                   "metrics.enabled = false") from None
            self.endpoints["metrics"] = f"http://{ctl.bind_host}:{port}/metrics"
        try:
            _write_atomic_json(self.state_dir / "endpoints.json", {**self.endpoints, "pid": os.getpid()})
        except OSError as exc:
            raise StartupError(f"cannot write {self.state_dir / 'endpoints.json'}: {exc.strerror}") from None

    def _close_transport(self) -> None:
        if getattr(self, "connections", None) is not None:
            self.connections.close()
        for name in ("agents", "admin"):
            router = getattr(self, name, None)
            if router is not None:
                router.close()
        for name in ("auth", "admin_auth"):
            if getattr(self, name, None) is not None:
                getattr(self, name).stop()
        for name in ("ctx", "admin_ctx"):
            if getattr(self, name, None) is not None:
                getattr(self, name).term()
                setattr(self, name, None)
        self.metrics.close()

