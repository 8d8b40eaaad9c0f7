"""The RL engine trains on the workers' live EMU buffers (agent.engine.live): one copy of the state.

Real spawned workers (agent.coordinator.LocalCoordinator) in a generation whose ranks differ from
the worker ids (members (2, 0, 3, 1)), plans in worker ids. Checked: the engine's parameters and
AdamW moments are views of the unit buffers and no pack/unpack/transfer copy runs; a run whose
layout changes live (executor DAGs between steps: TP, PP and DP changes, a plan without worker 0)
keeps every logical tensor exactly across each transition and ends bit-identical to the same run
done by checkpoint/restart at the same steps, and close to a run that never changed layout.

Learning itself (reward rising) is left to tests/engine/test_learning.py: it needs 60-100 steps of
16-32 prompts, minutes on 2 cores, and the loop it runs is the one bound here (RLLoop.step).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from agent.coordinator import LocalCoordinator
from agent.engine.grpo import GRPOConfig
from agent.engine.live import (
    bind,
    live_cluster,
    live_dag,
    live_placements,
    live_units,
    rank_plan,
    release,
    stage_states,
    state_digest,
    train_step,
)
from agent.engine.live_views import in_buffer, local_of
from agent.engine.loop import RunConfig
from agent.engine.tasks import SortDigits
from planner.errors import SpecError
from planner.models import TINY_BYTE
from planner.plan import GlobalPlan, Layout, StagePlan
from planner.workflow import Role, StageKind
from transitions.executor.logical import logical_state
from transitions.geometry import StateKind

pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("live-state")]  # one pool of 4 workers
MEMBERS = (2, 0, 3, 1)  # generation rank order: worker 2 is rank 0, worker 0 rank 1, ...
PPO = RunConfig(algo="ppo", task=SortDigits(num_digits=3), prompts_per_step=4, seed=7)
GRPO = RunConfig(algo="grpo", task=SortDigits(num_digits=3), prompts_per_step=2,
                 grpo=GRPOConfig(samples_per_prompt=2), seed=3)


def plan(cfg: RunConfig, version: int, **stages: tuple[int, int, list[list[int]]]) -> GlobalPlan:
    """A plan in worker ids: per model-stage (tp, pp, gpu sets); micro-batches as uniform_plan."""
    out = []
    for ms in cfg.workflow.model_stages:
        tp, pp, sets = stages[ms.name.replace("-", "_")]
        rows = cfg.sequences_per_step // len(sets)
        accum = pp if ms.kind is StageKind.TRAINING and rows % pp == 0 else 1
        out.append(StagePlan(model_stage=ms.name, layout=Layout(tp, pp), gpu_sets=tuple(tuple(s) for s in sets),
                             micro_batch_size=rows // accum, grad_accum=accum))
    return GlobalPlan(version=version, stages=tuple(out))


# every change of layout the schedule makes (actor-train; the other stages move along). actor-gen
# keeps TP1 x DP2 (on other workers): at random init the next-token distribution is near-uniform,
# and the inverse-CDF sampler over probabilities sorted in descending order picks another token when
# TP's reduction order swaps two near-equal ones, so a generation layout change alone would change
# the samples of the fixed-layout comparison (the live and restart runs agree bit for bit anyway)
PLAN_A = plan(PPO, 1, actor_gen=(1, 1, [[0], [1]]), ref_inf=(1, 1, [[3]]), critic_inf=(1, 1, [[2]]),
              actor_train=(2, 1, [[0, 1]]), critic_train=(1, 1, [[2], [3]]))
# TP2 -> TP1 x DP2 on other workers; critic DP2 -> TP2 on non-consecutive ids
PLAN_B = plan(PPO, 2, actor_gen=(1, 1, [[1], [3]]), ref_inf=(1, 1, [[0]]), critic_inf=(1, 1, [[2]]),
              actor_train=(1, 1, [[1], [3]]), critic_train=(2, 1, [[2, 0]]))
# -> PP2, workers (3, 1, 2) only: worker 0 holds nothing
PLAN_C = plan(PPO, 3, actor_gen=(1, 1, [[3], [1]]), ref_inf=(1, 1, [[2]]), critic_inf=(2, 1, [[2, 3]]),
              actor_train=(1, 2, [[3, 1]]), critic_train=(1, 2, [[1, 2]]))
# -> TP1 x DP4 (replicas in reversed id order), critic back to one worker
PLAN_D = plan(PPO, 4, actor_gen=(1, 1, [[0], [2]]), ref_inf=(1, 1, [[1]]), critic_inf=(1, 1, [[3]]),
              actor_train=(1, 1, [[3], [2], [1], [0]]), critic_train=(1, 1, [[0]]))
SCHEDULE = (PLAN_A, PLAN_B, PLAN_C, PLAN_D)  # one RL step on each, changes between them
STEPS_PER_PLAN = 1


@pytest.fixture(scope="module")
def pool() -> Iterator[LocalCoordinator]:
    with LocalCoordinator(4, timeout_s=60) as coord:
        coord.form_generation(MEMBERS)
        yield coord


def _restart(num: int = 4) -> LocalCoordinator:
    coord = LocalCoordinator(num, timeout_s=60)
    coord.form_generation(MEMBERS)
    return coord


# --- run inside the workers (pool.call) ---------------------------------------------------------------


def forget(ctx: Any) -> int:
    """Drop the engine and every unit: the next bind is a fresh start."""
    ctx.engine = None
    ctx.units.clear()
    return 0


def held(ctx: Any) -> list[str]:
    return sorted(ctx.units)


def drop_one(ctx: Any, *, stage: str) -> list[str]:
    gone = [uid for uid, s in ctx.units.items() if s.placement.model_stage == stage]
    for uid in gone:
        del ctx.units[uid]
    return gone


def views_and_one_step(ctx: Any, *, cfg: RunConfig, plan: GlobalPlan) -> dict[str, Any]:
    """Bind and step with the engine's copy paths (sync.pack/unpack/transfer) made to fail; check that
    every parameter and moment (DTensor local shards too) lies in its unit's buffer, that the step
    changed the trainers' buffers (and only their state) and left the views in place."""
    from torch.distributed.tensor import DTensor

    import agent.engine.loop as loop_mod
    import agent.engine.sync as sync_mod

    def copy_path(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a pack/unpack/transfer copy on the live path")

    saved = (sync_mod.pack, sync_mod.unpack, sync_mod.transfer, loop_mod.transfer)
    sync_mod.pack = sync_mod.unpack = sync_mod.transfer = loop_mod.transfer = copy_path  # type: ignore[assignment]
    try:
        bind(ctx, cfg=cfg, plan=plan)
        loop = ctx.engine.loop
        checked, dtensors = 0, 0

        def check_all() -> None:
            nonlocal checked, dtensors
            checked = dtensors = 0
            # the fed stages' units are new after every weight sync
            backing = {s.placement.model_stage: s for s in (*ctx.units.values(), *loop.fed.values())}
            for name, eng in loop.engines.items():
                if eng.module is None:
                    continue
                state = backing[name]
                for pname, p in eng.module.named_parameters():
                    tensors = [p]
                    if eng.optimizer is not None:
                        st = eng.optimizer.state[p]
                        tensors += [st["exp_avg"], st["exp_avg_sq"]]
                    for t in tensors:
                        assert in_buffer(t, state), (name, pname)
                        checked += 1
                    dtensors += isinstance(p, DTensor)
                    assert torch.equal(local_of(p), state.view(pname, "param")), (name, pname)
                    assert p.grad is None, (name, pname)

        check_all()
        before = {uid: s.flat.clone() for uid, s in ctx.units.items()}
        result = train_step(ctx, step=0)
        check_all()
        changed = {}
        for uid, s in ctx.units.items():
            old = before[uid]
            for slot, _ in s.shards():
                span = slice(slot.byte_offset, slot.byte_offset + slot.num_bytes)
                key = f"{s.placement.model_stage}/{slot.kind}"
                changed[key] = changed.get(key, False) or not torch.equal(old[span], s.flat[span])
        counters = {s.placement.model_stage: s.counters.tolist() for s in ctx.units.values()}
        return {"checked": checked, "dtensors": dtensors, "changed": changed, "counters": counters,
                "loss": result.actor_loss, "stages": sorted(result.stage_seconds)}
    finally:
        sync_mod.pack, sync_mod.unpack, sync_mod.transfer, loop_mod.transfer = saved  # type: ignore[assignment]


# --- logical state from dumps ---------------------------------------------------------------------------


def logical(dumps: dict[int, Any], stages: set[str] | None = None) -> dict[tuple[str, str, str], torch.Tensor]:
    """Every (stage, tensor, kind) reassembled from all workers' shards (transitions.executor.logical);
    copies must agree bitwise and every element must be held."""
    return logical_state(dumps, stages, strict=True)


def assert_bitwise(a: dict[tuple[str, str, str], torch.Tensor], b: dict[tuple[str, str, str], torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(a[key].contiguous().view(torch.uint8), b[key].contiguous().view(torch.uint8)), key


# --- tests -----------------------------------------------------------------------------------------------


def test_live_placements_units_and_ranks() -> None:
    """Pure parts: which stages are live (trainers with moments, frozen inference with parameters),
    their units at the plan's version, a DAG ending on the new plan's units, the id -> rank map."""
    kinds = {p.model_stage: p.kinds for p in live_placements(PPO, PLAN_A)}
    training = (StateKind.PARAM, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ)
    assert kinds == {"ref-inf": (StateKind.PARAM,), "actor-train": training, "critic-train": training}
    assert all(p.model.bytes_per_param == 4 for p in live_placements(PPO, PLAN_A))  # the engine's fp32
    rm = RunConfig(algo="grpo", reward_model=TINY_BYTE)
    grpo_plan = plan(rm, 1, actor_gen=(1, 1, [[0]]), ref_inf=(1, 1, [[0]]), reward_inf=(1, 1, [[1]]),
                     actor_train=(1, 1, [[1]]))
    placed = live_placements(rm, grpo_plan)
    assert [p.model_stage for p in placed] == ["ref-inf", "reward-inf", "actor-train"]
    assert stage_states(rm, placed)["reward-inf"].role is Role.REWARD  # never rebuilt from a critic
    assert sorted(u.uid for u in live_units(PPO, PLAN_C)) == [
        "actor-train@v3#0", "critic-train@v3#0", "ref-inf@v3#0"]
    dag = live_dag(PPO, PLAN_B, PLAN_C)
    assert sorted(u.uid for u in dag.new_units) == sorted(u.uid for u in live_units(PPO, PLAN_C))
    ranks = rank_plan(PLAN_C, MEMBERS)
    assert ranks.stage("actor-train").gpu_sets == ((2, 3),)  # workers (3, 1) are ranks (2, 3)
    with pytest.raises(SpecError, match="not members"):
        rank_plan(PLAN_A, (0, 1, 2))


@pytest.mark.multiprocess
def test_engine_state_is_views_of_the_unit_buffers(pool: LocalCoordinator) -> None:
    """After bind (a fresh start: units allocated and filled once), every parameter and AdamW moment
    of every model-stage (TP2 DTensor shards, PP2 stages, plain replicas) lies inside its unit's
    flat buffer; a step changes the trainers' parameter and moment bytes in those buffers, leaves
    the frozen reference alone, writes the counters, and never calls sync.pack/unpack/transfer."""
    cfg = GRPO
    p = plan(cfg, 1, actor_gen=(1, 2, [[3, 0]]), ref_inf=(2, 1, [[1, 2]]), actor_train=(2, 1, [[0, 1]]))
    pool.call(forget)
    out = pool.call(views_and_one_step, cfg=cfg, plan=p)
    assert sum(r["checked"] for r in out.values()) > 0
    assert out[0]["dtensors"] > 0  # worker 0 holds a TP shard of actor-train
    for w in (0, 1):  # actor-train's workers
        changed = out[w]["changed"]
        assert changed["actor-train/param"] and changed["actor-train/exp_avg"] and changed["actor-train/exp_avg_sq"]
        # version, optimizer steps, RL steps, data position (prompts consumed)
        assert out[w]["counters"]["actor-train"] == [1, 1, 1, cfg.prompts_per_step]
    for w in (1, 2):
        assert not out[w]["changed"]["ref-inf/param"]
        assert out[w]["counters"]["ref-inf"] == [1, 0, 1, cfg.prompts_per_step]
    assert out[3]["stages"] == ["actor-gen", "actor-train", "ref-inf", "weight-sync"]
    # a step that is not the units' data position, and a stage half held, are refused on every member
    with pytest.raises(Exception, match="RL step 1, asked for 0"):
        pool.call(train_step, step=0)
    pool.call(drop_one, workers=[0], stage="actor-train")
    with pytest.raises(Exception, match="held and 1 missing"):
        pool.call(bind, cfg=cfg, plan=p)


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_live_transitions_match_checkpoint_restart_and_a_fixed_layout(pool: LocalCoordinator, tmp_path: Any) -> None:
    """PPO on 4 workers over plans A -> B -> C -> D (TP2 -> TP1xDP2 -> PP2 without worker 0 -> DP4),
    one step on each. Live: the executor moves the units (live_dag) and the engine re-binds on them;
    every logical tensor (weights, moments, counters) is exactly what the old layout held. Restart
    twin: the same schedule, each change a DCP save, new worker processes and a load into the new
    layout (its first save is the live run's own, at the first change: until then the runs are one
    run); the final state is bit-identical (the same bytes in the same layouts compute the same
    steps) and so is every rollout. Fixed layout: plan A throughout, same samples (identical rollout
    tokens), final trainer weights and moments within rtol 1e-4 / atol 1e-5 (TP and DP change the
    fp32 reduction order, and Adam amplifies the noise of near-zero gradients, as in test_dp_change;
    measured max abs differences: weights 4.8e-7, exp_avg 1.5e-8, exp_avg_sq 2.9e-11)."""
    url = str(tmp_path / "ckpt")
    pool.call(forget)
    live_rollouts: list[str] = []
    step = 0
    for i, p in enumerate(SCHEDULE):
        if i == 0:
            info = pool.call(bind, cfg=PPO, plan=p)
            assert all(r["rl_steps"] == 0 for r in info.values())
            init_state = logical(pool.dump())
        else:
            if i == 1:  # the twin restarts from here: up to now the two runs are one
                pool.save_checkpoint(url, "twin-1")
            before = logical(pool.dump())
            assert set(pool.call(release).values()) != {0}  # the engine was bound to units
            outcome = pool.run_dag(live_dag(PPO, SCHEDULE[i - 1], p), live_cluster(PPO, SCHEDULE[i - 1], p))
            assert outcome.committed, outcome.errors
            assert_bitwise(before, logical(pool.dump()))
            info = pool.call(bind, cfg=PPO, plan=p)
            assert {r["rl_steps"] for r in info.values()} == {step} and not any(r["fresh"] for r in info.values())
        if i == 2:
            assert pool.call(held)[0] == []  # PLAN_C places nothing on worker 0
        for _ in range(STEPS_PER_PLAN):
            live_rollouts.append(pool.call(train_step, step=step)[MEMBERS[0]].rollout_sha256)
            step += 1
    live_digest = pool.call(state_digest)
    live_state = logical(pool.dump())

    # restart twin: every change through the checkpoint, in new worker processes
    twin_rollouts = live_rollouts[:STEPS_PER_PLAN]
    step = STEPS_PER_PLAN
    for i in range(1, len(SCHEDULE)):
        coord = _restart()
        try:
            coord.load_checkpoint(url, f"twin-{i}", live_units(PPO, SCHEDULE[i]))
            info = coord.call(bind, cfg=PPO, plan=SCHEDULE[i])
            assert {r["rl_steps"] for r in info.values()} == {step}
            for _ in range(STEPS_PER_PLAN):
                twin_rollouts.append(coord.call(train_step, step=step)[MEMBERS[0]].rollout_sha256)
                step += 1
            if i + 1 < len(SCHEDULE):
                coord.save_checkpoint(url, f"twin-{i + 1}")
            else:
                twin_digest = coord.call(state_digest)
        finally:
            coord.close()
    assert twin_rollouts == live_rollouts
    assert twin_digest == live_digest  # per worker, per shard: bit-identical

    # never changed: plan A throughout, from the same initial weights
    pool.call(forget)
    pool.call(bind, cfg=PPO, plan=PLAN_A)
    fixed_rollouts = [pool.call(train_step, step=s)[MEMBERS[0]].rollout_sha256 for s in range(step)]
    assert fixed_rollouts == live_rollouts  # the same samples
    fixed_state = logical(pool.dump())
    worst: dict[str, float] = {}
    for key in (k for k in live_state if k[0].endswith("-train") and k[1] != "_meta.counters"):
        torch.testing.assert_close(live_state[key], fixed_state[key], rtol=1e-4, atol=1e-5, msg=str(key))
        diff = float((live_state[key] - fixed_state[key]).abs().max())
        worst[key[2]] = max(worst.get(key[2], 0.0), diff)
    print("max abs diff live vs fixed layout, per kind:", worst)
    moved = max(float((live_state[k] - init_state[k]).abs().max()) for k in live_state
                if k[0] == "actor-train" and k[2] == "param")
    assert moved > 1e-3  # training really changed the weights, so agreement means equal training
