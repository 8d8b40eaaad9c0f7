"""The worker's (or job driver's) side of the node agent's relay: report to the agent, take its orders.

The agent (agent/node.py) binds a PULL socket ($NEREUS_AGENT_IPC) its children PUSH Measurement and
TransitionReport messages to, and PUBlishes transition orders on $NEREUS_AGENT_ORDERS.
"""

from __future__ import annotations

import os
import time

import zmq

from nereusd.wire import protocol


class AgentLink:
    """The worker's (or job driver's) side of the relay: report to the agent, receive its orders.

        link = AgentLink.from_env()          # inside a process the agent spawned
        order = link.next_order(timeout_s=60)
        ... run this node's part at the next safe point ...
        link.report(protocol.TransitionReport(job_id=link.job_id, node=link.node,
                                              transition_id=order.transition_id, ok=True, measured_s=dt))
    """

    def __init__(self, *, ipc_in: str, ipc_orders: str, job_id: str, node: str) -> None:
        self.job_id, self.node = job_id, node
        self.ctx = zmq.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(ipc_in)
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(ipc_orders)
        self.seen: set[int] = set()

    @classmethod
    def from_env(cls) -> AgentLink:
        env = os.environ
        return cls(ipc_in=env["NEREUS_AGENT_IPC"], ipc_orders=env["NEREUS_AGENT_ORDERS"],
                   job_id=env["NEREUS_JOB_ID"], node=env["NEREUS_NODE"])

    def report(self, msg: protocol.Measurement | protocol.TransitionReport) -> None:
        self.push.send(protocol.encode(msg))

    def next_order(self, timeout_s: float) -> protocol.TransitionOrder | None:
        """The next order not seen before, or None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:  # polls at least once: a zero timeout takes what is already there
            left = max(0.0, deadline - time.monotonic())
            if not self.sub.poll(int(left * 1e3)):
                return None
            msg = protocol.decode(self.sub.recv(), 64 << 20)
            if isinstance(msg, protocol.TransitionOrder) and msg.transition_id not in self.seen:
                self.seen.add(msg.transition_id)
                return msg
        return None

    def close(self) -> None:
        self.push.close(linger=5000)  # deliver what was reported before going away
        self.sub.close(linger=0)
        self.ctx.term()
