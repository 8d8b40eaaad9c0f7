"""The allocation source off the serve loop (a thread: periodic poll() plus queued grow/shrink calls), and
a job's held nodes replayed from its stored allocation events (a restarted daemon's source resumes
from them). Never imports torch."""

from __future__ import annotations

import queue
import threading
from typing import Any

from nereusd.allocation import Allocation, AllocationEvent, AllocationSource, EventKind, NodeAllocation

_ADDS = frozenset({EventKind.GRANTED, EventKind.GROWN})
_REMOVES = frozenset({EventKind.SHRUNK, EventKind.RELEASED, EventKind.NODE_DOWN, EventKind.PREEMPTED,
                      EventKind.CANCELLED, EventKind.TIME_LIMIT, EventKind.FAILED, EventKind.COMPLETED})


def replay_allocation(job_id: str, events: list[dict[str, Any]]) -> Allocation | None:
    """The nodes a job holds after its stored allocation events (None: the source never granted any)."""
    if not events:
        return None
    held: dict[str, NodeAllocation] = {}
    for data in events:
        kind = EventKind(data["kind"])
        for n in data.get("nodes", ()):
            node = NodeAllocation.from_dict(n)
            if kind in _ADDS:
                held[node.node] = node
            elif kind in _REMOVES:
                held.pop(node.node, None)
    return Allocation(job_id=job_id, nodes=tuple(held.values()))


class _SourceWorker(threading.Thread):
    """Runs the allocation source off the serve loop: periodic poll() plus queued grow/shrink calls."""

    def __init__(self, source: AllocationSource, interval_s: float, log: Any) -> None:
        super().__init__(name="allocation-source", daemon=True)
        self.source, self.interval_s, self.log = source, interval_s, log
        self.requests: queue.Queue[tuple[str, tuple[Any, ...]]] = queue.Queue()
        self.events: queue.Queue[AllocationEvent] = queue.Queue()
        self.refused: queue.Queue[tuple[str, tuple[Any, ...], str]] = queue.Queue()  # (op, args, why)
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                while True:
                    op, args = self.requests.get_nowait()
                    try:
                        getattr(self.source, op)(*args)
                    except Exception as exc:  # a request the checks let through but the source refused
                        self.log.warning("allocation-request-failed", op=op, args=str(args), error=str(exc))
                        self.refused.put((op, args, str(exc) or type(exc).__name__))
            except queue.Empty:
                pass
            try:
                for ev in self.source.poll():
                    self.events.put(ev)
            except Exception as exc:  # the source promises not to raise; if it does, log and keep going
                self.log.error("allocation-poll-crashed", error=repr(exc))
            self.stop_event.wait(self.interval_s)
