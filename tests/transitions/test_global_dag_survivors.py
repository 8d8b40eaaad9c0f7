"""transitions.global_dag on what its other tests left open: a model-stage whose every replica is lost
is rebuilt only from a training stage of its own role (the reference model shares the actor's
architecture, model and head, but not its weights); a DAG of exactly the exact search's size gets it,
and one of exactly TIMED_NODE_LIMIT nodes the duration-aware greedy pass."""

from __future__ import annotations

import random

import pytest

from planner.errors import SpecError
from planner.hardware import CPU, LOOPBACK, NVLINK4, ClusterSpec
from planner.models import ModelSpec
from planner.plan import GlobalPlan, Layout
from planner.workflow import ACTOR_GEN, ACTOR_TRAIN, REF_INF
from transitions.cost import DEFAULT_COMMUNICATOR_SETUP_S, primitive_seconds
from transitions.exact_order import EXACT_MAKESPAN_NODES, fastest_order, makespan
from transitions.feasibility import TIMED_NODE_LIMIT, order_by_memory
from transitions.global_dag import LastCopyLostError, TransitionDAG, build_transition, primitive_count
from transitions.replay import replay
from transitions.scenarios import random_scenario, stage_plan, stage_states

TINY = ModelSpec(name="tiny", num_layers=2, hidden_size=8, num_attention_heads=4, num_kv_heads=2, head_dim=2,
                 ffn_hidden_size=24, vocab_size=11)
STATES = stage_states(TINY, (ACTOR_GEN, REF_INF, ACTOR_TRAIN))
CLUSTER = ClusterSpec(device=CPU, num_nodes=1, gpus_per_node=4, intra_node_link=NVLINK4, inter_node_link=LOOPBACK)


def _plan(version: int, *stages: tuple[str, list[int]]) -> GlobalPlan:
    return GlobalPlan(version=version, stages=tuple(stage_plan(name, Layout(1, 1), gpus, 1) for name, gpus in stages))


def test_a_lost_reference_is_not_rebuilt_from_the_actor() -> None:
    """ref-inf's only replica sat on GPU 0, which died; actor-train (same model, LM head, a superset
    of ref-inf's state kinds) survives on GPU 2: its bytes are the actor's, not the reference's, so
    the reference's state is lost. A lost actor-gen, by contrast, is rebuilt from actor-train."""
    old = _plan(1, ("ref-inf", [0]), ("actor-train", [2]))
    new = _plan(2, ("ref-inf", [1]), ("actor-train", [2]))
    assert set(STATES["ref-inf"].kinds) <= set(STATES["actor-train"].kinds)
    assert STATES["ref-inf"].model == STATES["actor-train"].model
    with pytest.raises(LastCopyLostError):
        build_transition(STATES, CLUSTER, old, new, lost_gpus=frozenset({0}))
    gen = build_transition(STATES, CLUSTER, _plan(1, ("actor-gen", [0]), ("actor-train", [2])),
                           _plan(2, ("actor-gen", [1]), ("actor-train", [2])), lost_gpus=frozenset({0}))
    assert {u.uid for p in gen.nodes for u in p.sources} == {"actor-train@v1#0"}
    assert replay(gen).final_units == ["actor-gen@v2#0", "actor-train@v2#0"]


def _first_change_of(rng: random.Random, nodes: int) -> tuple[TransitionDAG, list[float], tuple[int, ...]]:
    """The next random change of ``nodes`` unit-level nodes whose greedy order some memory-feasible order
    beats, with room to spare: (dag, durations, greedy order)."""
    for _ in range(3000):
        sc = random_scenario(rng, max_stages=4)
        if primitive_count(sc.states, sc.old, sc.new) != nodes:
            continue
        dag = build_transition(sc.states, sc.cluster, sc.old, sc.new, capacity_bytes=1 << 50, exact=True)
        fps, edges = list(dag.footprints), list(dag.data_edges)
        durations = [primitive_seconds(fp, sc.cluster, DEFAULT_COMMUNICATOR_SETUP_S) for fp in fps]
        greedy = order_by_memory(fps, edges, list(dag.stage_order), dag.initial_bytes, dag.capacity_bytes,
                                 durations=durations).order  # the builder's greedy prices with them too
        if fastest_order(fps, edges, dag.initial_bytes, dag.capacity_bytes, durations,
                         makespan(fps, edges, greedy, durations)) is not None:
            return dag, durations, greedy
    raise AssertionError(f"no change of {nodes} nodes with a greedy order to beat in 3,000 draws")


def test_the_exact_search_size_is_inclusive() -> None:
    """A DAG of exactly EXACT_MAKESPAN_NODES nodes whose greedy order is beaten ships the faster order
    the search finds (the limit is inclusive); one node more ships the greedy order."""
    rng = random.Random(0)
    dag, durations, greedy = _first_change_of(rng, EXACT_MAKESPAN_NODES)
    fps, edges = list(dag.footprints), list(dag.data_edges)
    best = fastest_order(fps, edges, dag.initial_bytes, dag.capacity_bytes, durations)
    assert best is not None and dag.order != greedy
    assert makespan(fps, edges, dag.order, durations) == makespan(fps, edges, best, durations) \
        < makespan(fps, edges, greedy, durations)
    dag, durations, greedy = _first_change_of(rng, EXACT_MAKESPAN_NODES + 1)
    assert dag.order == greedy


def test_the_per_stage_policy_keeps_its_naive_order_where_a_faster_one_fits() -> None:
    """The first random change (seed 11: the 25th) of 2..EXACT_MAKESPAN_NODES nodes whose per-stage
    order some memory-feasible order beats: ``per_stage`` is the naive baseline, it ships its own order."""
    rng = random.Random(11)
    for _ in range(50):
        sc = random_scenario(rng, max_stages=3)
        if not 2 <= primitive_count(sc.states, sc.old, sc.new) <= EXACT_MAKESPAN_NODES:
            continue
        dag = build_transition(sc.states, sc.cluster, sc.old, sc.new, capacity_bytes=1 << 50, policy="per_stage")
        fps, edges = list(dag.footprints), list(dag.data_edges)
        durations = [primitive_seconds(fp, sc.cluster, DEFAULT_COMMUNICATOR_SETUP_S) for fp in fps]
        span = makespan(fps, edges, dag.order, durations)
        faster = fastest_order(fps, edges, dag.initial_bytes, dag.capacity_bytes, durations, span)
        if faster is None:
            continue
        assert makespan(fps, edges, faster, durations) < span
        naive = order_by_memory(fps, edges, list(dag.stage_order), dag.initial_bytes, dag.capacity_bytes,
                                policy="per_stage")
        assert dag.order == naive.order
        return
    raise AssertionError("no per-stage order of 50 random changes was beaten")


def test_a_refresh_naming_an_unknown_stage_lists_the_known_ones() -> None:
    old = _plan(1, ("actor-gen", [0]), ("actor-train", [2]))
    new = _plan(2, ("actor-gen", [0]), ("actor-train", [2]))
    for refresh in ({"actor-gen": "actor-trian"}, {"critic-inf": "actor-train"}):
        with pytest.raises(SpecError) as err:
            build_transition(STATES, CLUSTER, old, new, refresh=refresh)
        assert err.value.field == "refresh"
        assert err.value.allowed == "actor-gen, ref-inf, actor-train"


def test_a_dag_of_exactly_the_timed_limit_gets_the_duration_aware_pass() -> None:
    """The 84th random change of seed 20 (up to 6 model-stages) has exactly TIMED_NODE_LIMIT nodes, too
    many for the exact search: the builder (unit by unit) prices them for the greedy's duration-aware pass, whose order
    it ships, faster than the memory-only passes' order."""
    rng = random.Random(20)
    for _ in range(84):
        sc = random_scenario(rng, max_stages=6)
    assert primitive_count(sc.states, sc.old, sc.new) == TIMED_NODE_LIMIT > EXACT_MAKESPAN_NODES
    dag = build_transition(sc.states, sc.cluster, sc.old, sc.new, capacity_bytes=1 << 50, exact=True)
    fps, edges = list(dag.footprints), list(dag.data_edges)
    durations = [primitive_seconds(fp, sc.cluster, DEFAULT_COMMUNICATOR_SETUP_S) for fp in fps]
    memory_only = order_by_memory(fps, edges, list(dag.stage_order), dag.initial_bytes, dag.capacity_bytes).order
    timed = order_by_memory(fps, edges, list(dag.stage_order), dag.initial_bytes, dag.capacity_bytes,
                            durations=durations).order
    assert dag.order == timed
    assert makespan(fps, edges, dag.order, durations) < makespan(fps, edges, memory_only, durations)
