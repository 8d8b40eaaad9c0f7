"""Fixtures for tests on a real local Slurm 22.05 cluster (tests/slurm/lab.py).

``slurm_lab`` (session): installs the packages if missing and starts the cluster, or joins the one
another test process (xdist worker) started; skips with the reason where a lab is impossible (not
root, no apt). ``lab`` (per test): the same cluster held exclusively across processes for the test,
with every job cancelled and every node back in service afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from lab import LabUnavailable, SlurmLab


@pytest.fixture(scope="session")
def slurm_lab() -> Iterator[SlurmLab]:
    try:
        cluster = SlurmLab.acquire()
    except LabUnavailable as exc:
        pytest.skip(f"no Slurm lab here: {exc}")
    try:
        yield cluster
    finally:
        cluster.release()


@pytest.fixture
def lab(slurm_lab: SlurmLab) -> Iterator[SlurmLab]:
    with slurm_lab.exclusive() as held:
        yield held
