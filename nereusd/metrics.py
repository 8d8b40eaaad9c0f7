"""Prometheus metrics of the daemon (prometheus-client), on a registry of its own.

Jobs by state, GPUs held per job, step latency measured vs predicted, transitions and their cost,
decision time, agents connected and rejected control messages; and per job the RL figures of its
latest step (reward, KL, entropy, response length, clip fractions, tokens/s, stage times, plan version,
pool: ``nereus_rl_*``) from the driver's Measurement. Served on ``metrics.port``
(0: a free port) at /metrics.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.exposition import generate_latest

_LATENCY_BUCKETS = (0.01, 0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600, 1800)
_DECISION_BUCKETS = (1e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


# protocol.RLMetrics field -> help; each is the gauge nereus_rl_<field>{job}; a None field leaves it as it was
RL_GAUGES = {
    "reward_mean": "Mean reward of a job's latest step",
    "reward_std": "Standard deviation of the rewards of a job's latest step",
    "kl_ref": "KL to the reference (k3, per token) of a job's latest step",
    "entropy": "Policy entropy (nats per token) of a job's latest step",
    "clip_fraction": "Fraction of response tokens whose policy ratio was clipped, latest step",
    "value_clip_fraction": "Fraction of response tokens whose value was clipped (PPO), latest step",
    "tokens_per_s": "Generated tokens per second of a job's latest step",
    "pool_gpus": "GPUs in the job driver's pool at its latest step",
}
RESPONSE_STATS = {"mean": "response_len_mean", "p95": "response_len_p95", "max": "response_len_max"}


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
        # the job's RL figures per step (the driver's Measurement.rl, agent.metrics)
        self.rl_step = Gauge("nereus_rl_step", "RL steps done by a job (its latest measured step + 1)", ["job"],
                             registry=r)
        self.plan_version = Gauge("nereus_rl_plan_version", "Plan version of a job's latest step", ["job"],
                                  registry=r)
        self.stage_seconds = Gauge("nereus_rl_stage_seconds", "Latest per-model-stage time of a job's step",
                                   ["job", "stage"], registry=r)
        self.rl = {name: Gauge(f"nereus_rl_{name}", doc, ["job"], registry=r) for name, doc in RL_GAUGES.items()}
        self.response_tokens = Gauge("nereus_rl_response_tokens", "Response length of a job's latest step "
                                     "(generated tokens per sequence)", ["job", "stat"], registry=r)
        self.server: Any = None
        self.port: int | None = None

    def observe_step(self, msg: Any) -> None:
        """A job's step Measurement (protocol.Measurement): its stage times, plan version and RL figures."""
        job = msg.job_id
        self.rl_step.labels(job).set(msg.step + 1)
        self.plan_version.labels(job).set(msg.plan_version)
        for stage, s in msg.stage_times_s.items():
            self.stage_seconds.labels(job, stage).set(s)
        if msg.rl is None:
            return
        for name, gauge in self.rl.items():
            value = getattr(msg.rl, name)
            if value is not None:
                gauge.labels(job).set(value)
        for stat, name in RESPONSE_STATS.items():
            self.response_tokens.labels(job, stat).set(getattr(msg.rl, name))

    def forget_job(self, job: str) -> None:
        """An ended job's per-job gauges leave the export (a finished run's last figures would otherwise
        stay on dashboards as if it were still running). Counters stay: they are totals."""
        gauges = [self.gpus_held, self.nodes, self.step_latency, self.rl_step, self.plan_version,
                  self.stage_seconds, self.response_tokens, *self.rl.values()]
        for gauge in gauges:
            for metric in gauge.collect():
                for labels in {tuple(x.labels.values()) for x in metric.samples if x.labels.get("job") == job}:
                    gauge.remove(*labels)

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
