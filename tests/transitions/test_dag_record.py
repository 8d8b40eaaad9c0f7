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


def test_ids_by_group_from_the_classes_are_the_expanded_dags() -> None:
    """An order's per-node parts come from the replica classes, unexpanded: for random groupings of
    GPUs (nodes of 1-4 GPUs, some GPUs in no group), the same ids as grouping the unit-level gpu_nodes."""
    cache = PlanningCache()
    rng = random.Random(11)
    checked = 0
    while checked < 16:
        sc = random_scenario(rng, max_stages=3, loss_probability=0.3)
        try:
            dag = build_transition(sc.states, sc.cluster, sc.old, sc.new, lost_gpus=sc.lost_gpus, exact=False,
                                   cache=cache)
        except InfeasibleError:
            continue
        if dag.replicas is None:
            continue
        per = rng.randint(1, 4)
        group_of = {g: g // per for g in range(sc.cluster.num_gpus) if rng.random() < 0.8}
        fast = dag.ids_by_group(group_of)
        assert not dag.expanded  # answered from the classes
        want: dict[int, set[int]] = {}
        for gpu, ids in dag.gpu_nodes.items():
            if gpu in group_of:
                want.setdefault(group_of[gpu], set()).update(ids)
        assert fast == {k: sorted(v) for k, v in want.items()}
        assert dag.ids_by_group(group_of) == fast  # expanded now: the unit-level path, the same answer
        checked += 1
