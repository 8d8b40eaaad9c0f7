"""What a worker tells its node agent (not the driver): its part of a transition is done.

The daemon counts a transition done when every node reported it, and a node agent reports when every
one of its local workers did; so the driver, once a transition's DAG ran and the engines are bound on
the new plan, has every worker of the pool call ``report_transition`` (a ``Call`` command), and each
pushes a ``TransitionReport`` to its own agent over the agent's local relay (NEREUS_AGENT_IPC).
"""

from __future__ import annotations

import os
from typing import Any

_LINK: Any = None


def _link() -> Any:
    global _LINK
    if _LINK is None:
        from agent.node import AgentLink

        _LINK = AgentLink.from_env()
    return _LINK


def report_transition(ctx: Any, *, transition_id: int, ok: bool, measured_s: float, bytes_moved: int = 0,
                      error: str = "") -> bool:
    """Push this worker's report of ``transition_id`` to its node agent; False outside an agent."""
    if "NEREUS_AGENT_IPC" not in os.environ:
        return False
    from nereusd.wire import protocol

    link = _link()
    link.report(protocol.TransitionReport(job_id=link.job_id, node=link.node, transition_id=transition_id, ok=ok,
                                          measured_s=max(0.0, float(measured_s)), bytes_moved=int(bytes_moved),
                                          error=error[:4000]))
    return True
