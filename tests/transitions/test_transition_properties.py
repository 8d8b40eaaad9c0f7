"""Property tests over random clusters, models and old/new plans (shared GPUs, GPU loss, tight memory).

Each example is a seeded random scenario (transitions.scenarios): replaying its DAG element by element
fills every target shard exactly once from the right source bytes, never drops the last copy of a byte
before it is copied, never exceeds a GPU's memory, and leaves exactly the new plan's units; the DAG is
acyclic and its schedule is deadlock-free with every GPU running one primitive at a time.
"""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.errors import InfeasibleError
from transitions.cost import schedule, transition_cost
from transitions.global_dag import TransitionDAG, build_transition
from transitions.local_dag import LastCopyLostError
from transitions.pieces import transfers
from transitions.replay import replay
from transitions.scenarios import Scenario, random_scenario

PROPERTY = settings(max_examples=35, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _check_structure(dag: TransitionDAG, sc: Scenario) -> None:
    n = len(dag.nodes)
    pos = {i: k for k, i in enumerate(dag.order)}
    assert sorted(dag.order) == list(range(n))
    for a, b in (*dag.data_edges, *dag.resource_edges):
        assert pos[a] < pos[b], "order is not topological: the DAG would have a cycle"
    start, end, _ = schedule(dag, [1.0 + (i % 3) for i in range(n)])
    assert all(e >= s for s, e in zip(start, end))
    for a, b in (*dag.data_edges, *dag.resource_edges):
        assert end[a] <= start[b]
    for g in range(sc.cluster.num_gpus):  # one primitive at a time per GPU: intervals do not overlap
        spans = sorted((start[i], end[i]) for i in dag.nodes_on(g))
        assert all(e1 <= s2 for (_, e1), (s2, _) in zip(spans, spans[1:]))
    cost = transition_cost(dag, sc.cluster)
    assert cost.bytes_moved == dag.bytes_moved == cost.intra_node_bytes + cost.inter_node_bytes
    assert cost.seconds > 0 if dag.bytes_moved else cost.seconds >= 0
    assert not cost.critical_path or cost.end_s[cost.critical_path[-1]] == cost.seconds
    assert json.loads(json.dumps(dag.to_dict()))["order"] == list(dag.order)


def _assert_really_lost(sc: Scenario, err: LastCopyLostError) -> None:
    for name in err.model_stages:
        old = sc.old.stage(name) if name in {s.model_stage for s in sc.old} else None
        intact = [s for s in (old.gpu_sets if old else ()) if not sc.lost_gpus.intersection(s)]
        assert not intact, f"{name} still had an intact replica"


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), loss=st.sampled_from([0.0, 0.5]), exact=st.booleans())
def test_replay_fills_every_target_exactly(seed: int, loss: float, exact: bool) -> None:
    """Both paths: replica classes wherever they apply (exact=False) and the per-unit one (True)."""
    _replay_case(seed, loss, exact)


def _replay_case(seed: int, loss: float, exact: bool) -> bool:
    """One example; True when the builder accepted it (False: it refused a real loss of a last copy)."""
    sc = random_scenario(random.Random(seed), loss_probability=loss)
    try:
        dag = build_transition(sc.states, sc.cluster, sc.old, sc.new, lost_gpus=sc.lost_gpus,
                               capacity_bytes=1 << 50, exact=exact)
    except LastCopyLostError as err:
        _assert_really_lost(sc, err)
        return False
    report = replay(dag)
    assert report.final_units == sorted(u.uid for u in dag.new_units)
    assert report.bytes_remote == dag.bytes_moved
    _check_structure(dag, sc)
    return True


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), squeeze=st.floats(1.0, 2.0), exact=st.booleans())
def test_tight_memory_is_respected_or_refused(seed: int, squeeze: float, exact: bool) -> None:
    """With a capacity near the larger of the old and new per-GPU state, the builder either returns
    an order under which no GPU ever exceeds it (checked by replay) or refuses, naming GPU and bytes."""
    _tight_case(seed, squeeze, exact)


def _tight_case(seed: int, squeeze: float, exact: bool) -> bool:
    """One example; True when the builder found an order within the capacity (False: it refused)."""
    sc = random_scenario(random.Random(seed), max_stages=4)
    roomy = build_transition(sc.states, sc.cluster, sc.old, sc.new, capacity_bytes=1 << 50)
    before: dict[int, int] = {}
    after: dict[int, int] = {}
    for units, usage in ((roomy.old_units, before), (roomy.new_units, after)):
        for u in units:
            for g in u.gpus:
                usage[g] = usage.get(g, 0) + u.bytes_on(g)
    held = {g: max(before.get(g, 0), after.get(g, 0)) for g in before.keys() | after.keys()}
    capacity = int(max(held.values()) * squeeze)
    try:
        dag = build_transition(sc.states, sc.cluster, sc.old, sc.new, capacity_bytes=capacity, exact=exact)
    except InfeasibleError as err:
        assert "GPU" in str(err) and "bytes" in str(err)
        return False
    report = replay(dag)  # raises if any GPU goes above capacity at any point
    assert max(report.peak_bytes.values()) <= capacity
    _check_structure(dag, sc)
    return True


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_each_gpu_derives_its_own_share(seed: int) -> None:
    sc = random_scenario(random.Random(seed))
    dag = build_transition(sc.states, sc.cluster, sc.old, sc.new, capacity_bytes=1 << 50)
    for prim in dag.nodes:
        everything = transfers(prim)
        for g in dag.footprints[dag.nodes.index(prim)].gpus:
            assert transfers(prim, g) == [t for t in everything if g in (t.src_worker, t.dst_worker)]
        assert sum(t.num_bytes for t in everything) == dag.footprints[dag.nodes.index(prim)].moved_bytes


# Hypothesis draws the examples above and does not count branches: these fixed seeds check, on each
# path (exact per-unit order and replica classes), that the properties are mostly exercised on
# accepted (built and replayed) changes rather than on refusals, and that both branches run.
# Measured on seeds 0-23, on each path: 17 of 24 accepted with loss 0.5, 12 of 24 with squeeze in [1, 2].
SEEDS = range(24)


@pytest.mark.parametrize("exact", [True, False])
def test_most_examples_with_lost_gpus_are_built_and_replayed(exact: bool) -> None:
    accepted = [_replay_case(seed, 0.5, exact) for seed in SEEDS]
    assert sum(accepted) >= len(SEEDS) / 2 and not all(accepted), accepted


@pytest.mark.parametrize("exact", [True, False])
def test_a_third_of_tight_memory_examples_is_built_within_capacity(exact: bool) -> None:
    squeeze = random.Random(0)
    accepted = [_tight_case(seed, 1.0 + squeeze.random(), exact) for seed in SEEDS]
    assert sum(accepted) >= len(SEEDS) / 3 and not all(accepted), accepted
