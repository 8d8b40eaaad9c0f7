"""Driver failover: the driver dies with its node (an anchor requeue), a new driver adopts the workers
of the surviving node with the state they hold, and the job goes on from the step reached.

Real workers (``python -m agent.worker``) on two nodes, n0 (the anchor: the driver's node) and n1; the
first driver is a process of its own (tests/live/failover_driver.py) that places a plan replicating every
stateful model-stage on both nodes and steps with --verify's logical digests. At a step's safe point the
driver and n0's workers are SIGKILLed; a new driver is started on a new endpoint and published in the
driver file (as agent.slurm_task does); n0 comes back as new worker processes. The survivors re-dial
it with their worker ids; its first order adopts them (their plan, their RL steps) and Extends the state
from n1's replicas onto n0's new workers. Asserted: the step reached goes on (not step 0), every logical
tensor of the surviving replicas equals what the first driver's digests said at that step, and the
transition kept them.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from failover_driver import POOL, order, plan

from agent.driver import DriverConfig, JobDriver
from agent.engine.jobfile import load_job
from agent.hub import HubCoordinator
from nereusd.wire.keys import KeyStore, load_bundle

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]
STOP_AT = 3  # steps the first driver runs (a checkpoint at step 2 exists by then)


def _events(path: Path, kind: str) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [e for e in map(json.loads, [x for x in path.read_text().splitlines() if x.endswith("}")])
            if e["event"] == kind]


def _wait(what: str, ok: Any, timeout_s: float, alive: subprocess.Popen[bytes]) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = ok()
        if got:
            return got
        assert alive.poll() is None, f"the first driver exited {alive.returncode} while waiting for {what}"
        time.sleep(0.2)  # polling a file another process writes
    raise TimeoutError(f"no {what} within {timeout_s:g} s")


def _publish(path: Path, endpoint: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"anchor_job_id": "t", "endpoint": endpoint, "node": "n0", "written_at": time.time()}))
    tmp.replace(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_new_driver_adopts_the_survivors_and_goes_on_from_the_step_reached(tmp_path: Path) -> None:
    ks = KeyStore(tmp_path / "state")
    ks.init()
    ks.create_client(name="alice-agent", user="alice", role="agent", out_dir=tmp_path / "alice")
    keys, ckpt, published = tmp_path / "alice", tmp_path / "ckpt", tmp_path / "driver-t.json"
    first_events, events = tmp_path / "first.jsonl", tmp_path / "events.jsonl"
    first_ep = f"tcp://127.0.0.1:{_free_port()}"
    _publish(published, first_ep)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    first = subprocess.Popen([sys.executable, str(Path(__file__).parent / "failover_driver.py"), first_ep, str(keys),
                              str(first_events), str(ckpt), str(STOP_AT)], cwd=ROOT, env=env)

    def worker(node: str, gpu: int, endpoint: str) -> subprocess.Popen[bytes]:
        wenv = {**env, "NEREUS_DRIVER": endpoint, "NEREUS_DRIVER_FILE": str(published), "NEREUS_KEYS": str(keys),
                "NEREUS_NODE": node}
        return subprocess.Popen([sys.executable, "-m", "agent.worker", "--device", str(gpu % 2)], cwd=ROOT, env=wenv)

    procs = {g: worker(n, g, first_ep) for n, gpus in POOL.items() for g in gpus}
    hub = None
    try:
        stopped = _wait(f"the first driver's {STOP_AT} steps", lambda: _events(first_events, "stopped"), 400, first)
        assert stopped[0]["step"] == STOP_AT
        before = {e["step"]: e["digests"] for e in _events(first_events, "snapshot")}
        assert STOP_AT in before and _events(first_events, "checkpoint")
        # the anchor goes: its driver and its workers, at once
        for p in (first, procs[0], procs[1]):
            p.send_signal(signal.SIGKILL)
        for p in (first, procs[0], procs[1]):
            p.wait(10)

        cfg, _ = load_job(ROOT / "etc" / "jobs" / "live.toml")
        hub = HubCoordinator("tcp://127.0.0.1:0", load_bundle(keys), timeout_s=60, dead_after_s=4.0)
        dc = DriverConfig(steps=100, checkpoint_url=str(ckpt), checkpoint_every=2, events_path=events, verify=True,
                          assign_timeout_s=240)
        d = JobDriver(cfg, hub, None, dc, job_id="t", node="n0")
        t0 = time.monotonic()
        _publish(published, hub.endpoint)  # the requeued anchor publishes its new driver
        procs[0], procs[1] = worker("n0", 0, hub.endpoint), worker("n0", 1, hub.endpoint)
        b = plan(cfg, 2)
        d.apply(order(2, 1, b), b, POOL, 2)
        recovered_s = time.monotonic() - t0

        (adopted,) = _events(events, "adopted")
        assert adopted["workers"] == [2, 3] and adopted["dead"] == [0, 1], adopted
        assert adopted["step"] == STOP_AT and adopted["plan_version"] == 1 and not adopted["torn"], adopted
        assert adopted["checkpoint"] == "step000002", adopted
        # the survivors' replicas hold every logical tensor as the first driver left it
        snaps = _events(events, "snapshot")
        assert snaps[0]["step"] == STOP_AT and snaps[0]["digests"] == before[STOP_AT]
        done = _events(events, "transition-done")[-1]
        assert done["lost"] == [0, 1] and done["restored_from"] is None and done["bytes_sent"] > 0, done
        assert done["verified"]["equal"] is True and done["verified"]["tensors"] == len(before[STOP_AT]), done
        assert snaps[-1]["digests"] == before[STOP_AT]  # and after the Extend onto n0's new workers
        assert d.plan == b and d.step == STOP_AT
        assert d.step_once() and d.step_once()
        steps = [e["step"] for e in _events(events, "step")]
        assert steps == [STOP_AT, STOP_AT + 1], steps  # from the step reached, not from 0
        assert sorted(_events(events, "step")[-1]["workers"]) == [0, 1, 2, 3]
        print(f"driver failover: new driver published to training again {recovered_s:.1f} s")
    finally:
        if hub is not None:
            hub.close()
        for p in [first, *procs.values()]:
            if p.poll() is None:
                try:
                    p.wait(20 if hub is not None else 0.1)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
