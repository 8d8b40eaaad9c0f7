"""The unit-level DAG expanded from replica classes carries, per node, exactly the footprint its own
primitive derives (each member's class footprint placed on its GPUs)."""

from __future__ import annotations

import random

from planner.errors import InfeasibleError
from planner.models import LLAMA_31_8B
from planner.plan import Layout
from transitions.footprints import footprint
from transitions.global_dag import build_transition
from transitions.planning_cache import PlanningCache
from transitions.scenarios import h200_cluster, ppo_plan, random_scenario, stage_states

OLD = {"actor-gen": Layout(2, 1), "ref-inf": Layout(2, 1), "critic-inf": Layout(2, 1), "reward-inf": Layout(2, 1),
       "actor-train": Layout(4, 1), "critic-train": Layout(4, 1)}
NEW = {"actor-gen": Layout(4, 1), "ref-inf": Layout(1, 1), "critic-inf": Layout(1, 1), "reward-inf": Layout(2, 1),
       "actor-train": Layout(8, 1), "critic-train": Layout(4, 2)}


def test_expanded_footprints_are_each_members_own() -> None:
    cache = PlanningCache()
    dags = [build_transition(stage_states(LLAMA_31_8B), h200_cluster(64), ppo_plan(1, 64, OLD), ppo_plan(2, 64, NEW),
                             exact=False, cache=cache)]
    rng = random.Random(5)
    while len(dags) < 12:
        sc = random_scenario(rng, max_stages=3)
        try:
            dag = build_transition(sc.states, sc.cluster, sc.old, sc.new, exact=False, cache=cache)
        except InfeasibleError:
            continue
        if dag.replicas is not None:
            dags.append(dag)
    for dag in dags:
        assert dag.replicas is not None and not dag.expanded
        fresh = PlanningCache()  # derived again from nothing, member by member
        assert [footprint(p, fresh) for p in dag.nodes] == list(dag.footprints)
        assert sum(fp.moved_bytes for fp in dag.footprints) == dag.replicas.bytes_moved
