"""A live engine survives new generations: the same TP layout bound again in a new world.

DeviceMesh hashes by layout, not by process group, and DTensor's sharding propagation caches its
answers (output specs, meshes included) by that hash without bound, in C++ and in Python: after a
generation change (destroy and init of the world) a mesh of the same layout found the OLD mesh there,
and the TP output redistribution named a process group that no longer exists ("Could not resolve the
process group registered under the name N"). Seen in the live job: a response-length jump (a re-bind
in the same world) then an opportunistic replan on the same workers failed every step after it.
``transitions.channel.forget_meshes`` (run when a world is left) clears both caches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from agent.coordinator import LocalCoordinator
from agent.engine.grpo import GRPOConfig
from agent.engine.live import bind, live_cluster, live_dag, release, train_step
from agent.engine.loop import RunConfig
from agent.engine.tasks import SortDigits
from planner.plan import GlobalPlan, Layout, StagePlan

pytestmark = [pytest.mark.multiprocess]
CFG = RunConfig(algo="grpo", task=SortDigits(num_digits=3), prompts_per_step=4, grpo=GRPOConfig(samples_per_prompt=2),
                seed=5)


def _plan(version: int, gen_mbs: int) -> GlobalPlan:
    """The live job's plans v2 and v3 (daemon's choice on 4 CPU workers), micro-batches scaled down."""
    return GlobalPlan(version=version, stages=(
        StagePlan(model_stage="actor-gen", layout=Layout(1, 1), gpu_sets=((0,), (1,), (2,), (3,)),
                  micro_batch_size=gen_mbs),
        StagePlan(model_stage="ref-inf", layout=Layout(1, 1), gpu_sets=((0,), (1,), (2,), (3,)), micro_batch_size=1),
        StagePlan(model_stage="actor-train", layout=Layout(2, 1), gpu_sets=((0, 1), (2, 3)), micro_batch_size=4)))


@pytest.fixture(scope="module")
def pool() -> Iterator[LocalCoordinator]:
    with LocalCoordinator(4, timeout_s=60) as coord:
        yield coord


def test_same_tp_layout_in_a_new_generation_steps(pool: LocalCoordinator) -> None:
    a, b = _plan(1, 1), _plan(2, 2)  # b differs only in actor-gen's micro-batch: TP meshes are equal
    pool.form_generation([0, 1, 2, 3])
    pool.call(bind, collective=True, cfg=CFG, plan=a)
    pool.call(train_step, collective=True, step=0)
    longer = dataclasses.replace(CFG, max_new_tokens=8)  # the driver's response-length jump: bind again
    pool.call(bind, collective=True, cfg=longer, plan=a)
    first = pool.call(train_step, collective=True, step=1)
    pool.form_generation([0, 1, 2, 3])  # a new world: the old process groups are destroyed
    pool.call(release)
    outcome = pool.run_dag(live_dag(CFG, a, b), live_cluster(CFG, a, b))
    assert outcome.committed, outcome.errors
    pool.call(bind, collective=True, cfg=longer, plan=b)
    second = pool.call(train_step, collective=True, step=2)  # raised "Could not resolve the process group"
    assert {r.step for r in second.values()} == {2} and len({r.rollout_sha256 for r in first.values()}) == 1
    assert len({r.rollout_sha256 for r in second.values()}) == 1
