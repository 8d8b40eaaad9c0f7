"""The driver's hub drives workers that dialled it (``python -m agent.worker``, as node agents start
them): CURVE-encrypted and admitting only the job's agent key; a transition DAG runs over it bit-exactly
as over the local pipes; a killed worker is known dead by its stopped beat, within a bound."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from executor_helpers import assert_same_state, init_placements, logical_state, move, placement

from agent.coordinator import WorkerDied
from agent.hub import HubCoordinator, WorkerLink
from agent.worker import held_units
from nereusd.wire.keys import KeyStore, load_bundle

pytestmark = [pytest.mark.multiprocess]
ROOT = Path(__file__).resolve().parents[2]
DEVICES = [("n0", 0), ("n0", 1), ("n1", 0)]  # worker ids 0, 1, 2 (GPU id = node rank * 2 + device)
IDS = {("n0", 0): 0, ("n0", 1): 1, ("n1", 0): 2}


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    ks = KeyStore(tmp_path / "state")
    ks.init()
    ks.create_client(name="alice-agent", user="alice", role="agent", out_dir=tmp_path / "alice")
    ks.create_client(name="bob-agent", user="bob", role="agent", out_dir=tmp_path / "bob")
    return {"alice": tmp_path / "alice", "bob": tmp_path / "bob"}


def _worker(endpoint: str, keys_dir: Path, node: str, device: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "NEREUS_DRIVER": endpoint, "NEREUS_KEYS": str(keys_dir), "NEREUS_NODE": node}
    return subprocess.Popen([sys.executable, "-m", "agent.worker", "--device", str(device)], cwd=ROOT, env=env)


@pytest.fixture
def hub(keys: dict[str, Path]) -> Iterator[tuple[HubCoordinator, list[subprocess.Popen[bytes]]]]:
    hub = HubCoordinator("tcp://127.0.0.1:0", load_bundle(keys["alice"]), timeout_s=30, dead_after_s=3.0)
    procs = [_worker(hub.endpoint, keys["alice"], n, d) for n, d in DEVICES]
    try:
        yield hub, procs
    finally:
        hub.close()
        for p in procs:
            try:
                p.wait(20)  # the hub's bye ends them
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def test_hub_runs_a_dag_over_dialled_workers_bit_exactly(hub: tuple[HubCoordinator, list]) -> None:
    coord, procs = hub
    peers = coord.assign(IDS, timeout_s=180)  # import torch in three processes on a loaded machine
    assert sorted(peers) == [0, 1, 2] and {p.pid for p in peers.values()} == {p.pid for p in procs}
    coord.form_generation([0, 1, 2])
    old = [placement("actor-train", 2, 1, [[0, 1]])]
    new = [placement("actor-train", 1, 1, [[2], [1]])]  # merge onto a worker of another node, and extend
    init_placements(coord, old, seed=7)
    before = logical_state(coord.dump())
    outcome = move(coord, old, new)
    assert outcome.committed, outcome.errors
    assert sum(r.bytes_sent for reps in outcome.reports.values() for r in reps) > 0
    assert_same_state(before, logical_state(coord.dump()))
    assert coord.held[0] == ()  # the source replica is destroyed on worker 0


def test_a_killed_worker_is_dead_by_its_beat(hub: tuple[HubCoordinator, list]) -> None:
    coord, procs = hub
    coord.assign(IDS, timeout_s=180)
    coord.form_generation([0, 1, 2])
    procs[2].send_signal(signal.SIGKILL)
    procs[2].wait(10)
    t0 = time.monotonic()
    replies = coord.request_all(__import__("agent.commands", fromlist=["Dump"]).Dump(), [0, 1, 2], timeout_s=60)
    assert replies[0].ok and replies[1].ok
    assert not replies[2].ok and "beat" in (replies[2].error or "")
    assert time.monotonic() - t0 < 30  # the beat bound (3 s), not the request's 60 s
    assert coord.is_dead(2) and not coord.is_dead(0)
    assert coord.alive == (0, 1)


def test_only_the_jobs_key_is_admitted(keys: dict[str, Path]) -> None:
    """Bob's agent key is a valid CURVE key of the same daemon, but not this job's: the hub never
    hears its hello, so it is never given a worker id (pickled commands reach only the job's own)."""
    coord = HubCoordinator("tcp://127.0.0.1:0", load_bundle(keys["alice"]), timeout_s=10)
    intruder = WorkerLink(coord.endpoint, load_bundle(keys["bob"]), node="n9", device=0)
    try:
        with pytest.raises(WorkerDied, match="n9:0 did not come up"):
            coord.assign({("n9", 0): 0}, timeout_s=3.0)
        assert ("n9", 0) not in coord.peers
    finally:
        intruder.close()
        coord.close()


def test_an_unencrypted_hub_binds_only_loopback() -> None:
    with pytest.raises(WorkerDied, match="only loopback"):
        HubCoordinator("tcp://0.0.0.0:0", None)


def not_importable_there(ctx: object) -> None:  # pickled by reference: the worker cannot import this module
    raise AssertionError("never runs")


def test_a_command_the_worker_cannot_decode_is_an_error_reply(hub: tuple[HubCoordinator, list]) -> None:
    coord, procs = hub
    coord.assign(IDS, timeout_s=180)
    with pytest.raises(WorkerDied, match="could not be decoded here"):
        coord.call(not_importable_there, workers=[0])
    assert coord.call(held_units, workers=[0]) == {0: []}  # and it lives on
    assert procs[0].poll() is None


def sleep_as_if_stuck(ctx: object, *, seconds: float) -> None:
    """Stands in for a C++ wait that ignores its channel's time-out (what a blocked p2p wait can do)."""
    time.sleep(seconds)


def test_survivors_stuck_in_a_collective_after_a_peer_died_are_stopped(keys: dict[str, Path]) -> None:
    """A peer of a collective dies; the others never return by themselves. ``stuck_after_s`` after the
    death the hub gives them up: the reply says so, holds nothing, and their beat processes stop them
    (the agent would restart them), so the driver never waits out its step bound on them."""
    from agent.commands import Call

    hub = HubCoordinator("tcp://127.0.0.1:0", load_bundle(keys["alice"]), timeout_s=30, dead_after_s=3.0,
                         stuck_after_s=2.0)
    here = str(Path(__file__).resolve().parent)  # the workers unpickle sleep_as_if_stuck from this module
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-m", "agent.worker", "--device", str(d)], cwd=ROOT,
                              env={**env, "NEREUS_DRIVER": hub.endpoint, "NEREUS_KEYS": str(keys["alice"]),
                                   "NEREUS_NODE": n}) for n, d in DEVICES]
    try:
        hub.assign(IDS, timeout_s=180)
        procs[2].send_signal(signal.SIGKILL)
        procs[2].wait(10)
        t0 = time.monotonic()
        replies = hub.request({w: Call(fn=sleep_as_if_stuck, kwargs={"seconds": 600}, collective=True)
                               for w in (0, 1, 2)}, timeout_s=300)
        took = time.monotonic() - t0
        assert "beat" in (replies[2].error or "")
        for w in (0, 1):
            assert not replies[w].ok and "stuck in a collective" in (replies[w].error or "") and replies[w].units == ()
        assert took < 120  # the dead-by-beat bound (3 s) + stuck_after_s (2 s), under load: not 300 or 600
        assert [procs[w].wait(60) for w in (0, 1)] == [-signal.SIGKILL, -signal.SIGKILL]  # stopped by their beats
        assert hub.alive == ()
    finally:
        hub.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
