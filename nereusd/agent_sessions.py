"""The daemon's side of the agents: one message at a time off the agent socket (validated at the
protocol boundary, bound to the CURVE key's session), registration with its per-job node and per-key
connection limits, Leaving (a node's notice: drained, then let go), and orders sent to a node's agent.
A mixin of ``nereusd.daemon.Daemon``, which owns the state it reads (declared below). Never imports torch."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from typing import Any

from nereusd.allocation import AllocationError, ElasticJob
from nereusd.control import CurveRouter, Session, SessionTable, check_session
from nereusd.controller import JobController
from nereusd.metrics import Metrics
from nereusd.settings import Settings
from nereusd.store import TERMINAL_JOB_STATES, Store
from nereusd.wire import protocol

LEAVE_REASONS = {"preempt": "preemption notice", "time-limit": "time limit", "shutdown": "agent shutdown"}
TRANSIENT = (sqlite3.OperationalError, OSError)  # a full disk, a locked db: retried, never "damaged"
LOST_PER_TICK = 64  # silent nodes marked lost per tick; the rest on the next ticks


class AgentSessions:
    # the Daemon's state these methods use (set in Daemon.__init__ / _bind)
    store: Store
    settings: Settings
    log: Any
    metrics: Metrics
    agents: CurveRouter
    sessions: SessionTable
    source: Any
    controllers: dict[str, JobController]
    damaged: dict[str, str]
    node_state: dict[tuple[str, str], str]
    last_seen: dict[tuple[str, str], float]
    heartbeats_to_flush: dict[tuple[str, str], float]
    worker_states: dict[tuple[str, str], list[dict[str, Any]]]
    resend_to: list[tuple[str, str]]
    leaving: dict[tuple[str, str], str]

    # the Daemon's methods these call (nereusd.daemon, nereusd.source_requests)
    _start_controller: Callable[[str], JobController]
    _record_refusal: Callable[[str, str, Any, str], None]
    _mark_damaged: Callable[[str, str], None]

    def _agent_message(self) -> None:
        got = self.agents.receive()
        if got is None:
            return
        inc, msg = got
        try:
            reply = self._on_agent(inc.identity, inc.user, inc.key, inc.encoding, msg)
        except TRANSIENT as exc:  # a full disk: not stored, and the sender is told so
            self.log.error("agent-message-not-stored", type=msg.type, error=str(exc))
            reply = protocol.ErrorReply(code="internal", message=f"this {msg.type} was not stored ({exc}); "
                                        "send it again later")
        except Exception as exc:  # never no reply: the sender learns that this one was not taken
            self.log.exception("agent-handler-failed", type=msg.type)
            reply = protocol.ErrorReply(code="internal", message=f"the daemon failed on this {msg.type}: "
                                        f"{type(exc).__name__} (logged); the daemon keeps serving")
        if isinstance(reply, protocol.ErrorReply):
            self.agents.reject(inc, reply.code, reply.message)
        else:
            self.metrics.messages.labels(msg.type).inc()
            if reply is not None:
                self.agents.send(inc.identity, reply, inc.encoding)
        while self.resend_to:  # after the welcome: orders the node had not reported, sent again
            job_id, node = self.resend_to.pop()
            ctl = self.controllers.get(job_id)
            if ctl is not None:
                ctl.resend_orders(node)

    def _on_agent(self, identity: bytes, user: str, key: str, enc: protocol.Encoding, msg: Any) -> Any:
        if isinstance(msg, protocol.Register):
            return self._register(identity, user, key, enc, msg)
        if not isinstance(msg, (protocol.Heartbeat, protocol.Measurement, protocol.TransitionReport,
                                protocol.Leaving)):
            return protocol.ErrorReply(code="invalid", message=f"agents may not send {msg.type!r}")
        denied = check_session(self.sessions, identity, key, msg.job_id, msg.node)
        if denied is not None:
            return protocol.ErrorReply(code=denied[0], message=denied[1])
        if msg.job_id in self.damaged:
            return protocol.ErrorReply(code="internal", message=f"job {msg.job_id!r} is damaged in the daemon's "
                                       f"store ({self.damaged[msg.job_id]}); an admin must repair it")
        node_key = (msg.job_id, msg.node)
        self.last_seen[node_key] = time.monotonic()
        self.heartbeats_to_flush[node_key] = time.time()
        ctl = self.controllers.get(msg.job_id)
        if self.node_state.get(node_key) == "lost":
            self.store.set_node_state(msg.job_id, msg.node, "alive", "heartbeats resumed")
            self.node_state[node_key] = "alive"
            self.store.add_event("node-back", {"node": msg.node}, job_id=msg.job_id)
            if ctl is not None:
                ctl.on_node_joined(msg.node, "heartbeats resumed")
        if ctl is None:
            return protocol.ErrorReply(code="unknown-job", message=f"job {msg.job_id} has ended")
        if isinstance(msg, protocol.Heartbeat):
            workers = [w.model_dump() for w in msg.workers]
            if self.worker_states.get(node_key) != workers:  # stored on change only: 1 Hz x 1,024 nodes otherwise
                self.worker_states[node_key] = workers
                self.store.add_event("workers", {"node": msg.node, "workers": workers}, job_id=msg.job_id)
            return protocol.Ack(ref="heartbeat", seq=msg.seq)
        if isinstance(msg, protocol.Leaving):
            return self._on_leaving(ctl, msg)
        if isinstance(msg, protocol.Measurement):
            ctl.on_measurement(msg)
            self.metrics.observe_step(msg)
            if msg.rl is not None:
                self.store.attach_rl(msg.job_id, msg.step, msg.rl.model_dump())
            return protocol.Ack(ref="measurement", seq=msg.step)
        ctl.on_transition_report(msg)
        return protocol.Ack(ref="transition-report", seq=msg.transition_id)

    def _on_leaving(self, ctl: JobController, msg: protocol.Leaving) -> Any:
        """The first Leaving drains the node (state moves off it; the controller never drops a last copy);
        every Leaving (the agent repeats it each beat) is answered Release once no plan uses the node, else
        Ack. A drain the controller refuses is an ``alloc-refused`` event: the node goes at its grace end."""
        key = (msg.job_id, msg.node)
        reason = LEAVE_REASONS[msg.reason]
        if key not in self.leaving:
            self.store.add_event("node-leaving", {"node": msg.node, "reason": reason, "grace_s": msg.grace_s},
                                 job_id=msg.job_id)
            self.log.info("node-leaving", job=msg.job_id, node=msg.node, reason=reason, grace_s=msg.grace_s)
            self.leaving[key] = "draining"
            if ctl.drained(msg.node) or self.node_state.get(key) == "released":  # a shrink took it already
                self._let_go(ctl, msg.node, reason, tell=False)
                return protocol.Release(job_id=msg.job_id, node=msg.node, reason=reason)
            try:
                free_now = ctl.drain([msg.node], reason)
            except AllocationError as exc:
                self.leaving[key] = "refused"
                self._record_refusal(msg.job_id, "leave", [msg.node], f"{exc}; it goes at its grace end")
                free_now = []
            if msg.node in free_now or (self.leaving[key] == "draining" and msg.node not in ctl.draining):
                self._let_go(ctl, msg.node, reason, tell=False)  # no plan uses it: this reply says so
        elif self.leaving[key] == "draining" and msg.node not in ctl.draining:
            self.leaving[key] = "refused"  # the drain's replan ordered no transition (the controller's event)
        if self.leaving[key] == "released":
            return protocol.Release(job_id=msg.job_id, node=msg.node, reason=reason)
        return protocol.Ack(ref="leaving", seq=0)

    def _let_go(self, ctl: JobController, node: str, reason: str, *, tell: bool = True) -> None:
        key = (ctl.job_id, node)
        self.leaving[key] = "released"
        ctl.on_node_left(node, f"left: {reason}")
        self.node_state[key] = "released"
        self.store.add_event("node-left", {"node": node, "reason": reason}, job_id=ctl.job_id)
        self.log.info("node-left", job=ctl.job_id, node=node, reason=reason)
        if tell:  # at once; the agent's next Leaving is answered Release as well (a lost frame costs a beat)
            self._send_to_node(ctl.job_id, node, protocol.Release(job_id=ctl.job_id, node=node, reason=reason))

    def node_limit(self, job: dict[str, Any]) -> tuple[int, str]:
        """How many nodes the job may register, and where that bound comes from."""
        elastic = (job.get("spec") or {}).get("elastic")
        if isinstance(elastic, dict):
            per_node = max(1, int(elastic.get("gpus_per_node") or 1))
            return max(1, int(elastic.get("max_gpus") or 1) // per_node), "elastic.max_gpus / gpus_per_node"
        return self.settings.control.max_nodes_per_job, "control.max_nodes_per_job"

    def connection_limit(self, user: str) -> tuple[int, str]:
        """How many agent connections one key of ``user`` may hold, and where that bound comes from."""
        jobs = [j for j in self.store.jobs(include_terminal=False) if j["user"] == user]
        nodes = sum(self.node_limit(j)[0] for j in jobs)
        spare = self.settings.control.spare_connections_per_key
        return nodes + spare, (f"{nodes} for the nodes of user {user!r}'s {len(jobs)} live job(s) + "
                               f"control.spare_connections_per_key = {spare}")

    def _register(self, identity: bytes, user: str, key: str, enc: protocol.Encoding,
                  msg: protocol.Register) -> Any:
        job = self.store.job(msg.job_id)
        if job is None:
            return protocol.ErrorReply(code="unknown-job", message=f"no job {msg.job_id!r}: add it first "
                                       "(nereusctl job-add, or submit it through the Slurm tracker)")
        if job["user"] != user:
            self.store.add_event("register-forbidden", {"node": msg.node, "user": user}, job_id=msg.job_id)
            return protocol.ErrorReply(code="forbidden",
                                       message=f"user {user!r} may not act on job {msg.job_id!r}")
        if job["state"] in TERMINAL_JOB_STATES:
            return protocol.ErrorReply(code="unknown-job", message=f"job {msg.job_id!r} is {job['state']}")
        if msg.job_id in self.damaged:
            return protocol.ErrorReply(code="internal", message=f"job {msg.job_id!r} is damaged in the daemon's "
                                       f"store ({self.damaged[msg.job_id]}); an admin must repair it")
        node_key = (msg.job_id, msg.node)
        mine = self.sessions.by_identity.get(identity)
        if mine is not None and (mine.job_id, mine.node) != node_key:
            return protocol.ErrorReply(code="forbidden", message=f"this connection already speaks for "
                                       f"{mine.job_id}/{mine.node}: one node per connection")
        holder = self.sessions.by_node.get(node_key)
        if holder is not None and holder != identity and self.sessions.by_identity[holder].key != key:
            return protocol.ErrorReply(code="forbidden", message=f"node {msg.node} of job {msg.job_id!r} is held "
                                       "by another key's connection")
        if self.node_state.get(node_key) != "alive":  # nodes lost or released do not count: others replace them
            alive = sum(1 for (j, _), state in self.node_state.items() if j == msg.job_id and state == "alive")
            limit, why = self.node_limit(job)
            if alive >= limit:
                return protocol.ErrorReply(code="forbidden", message=f"job {msg.job_id!r} has {alive} nodes alive, "
                                           f"its limit ({why}); node {msg.node} is refused")
        if msg.slurm_job_id is not None and isinstance(job["spec"].get("elastic"), dict):
            held = ElasticJob.from_dict(job["spec"]["elastic"]).slurm_job_ids
            if self.source is not None:
                tracked = {j.job_id: j for j in self.source.jobs()}
                if msg.job_id in tracked:
                    held = tracked[msg.job_id].slurm_job_ids
            if msg.slurm_job_id not in held:
                return protocol.ErrorReply(code="forbidden", message=f"Slurm job {msg.slurm_job_id} is not part "
                                           f"of job {msg.job_id!r} (its Slurm jobs: {', '.join(held)})")
        with self.store.transaction():  # the node and its event: one commit
            how = self.store.register_node(job_id=msg.job_id, node=msg.node,
                                           devices=[d.model_dump() for d in msg.devices],
                                           slurm_job_id=msg.slurm_job_id, host=msg.host, incarnation=msg.incarnation)
            self.store.add_event("node-registered", {"node": msg.node, "how": how, "devices": len(msg.devices),
                                                     "host": msg.host}, job_id=msg.job_id)
        if self.node_state.get(node_key) == "released":
            self.leaving.pop(node_key, None)  # a node given back and granted again: a new agent, a new leave
        self.sessions.bind(identity, Session(job_id=msg.job_id, node=msg.node, user=user, key=key, encoding=enc))
        self.node_state[node_key] = "alive"
        self.last_seen[node_key] = time.monotonic()
        self.log.info("agent-registered", job=msg.job_id, node=msg.node, how=how, devices=len(msg.devices))
        ctl = self.controllers.get(msg.job_id) or self._start_controller(msg.job_id)
        ctl.on_node_joined(msg.node, how)
        if how != "new":
            self.resend_to.append(node_key)
        job = self.store.job(msg.job_id) or job
        return protocol.Welcome(job_id=msg.job_id, node=msg.node, heartbeat_interval_s=self.settings.control.
                                heartbeat_interval_s, plan_version=job["plan_version"], reconnected=how != "new")

    def _send_to_node(self, job_id: str, node: str, msg: Any) -> bool:
        ident = self.sessions.by_node.get((job_id, node))
        if ident is None:
            self.log.warning("order-undeliverable", job=job_id, node=node)
            return False
        self.agents.send(ident, msg, self.sessions.by_identity[ident].encoding)
        return True

    # --- admin messages -----------------------------------------------------------------------------

    def _check_heartbeats(self) -> None:
        """Mark silent nodes lost, at most LOST_PER_TICK per tick (a mass loss is spread over ticks, so the
        loop keeps answering while 1,024 nodes go)."""
        timeout = self.settings.control.heartbeat_timeout_s
        now = time.monotonic()
        silent = [key for key, seen in self.last_seen.items()
                  if self.node_state.get(key) == "alive" and now - seen > timeout]
        for key in silent[:LOST_PER_TICK]:
            job_id, node = key
            reason = f"no heartbeat for {now - self.last_seen[key]:.1f} s (> {timeout:g} s)"
            with self.store.transaction():
                self.store.set_node_state(job_id, node, "lost", reason)
                self.store.add_event("node-lost", {"node": node, "reason": reason}, job_id=job_id)
            self.node_state[key] = "lost"
            self.log.warning("node-lost", job=job_id, node=node, reason=reason)
            ctl = self.controllers.get(job_id)
            if ctl is not None:
                try:
                    ctl.on_node_lost(node, reason)
                except TRANSIENT as exc:
                    self.log.error("node-lost-handling-failed", job=job_id, error=str(exc))
                except Exception as exc:
                    self._mark_damaged(job_id, f"node-lost handling failed: {type(exc).__name__}: {exc}")

    def _flush_heartbeats(self) -> None:
        if self.heartbeats_to_flush:
            batch = [(j, n, t) for (j, n), t in self.heartbeats_to_flush.items()]
            self.heartbeats_to_flush = {}
            self.store.touch_heartbeats(batch)
