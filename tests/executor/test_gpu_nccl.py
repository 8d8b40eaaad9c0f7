"""The same executor over NCCL on GPUs (backend chosen by device): skipped without 2 CUDA devices."""

from __future__ import annotations

import pytest
import torch
from executor_helpers import assert_same_state, logical_state, placement

from agent.coordinator import LocalCoordinator

pytestmark = [pytest.mark.gpu, pytest.mark.multiprocess,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL p2p)")]


def test_tp_change_and_extend_over_nccl_are_bit_exact() -> None:
    n = min(4, torch.cuda.device_count())
    with LocalCoordinator(n, timeout_s=60, device="cuda") as pool:
        pool.form_generation()
        old = [placement("a", 1, 1, [[0], [1]])]
        new = [placement("a", 2, 1, [[0, 1]])] if n < 4 else [placement("a", 2, 1, [[0, 1], [2, 3]])]
        pool.init_state(old, seed=3)
        before = logical_state(pool.dump())
        outcome = pool.transition(old, new)
        assert outcome.committed, outcome.errors
        assert_same_state(before, logical_state(pool.dump()))
