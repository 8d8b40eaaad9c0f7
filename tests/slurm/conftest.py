"""Fixtures for tests on a real local Slurm 22.05 cluster (tests/slurm/lab.py).

``slurm_lab`` (session): installs the packages if missing and starts the cluster once per test
process; skips with the reason where a lab is impossible (not root, no apt). ``lab`` (per test): the
same cluster, with every job cancelled and every node back in service after the test.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from lab import LabUnavailable, SlurmLab


@pytest.fixture(scope="session")
def slurm_lab() -> Iterator[SlurmLab]:
    try:
        cluster = SlurmLab.start()
    except LabUnavailable as exc:
        pytest.skip(f"no Slurm lab here: {exc}")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def lab(slurm_lab: SlurmLab) -> Iterator[SlurmLab]:
    yield slurm_lab
    slurm_lab.cancel_all()
    slurm_lab.resume_all_nodes()
