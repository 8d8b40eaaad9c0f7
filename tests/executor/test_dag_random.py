"""Random transitions of two model-stages on 4 real workers: every DAG run is bit-exact and leaves each
worker holding exactly the new plan's units (the check that caught parts keeping their names).

Seeded, so a failure replays; each case prints its plans through the assertion message.
"""

from __future__ import annotations

import random

import pytest
from executor_helpers import MICRO, assert_same_state, logical_state

from agent.coordinator import LocalCoordinator
from agent.worker import held_units
from planner.errors import NereusError
from planner.hardware import cluster_preset
from planner.plan import GlobalPlan, Layout, StagePlan
from planner.workflow import ACTOR_TRAIN, REF_INF
from transitions.global_dag import build_transition
from transitions.local_dag import plan_units
from transitions.scenarios import stage_states

pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("executor-pool")]

STATES = stage_states(MICRO, (REF_INF, ACTOR_TRAIN))
CLUSTER = cluster_preset("cpu", 4)
LAYOUTS = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (1, 4)]  # MICRO: 4 heads, 4 layers


def _random_plan(rng: random.Random, version: int) -> GlobalPlan:
    stages = []
    for name in ("actor-train", "ref-inf"):
        tp, pp = rng.choice(LAYOUTS)
        dp = rng.randint(1, 4 // (tp * pp))
        gpus = list(range(4))
        rng.shuffle(gpus)
        size = tp * pp
        stages.append(StagePlan(model_stage=name, layout=Layout(tp, pp), micro_batch_size=1,
                                gpu_sets=tuple(tuple(gpus[r * size:(r + 1) * size]) for r in range(dp))))
    return GlobalPlan(version=version, stages=tuple(stages))


def _units(plan: GlobalPlan) -> list:
    return [u for sp in plan for u in plan_units(STATES[sp.model_stage], sp, plan.version)]


@pytest.mark.parametrize("seed", [11, 12])
def test_random_transitions_are_exact_and_leave_the_new_units(pool: LocalCoordinator, seed: int) -> None:
    rng = random.Random(seed)
    ran = in_place = 0
    for case in range(8):
        old, new = _random_plan(rng, 1), _random_plan(rng, 2)
        try:
            dag = build_transition(STATES, CLUSTER, old, new)
        except NereusError:
            continue  # the planner refuses it (memory): nothing to run
        pool.init_units(_units(old), seed=case)
        before = logical_state(pool.dump())
        outcome = pool.run_dag(dag, CLUSTER)
        assert outcome.committed, (case, old, new, outcome.errors)
        assert_same_state(before, logical_state(pool.dump()))
        expected = {w: sorted(u.uid for u in _units(new) if u.holds(w)) for w in pool.alive}
        assert pool.call(held_units) == expected, (case, old, new)
        ran += 1
        in_place += sum(r.in_place for reps in outcome.reports.values() for r in reps)
    assert ran >= 6 and in_place > 0  # the cases did run, and in-place building was among them
