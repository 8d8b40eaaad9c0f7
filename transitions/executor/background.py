"""Work a worker hands off its critical path: one long-lived daemon thread per queue, fed without waiting.

``threading.Thread.start`` returns only once the new thread has run (it waits for the thread to say
so), and on a loaded host that first slice of CPU comes late: 0.2-6.3 ms per start measured on the
shared 2-core machine (load 5), paid inside the transition by the engine's release (its groups torn
down on a thread) and by the warm pool's refill. A ``Background`` starts its thread once (``start``:
a worker calls it before it reports ready) and afterwards ``submit`` only puts the job on a queue.
Jobs run one at a time in submission order; a job's exception is kept on its ``Job``, never raised
on the thread (the thread lives on). Not ``concurrent.futures.ThreadPoolExecutor(1)``: its thread is
not a daemon and is joined at interpreter exit, so a group teardown stuck in gloo would hold a
worker's exit; and it starts its thread on the first submit, inside the first transition.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class Job:
    """One submitted callable: ``wait`` for it; ``error`` is what it raised, if anything."""

    fn: Callable[[], Any]
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def is_alive(self) -> bool:
        """Not finished yet (queued or running), as ``Thread.is_alive``."""
        return not self.done.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait (bounded by ``timeout_s``) for the job; True once it has finished."""
        return self.done.wait(timeout_s)

    def run(self) -> None:
        try:
            self.fn()
        except BaseException as exc:  # noqa: BLE001 - kept for whoever waits; the thread lives on
            self.error = exc
        finally:
            self.done.set()


@dataclass(eq=False)
class Background:
    """A queue of jobs and the one daemon thread running them, started once."""

    name: str
    jobs: queue.SimpleQueue[Job] = field(default_factory=queue.SimpleQueue)
    thread: threading.Thread | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        """Start the thread if it is not running (the one wait for a thread start, paid here)."""
        with self.lock:
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
                self.thread.start()

    def submit(self, fn: Callable[[], Any]) -> Job:
        """Queue ``fn`` (the thread started first if it is not running yet); never waits for it."""
        if self.thread is None or not self.thread.is_alive():
            self.start()
        job = Job(fn=fn)
        self.jobs.put(job)
        return job

    def _serve(self) -> None:
        while True:
            self.jobs.get().run()


RELEASES = Background("nereus-release")  # the engine's groups of a generation already re-formed, torn down
REFILLS = Background("nereus-pool-refill")  # the warm pool's refills (transitions.executor.warm_pool)


def start_all() -> None:
    """Start every queue's thread now (a worker, before it reports ready), not in its first transition."""
    RELEASES.start()
    REFILLS.start()
