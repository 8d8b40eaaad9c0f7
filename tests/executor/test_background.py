"""Work handed off a transition (transitions.executor.background) and the warm pool's deferred refill:
one long-lived thread per queue runs the jobs in order, ``submit`` never waits for them, and a run's
refill starts only when the worker's next command arrives (its peers may still be moving bytes)."""

from __future__ import annotations

import functools
import threading
from typing import Any

import pytest

from agent.coordinator import LocalCoordinator
from transitions.executor import warm_pool
from transitions.executor.background import Background
from transitions.executor.warm_pool import WarmPool

MIB = 1 << 20
WAIT_S = 30.0  # bound on every wait here; a loaded host is slow, never this slow


def test_jobs_run_in_order_on_one_thread_that_outlives_their_errors() -> None:
    bg = Background("test-background")
    seen: list[tuple[int, int]] = []

    def job(i: int) -> None:
        seen.append((i, threading.get_ident()))
        if i == 1:
            raise ValueError("job 1 fails")

    jobs = [bg.submit(functools.partial(job, i)) for i in range(4)]
    assert all(j.wait(WAIT_S) for j in jobs)
    assert [i for i, _ in seen] == [0, 1, 2, 3]
    assert len({ident for _, ident in seen}) == 1 and seen[0][1] != threading.get_ident()
    assert isinstance(jobs[1].error, ValueError) and jobs[0].error is None and jobs[3].error is None
    assert not any(j.is_alive() for j in jobs)
    thread = bg.thread
    bg.start()  # running already: no second thread
    assert bg.thread is thread and thread is not None and thread.is_alive()


def test_submit_never_waits_for_the_jobs_before_it() -> None:
    bg = Background("test-background-block")
    gate = threading.Event()
    first = bg.submit(lambda: gate.wait(WAIT_S))
    second = bg.submit(lambda: None)  # returns while the first job blocks the thread
    assert first.is_alive() and second.is_alive() and not second.wait(0.05)
    gate.set()
    assert first.wait(WAIT_S) and second.wait(WAIT_S)


def test_a_refill_asked_for_waits_for_start_pending_or_settle(bound: None) -> None:
    pool = WarmPool()
    bufs = [pool.take(2 * MIB) for _ in range(2)]
    del bufs
    pool.refill_later()
    assert pool.pending and pool.refilling is None and pool.stats.refills == 0  # nothing started
    job = pool.start_pending()
    assert job is not None and not pool.pending and job.wait(WAIT_S)
    assert pool.stats.refills == 1 and pool.start_pending() is None  # none pending any more
    pool.refill_later()
    pool.settle(WAIT_S)  # starts the pending one and waits for it
    assert not pool.pending and pool.stats.refills == 2 and pool.held_bytes == 4 * MIB
    pool.trim()


def test_a_refill_asked_for_while_one_runs_stays_pending_and_settle_runs_it(bound: None) -> None:
    pool = WarmPool()
    gate = threading.Event()
    blocker = warm_pool.background.REFILLS.submit(lambda: gate.wait(WAIT_S))  # holds the refill thread
    first = pool.refill_async()
    assert first is not None and first.is_alive()
    pool.refill_later()
    assert pool.start_pending() is None and pool.pending  # one still queued: the request stays
    gate.set()
    pool.settle(WAIT_S)
    assert blocker.wait(WAIT_S) and not pool.pending and pool.stats.refills == 2


def _ask_refill(ctx: Any) -> bool:
    warm_pool.POOL.settle(WAIT_S)
    warm_pool.POOL.refill_later()
    return warm_pool.POOL.pending


def _pending(ctx: Any) -> tuple[bool, bool]:
    """(still pending, a refill submitted) as this command's handler sees it."""
    return warm_pool.POOL.pending, warm_pool.POOL.refilling is not None


@pytest.mark.multiprocess
def test_the_next_command_starts_the_refill_a_run_asked_for() -> None:
    with LocalCoordinator(1, timeout_s=60.0) as pool:
        assert pool.call(_ask_refill) == {0: True}  # asked for, not started by that command's reply
        assert pool.call(_pending) == {0: (False, True)}  # the next command's arrival started it
