"""The first driver of tests/live/test_driver_failover.py, as a process of its own (the test SIGKILLs it):
places plan A on the pool's workers (no daemon: the order is given by hand, as tests/live does) and steps
until it is killed, writing its events (with --verify's logical digests after every step).

    python tests/live/failover_driver.py BIND KEYS EVENTS CKPT STOP_AT

After STOP_AT steps it stops at that safe point and only keeps its socket read (the workers idle): the test
then kills it with its node, and knows the step the survivors hold.
"""

from __future__ import annotations

import sys
from pathlib import Path

from agent.driver import DriverConfig, JobDriver
from agent.engine.jobfile import load_job
from agent.engine.loop import RunConfig
from agent.hub import HubCoordinator
from nereusd.wire import protocol
from nereusd.wire.keys import load_bundle
from planner.plan import GlobalPlan, Layout, StagePlan
from planner.workflow import StageKind

ROOT = Path(__file__).resolve().parents[2]
POOL = {"n0": [0, 1], "n1": [2, 3]}  # n0: the anchor (the driver's node), n1: the member that survives


def plan(cfg: RunConfig, version: int) -> GlobalPlan:
    """Every stateful model-stage replicated on both nodes: losing n0 leaves a whole copy on n1."""
    sets = {"actor-gen": [[1], [3]], "ref-inf": [[0], [2]], "actor-train": [[0], [2]]}
    out = []
    for ms in cfg.workflow.model_stages:
        training = ms.kind is StageKind.TRAINING
        rows = cfg.sequences_per_step // (cfg.train_mini_batches_per_step if training else 1) // 2
        out.append(StagePlan(model_stage=ms.name, layout=Layout(1, 1), gpu_sets=tuple(tuple(s) for s in sets[ms.name]),
                             micro_batch_size=rows if training else max(1, rows // 2)))
    return GlobalPlan(version=version, stages=tuple(out))


def order(tid: int, old: int, new: GlobalPlan) -> protocol.TransitionOrder:
    return protocol.TransitionOrder(job_id="t", transition_id=tid, from_version=old, to_version=new.version, part={})


def main(bind: str, keys: str, events: str, ckpt: str, stop_at: str) -> int:
    cfg, _ = load_job(ROOT / "etc" / "jobs" / "live.toml")
    hub = HubCoordinator(bind, load_bundle(Path(keys)), timeout_s=60, dead_after_s=4.0)
    dc = DriverConfig(steps=10_000, checkpoint_url=ckpt, checkpoint_every=2, events_path=Path(events), verify=True,
                      assign_timeout_s=240)
    d = JobDriver(cfg, hub, None, dc, job_id="t", node="n0")
    a = plan(cfg, 1)
    d.apply(order(1, 0, a), a, POOL, 2)
    while d.step < int(stop_at):
        if not d.step_once():
            return 1
    d.event("stopped", step=d.step)
    while True:  # until the test kills it
        hub.pump(1.0)


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:]))
