"""The job driver recovers the live state where the daemon's replan cannot move it.

Real workers (``python -m agent.worker``) dial a real hub, as node agents start them; the driver is
given the daemon's orders by hand. actor-train's only copy sits on node n1 (workers 2, 3); the node's
workers are killed; the next plan, on n0 alone, has no DAG (the last copy is gone), so the driver
loads it from its latest DCP checkpoint, goes back to the checkpoint's step and trains on. Every
logical tensor after the restore equals what the job held at that checkpoint (the driver's --verify
digests). A step that failed after its optimizer updates began (torn state) is never moved: the
next plan comes from the checkpoint too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.driver import DriverConfig, JobDriver
from agent.engine.jobfile import load_job
from agent.engine.loop import RunConfig
from agent.hub import HubCoordinator
from nereusd.wire import protocol
from nereusd.wire.keys import KeyStore, load_bundle
from planner.plan import GlobalPlan, Layout, StagePlan
from planner.workflow import StageKind

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]
POOL = {"n0": [0, 1], "n1": [2, 3]}


def _plan(cfg: RunConfig, version: int, **stages: tuple[int, list[list[int]]]) -> GlobalPlan:
    out = []
    for ms in cfg.workflow.model_stages:
        tp, sets = stages[ms.name.replace("-", "_")]
        training = ms.kind is StageKind.TRAINING
        rows = cfg.sequences_per_step // (cfg.train_mini_batches_per_step if training else 1) // len(sets)
        out.append(StagePlan(model_stage=ms.name, layout=Layout(tp, 1), gpu_sets=tuple(tuple(s) for s in sets),
                             micro_batch_size=rows if training else max(1, rows // 2)))
    return GlobalPlan(version=version, stages=tuple(out))


def _order(tid: int, old: int, new: GlobalPlan) -> protocol.TransitionOrder:
    return protocol.TransitionOrder(job_id="t", transition_id=tid, from_version=old, to_version=new.version, part={})


def mark_updating(ctx: Any) -> bool:
    """Fault injection: the worker's engine as if its last step had died during the optimizer updates."""
    ctx.engine.loop.updating = True
    return True


def finish_step(ctx: Any) -> int:
    """Fault injection: the worker's engine as if it had finished a step the driver saw fail (a peer
    died before it answered)."""
    ctx.engine.rl_steps += 1
    return int(ctx.engine.rl_steps)


@pytest.fixture
def driver(tmp_path: Path) -> Iterator[tuple[JobDriver, dict[int, subprocess.Popen[bytes]], Path]]:
    ks = KeyStore(tmp_path / "state")
    ks.init()
    ks.create_client(name="alice-agent", user="alice", role="agent", out_dir=tmp_path / "alice")
    hub = HubCoordinator("tcp://127.0.0.1:0", load_bundle(tmp_path / "alice"), timeout_s=60, dead_after_s=4.0)
    procs = {}
    for node, gpus in POOL.items():
        for gpu in gpus:
            env = {**os.environ, "NEREUS_DRIVER": hub.endpoint, "NEREUS_KEYS": str(tmp_path / "alice"),
                   "NEREUS_NODE": node, "PYTHONPATH": str(Path(__file__).parent)}  # mark_updating, by name
            procs[gpu] = subprocess.Popen([sys.executable, "-m", "agent.worker", "--device", str(gpu % 2)],
                                          cwd=ROOT, env=env)
    cfg, _ = load_job(ROOT / "etc" / "jobs" / "live.toml")
    events = tmp_path / "events.jsonl"
    dc = DriverConfig(steps=100, checkpoint_url=str(tmp_path / "ckpt"), checkpoint_every=3, events_path=events,
                      verify=True, assign_timeout_s=240)
    d = JobDriver(cfg, hub, None, dc, job_id="t", node="n0")
    try:
        yield d, procs, events
    finally:
        hub.close()
        for p in procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def _events(path: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == kind]


def test_a_lost_last_copy_comes_back_from_the_checkpoint(driver: tuple[JobDriver, dict, Path]) -> None:
    d, procs, events = driver
    cfg = d.cfg
    a = _plan(cfg, 1, actor_gen=(1, [[0], [1]]), ref_inf=(1, [[0], [1]]), actor_train=(2, [[2, 3]]))
    b = _plan(cfg, 2, actor_gen=(1, [[0], [1]]), ref_inf=(1, [[0], [1]]), actor_train=(2, [[0, 1]]))
    d.apply(_order(1, 0, a), a, POOL, 2)
    assert d.plan == a and not _events(events, "transition-failed")
    for _ in range(4):
        assert d.step_once()
    assert d.checkpoint is not None and d.checkpoint.step == 3
    for w in (2, 3):  # node n1 dies: actor-train's only copy with it
        procs[w].send_signal(signal.SIGKILL)
        procs[w].wait(10)
    assert not d.step_once()
    assert d.step == 4 and {2, 3} <= d.dead
    d.apply(_order(2, 1, b), b, {"n0": [0, 1]}, 2)
    done = _events(events, "transition-done")[-1]
    assert done["transition"] == 2 and done["restored_from"] == "step000003" and done["lost"] == [2, 3]
    assert done["verified"]["equal"] is True, done["verified"]  # every tensor as at the checkpoint
    assert d.step == 3 and d.plan == b
    assert d.step_once() and d.step == 4  # step 3 again, on n0

    # torn state: a step that died during its updates is not moved, it is loaded from the checkpoint
    assert d.step_once() and d.step == 5
    d.hub.call(mark_updating, workers=[0, 1])
    d._check_torn()
    assert d.torn
    c = _plan(cfg, 3, actor_gen=(1, [[1], [0]]), ref_inf=(1, [[0], [1]]), actor_train=(1, [[0], [1]]))
    d.apply(_order(3, 2, c), c, {"n0": [0, 1]}, 2)
    done = _events(events, "transition-done")[-1]
    assert done["transition"] == 3 and done["restored_from"] == "step000003" and not d.torn
    assert done["verified"]["equal"] is True and d.step == 3
    assert d.step_once()

    # a step finished on the survivors while the driver saw it fail: the units are past the driver's
    # step, a step it never logged (re-run, the data position twice): from the checkpoint as well
    d._check_torn()
    assert not d.torn  # the units are at the driver's step: nothing to restore
    assert d.hub.call(finish_step, workers=[0, 1]) == {0: d.step + 1, 1: d.step + 1}
    d._check_torn()
    assert d.torn
