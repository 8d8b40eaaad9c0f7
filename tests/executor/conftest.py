"""One pool of 4 spawned gloo workers shared by the executor test modules (import torch costs ~1.5 s
per process on 2 cores, so cases reuse the pool; every case re-initialises the state it needs)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from agent.coordinator import LocalCoordinator
from transitions.executor import warm_pool


@pytest.fixture(scope="session")
def pool() -> Iterator[LocalCoordinator]:
    with LocalCoordinator(4, timeout_s=20) as coord:
        coord.form_generation()
        yield coord


@pytest.fixture
def bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """The warm pool bounded at 64 MiB for the case (restored after it)."""
    monkeypatch.setattr(warm_pool, "WARM_POOL_BYTES", 64 << 20)
