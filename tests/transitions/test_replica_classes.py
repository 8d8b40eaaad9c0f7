"""The replica-class fast path of build_transition against the exact per-unit path.

Random *symmetric* plan changes (every model-stage's replicas laid out the same way over strided GPU
groups, as the planner proposes them, on a small random model and cluster): the fast path must give
the same primitives, units, renames and bytes as the exact path, and an order that the element-level
replay accepts (every target filled exactly, the last copy never dropped, no GPU over capacity, peaks
as predicted). Its class-level schedule must equal the unit-level schedule of the same order. Under a
tight capacity it either returns such an order or gives way to the exact path.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.errors import InfeasibleError
from planner.hardware import CPU, LOOPBACK, NVLINK4, ClusterSpec
from planner.models import ModelSpec
from planner.plan import GlobalPlan, Layout
from transitions.cost import transition_cost
from transitions.global_dag import TransitionDAG, build_transition
from transitions.planning_cache import PlanningCache
from transitions.primitives import Extend
from transitions.replay import replay
from transitions.scenarios import PPO_STAGES, ppo_plan, random_model, stage_plan, stage_states

PROPERTY = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _layouts(rng: random.Random, model: ModelSpec, max_size: int) -> Layout:
    options = [Layout(t, p) for t in (1, 2, 4) for p in (1, 2)
               if model.valid_tp(t) and p <= model.num_layers and t * p <= max_size]
    return rng.choice(options)


def _plan(rng: random.Random, version: int, model: ModelSpec, names: list[str], pool: list[int],
          groups: dict[str, list[int]]) -> GlobalPlan:
    stages = []
    for name in names:
        gpus = groups[name]
        lay = _layouts(rng, model, len(gpus))
        stages.append(stage_plan(name, lay, gpus, len(gpus) // lay.size))
    return GlobalPlan(version=version, stages=tuple(stages))


def symmetric_case(seed: int) -> tuple[dict, ClusterSpec, GlobalPlan, GlobalPlan]:
    rng = random.Random(seed)
    model = random_model(rng)
    cluster = ClusterSpec(device=CPU, num_nodes=rng.randint(2, 4), gpus_per_node=4, intra_node_link=NVLINK4,
                          inter_node_link=LOOPBACK)
    pool = list(range(cluster.num_gpus))
    if rng.random() < 0.3:
        rng.shuffle(pool)  # replicas alike only up to a renaming that is not a shift
    stages = sorted(rng.sample(PPO_STAGES, rng.randint(1, 4)), key=PPO_STAGES.index)
    names = [ms.name for ms in stages]
    stride = rng.choice([1, 2, 3])
    groups = {name: sorted(pool[k % stride::stride]) if rng.random() < 0.5 else pool[k % stride::stride]
              for k, name in enumerate(names)}
    old = _plan(rng, 1, model, names, pool, groups)
    new = _plan(rng, 2, model, names, pool, groups)
    return stage_states(model, tuple(stages)), cluster, old, new


def _prims(dag: TransitionDAG) -> list[tuple[str, tuple[str, ...], tuple[str, ...], tuple[str, ...]]]:
    return sorted((p.kind.value, tuple(u.uid for u in p.sources) if isinstance(p, Extend) else
                   tuple(sorted(u.uid for u in p.sources)), tuple(u.uid for u in p.targets),
                   tuple(sorted(u.uid for u in p.frees))) for p in dag.nodes)


def _same_as_exact(fast: TransitionDAG, exact: TransitionDAG) -> None:
    assert _prims(fast) == _prims(exact)
    assert sorted(u.uid for u in fast.new_units) == sorted(u.uid for u in exact.new_units)
    assert sorted(u.uid for u in fast.old_units) == sorted(u.uid for u in exact.old_units)
    assert sorted(fast.renamed) == sorted(exact.renamed)
    assert fast.bytes_moved == exact.bytes_moved


def _check_order_and_cost(dag: TransitionDAG, cluster: ClusterSpec) -> None:
    pos = {i: k for k, i in enumerate(dag.order)}
    assert sorted(dag.order) == list(range(len(dag.nodes)))
    assert all(pos[a] < pos[b] for a, b in dag.data_edges)
    fast = transition_cost(dag, cluster)
    unit_level = transition_cost(dag.with_order(dag.order), cluster)  # no replica plan: per-unit schedule
    assert fast.seconds == pytest.approx(unit_level.seconds, rel=1e-9, abs=1e-12)
    assert np.allclose(fast.start_s, unit_level.start_s, rtol=1e-9, atol=1e-12)
    assert np.allclose(fast.end_s, unit_level.end_s, rtol=1e-9, atol=1e-12)
    assert (fast.bytes_moved, fast.intra_node_bytes) == (unit_level.bytes_moved, unit_level.intra_node_bytes)
    path = fast.critical_path
    if path:  # a chain of nodes, each starting when the one before it ended, ending at L_tran
        assert fast.end_s[path[-1]] == pytest.approx(fast.seconds)
        for a, b in zip(path, path[1:]):
            assert fast.end_s[a] == pytest.approx(fast.start_s[b])
        assert fast.start_s[path[0]] == 0.0


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1))
def test_fast_path_matches_exact_and_replays(seed: int) -> None:
    states, cluster, old, new = symmetric_case(seed)
    fast = build_transition(states, cluster, old, new, capacity_bytes=1 << 50, exact=False)
    exact = build_transition(states, cluster, old, new, capacity_bytes=1 << 50, exact=True)
    assert exact.replicas is None
    if fast.replicas is None:
        return  # not symmetric after all: the exact path was taken (covered by the other tests)
    assert not fast.expanded and fast.bytes_moved == exact.bytes_moved  # known before any expansion
    _check_order_and_cost(fast, cluster)
    _same_as_exact(fast, exact)
    report = replay(fast)
    assert report.peak_bytes == {g: b for g, b in fast.peak_bytes.items() if g in report.peak_bytes}
    assert report.final_units == sorted(u.uid for u in fast.new_units)
    assert report.bytes_remote == fast.bytes_moved


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), squeeze=st.floats(0.9, 1.3))
def test_tight_capacity_is_respected_or_left_to_the_exact_path(seed: int, squeeze: float) -> None:
    states, cluster, old, new = symmetric_case(seed)
    roomy = build_transition(states, cluster, old, new, capacity_bytes=1 << 50, exact=True)
    capacity = int(max(roomy.peak_bytes.values(), default=1) * squeeze)
    try:
        dag = build_transition(states, cluster, old, new, capacity_bytes=capacity, exact=False)
    except InfeasibleError as err:
        assert "GPU" in str(err) and "bytes" in str(err)
        with pytest.raises(InfeasibleError):  # the fast path never refuses what the exact path finds
            build_transition(states, cluster, old, new, capacity_bytes=capacity, exact=True)
        return
    report = replay(dag)  # raises if any GPU goes above capacity at any point
    assert max(report.peak_bytes.values(), default=0) <= capacity


def test_share_of_symmetric_cases_on_the_fast_path() -> None:
    """The fast path must actually carry the symmetric cases (not fall back on most of them); by
    default small ones go the exact way (MIN_UNITS) and large symmetric ones the fast way."""
    # a fresh cache per case: every build runs the class builder through (a shared cache would let
    # later cases reuse stage plans built by earlier ones, and mutation testing map them to no builder)
    used = sum(build_transition(*symmetric_case(seed), capacity_bytes=1 << 50, exact=False,
                                cache=PlanningCache()).replicas is not None for seed in range(60))
    assert used >= 45, f"only {used}/60 symmetric cases took the replica-class path"
    states, cluster, old, new = symmetric_case(3)
    assert build_transition(states, cluster, old, new).replicas is None  # tiny: exact by default
    model = ModelSpec(name="tiny", num_layers=2, hidden_size=8, num_attention_heads=4, num_kv_heads=2, head_dim=2,
                      ffn_hidden_size=24, vocab_size=11)
    big = stage_states(model, PPO_STAGES)
    cluster = ClusterSpec(device=CPU, num_nodes=32, gpus_per_node=4, intra_node_link=NVLINK4,
                          inter_node_link=LOOPBACK)
    old = ppo_plan(1, cluster.num_gpus, {ms.name: Layout(1, 1) for ms in PPO_STAGES})
    new = ppo_plan(2, cluster.num_gpus, {ms.name: Layout(2, 1) for ms in PPO_STAGES})
    assert build_transition(big, cluster, old, new, capacity_bytes=1 << 50).replicas is not None


def test_cached_stage_classes_do_not_leak_between_dags() -> None:
    """Two DAGs sharing stage plans (and so cached classes) each expand to their own correct DAG."""
    states, cluster, old, new = symmetric_case(11)
    first = build_transition(states, cluster, old, new, capacity_bytes=1 << 50, exact=False)
    newer = GlobalPlan(version=5, stages=new.stages)
    second = build_transition(states, cluster, old, newer, capacity_bytes=1 << 50, exact=False)
    assert first.replicas is not None and second.replicas is not None
    exact = build_transition(states, cluster, old, new, capacity_bytes=1 << 50, exact=True)
    _same_as_exact(first, exact)
    assert {u.version for u in second.new_units} == {5}
    replay(second)
    replay(first)


def _renamed(plan: GlobalPlan, version: int, perm: list[int]) -> GlobalPlan:
    return GlobalPlan(version=version, stages=tuple(
        stage_plan(sp.model_stage, sp.layout, [perm[g] for s in sp.gpu_sets for g in s], sp.dp) for sp in plan))


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1))
def test_plans_of_a_seen_shape_reuse_its_classes_on_their_own_gpus(seed: int) -> None:
    """Candidates whose stage plans have the shape of a pair seen before (the same plans as new objects,
    or every GPU renamed) take the class-level plan from the shape cache, mapped onto their GPUs: the
    result is still exactly the exact path's, and its schedule the unit-level one on the new GPUs."""
    states, cluster, old, new = symmetric_case(seed)
    cache = PlanningCache()  # this case's own: one filled by earlier cases could be emptied midway
    first = build_transition(states, cluster, old, new, capacity_bytes=1 << 50, exact=False, cache=cache)
    if first.replicas is None:
        return
    transition_cost(first, cluster)  # fills the class durations memo the same-GPU candidate shares
    shapes = len(cache.shape_stages)
    perm = list(range(cluster.num_gpus))
    random.Random(seed).shuffle(perm)
    for cur, cand in ((old, _renamed(new, 3, list(range(cluster.num_gpus)))),
                      (_renamed(old, 1, perm), _renamed(new, 2, perm))):
        dag = build_transition(states, cluster, cur, cand, capacity_bytes=1 << 50, exact=False, cache=cache)
        assert dag.replicas is not None
        assert len(cache.shape_stages) == shapes  # served from the shape cache
        exact = build_transition(states, cluster, cur, cand, capacity_bytes=1 << 50, exact=True, cache=cache)
        _check_order_and_cost(dag, cluster)
        _same_as_exact(dag, exact)
        report = replay(dag)
        assert report.bytes_remote == dag.bytes_moved
