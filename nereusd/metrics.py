"""Prometheus metrics of the daemon (prometheus-client), on a registry of its own.

Jobs by state, GPUs held per job, step latency measured vs predicted, transitions and their cost,
decision time, agents connected and rejected control messages. Served on ``metrics.port``
(0: a free port) at /metrics.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.exposition import generate_latest

_LATENCY_BUCKETS = (0.01, 0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600, 1800)
_DECISION_BUCKETS = (1e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.jobs = Gauge("nereus_jobs", "Jobs known to the daemon, by state", ["state"], registry=r)
        self.gpus_held = Gauge("nereus_gpus_held", "GPUs (or CPU worker slots) held by a job", ["job"], registry=r)
        self.nodes = Gauge("nereus_nodes", "Nodes of a job by state", ["job", "state"], registry=r)
        self.agents_connected = Gauge("nereus_agents_connected", "Agent sessions bound to a node", registry=r)
        self.step_latency = Gauge("nereus_step_latency_seconds",
                                  "Latest RL step latency of a job: measured, and predicted for its plan",
                                  ["job", "kind"], registry=r)
        self.transitions = Counter("nereus_transitions", "Transitions by outcome", ["job", "outcome"], registry=r)
        self.transition_cost = Histogram("nereus_transition_cost_seconds",
                                         "Transition time: predicted (L_tran) and measured", ["kind"],
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.transition_bytes = Counter("nereus_transition_bytes", "Bytes moved by transitions", ["job"],
                                        registry=r)
        self.decisions = Counter("nereus_decisions", "Replan decisions", ["job", "admitted"], registry=r)
        self.decision_time = Histogram("nereus_decision_seconds", "Time to replan and judge a candidate",
                                       buckets=_DECISION_BUCKETS, registry=r)
        self.rejected = Counter("nereus_control_messages_rejected", "Control messages rejected, by code",
                                ["code"], registry=r)
        self.messages = Counter("nereus_control_messages", "Control messages accepted, by type", ["type"],
                                registry=r)
        self.server: Any = None
        self.port: int | None = None

    def serve(self, host: str, port: int) -> int:
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self.server = server
        self.port = int(server.server_address[1])
        return self.port

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def text(self) -> str:
        return generate_latest(self.registry).decode()
