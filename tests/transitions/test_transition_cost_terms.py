"""transitions.cost worked out by hand on a toy cluster whose links and HBM have round figures: one
primitive's seconds (per-GPU send and receive sums, local copies, set-up, fixed costs), the schedule's
start and end times and what held each node back (data and resource edges, per-GPU order, ties), and
L_tran with its intra- and inter-node bytes and critical path."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import numpy as np
import pytest

from planner.hardware import CPU, H200, IB_NDR, LOOPBACK, NVLINK4, ClusterSpec, DeviceSpec, LinkSpec
from planner.models import TINY_3M
from planner.plan import GlobalPlan, Layout
from planner.workflow import ACTOR_GEN, ACTOR_TRAIN
from transitions.cost import (
    DEFAULT_FIXED_COSTS,
    FixedCosts,
    TransitionCost,
    _critical_path,
    primitive_seconds,
    schedule,
    transition_cost,
)
from transitions.global_dag import TransitionDAG, build_transition
from transitions.planning_cache import PlanningCache
from transitions.primitives import Footprint, PrimitiveKind
from transitions.replica_classes import ReplicaPlan
from transitions.scenarios import stage_plan, stage_states

# 2 nodes of 2 GPUs (0, 1 | 2, 3): intra-node 10 B/s + 1 s, inter-node 2 B/s + 3 s, HBM 100 B/s
TOY = ClusterSpec(device=DeviceSpec(name="toy", memory_bytes=1 << 30, peak_flops_bf16=1.0, hbm_bytes_per_s=100.0),
                  num_nodes=2, gpus_per_node=2, intra_node_link=LinkSpec(name="in", bytes_per_s=10.0, latency_s=1.0),
                  inter_node_link=LinkSpec(name="out", bytes_per_s=2.0, latency_s=3.0))
FIXED = FixedCosts(communicator_per_peer_s=0.25, allocation_bytes_per_s=2.0, generation_reform_s=7.0)


def _fp(*, alloc: dict[int, int] | None = None, local: dict[int, int] | None = None,
        pairs: dict[tuple[int, int], int] | None = None) -> Footprint:
    return Footprint(alloc_bytes=alloc or {}, free_bytes={}, buffer_bytes={}, local_bytes=local or {},
                     pair_bytes=pairs or {})


# (0,1) intra 20 B: 3 s; (0,2) inter 4 B: 5 s; (3,1) inter 6 B: 6 s; (2,1) inter 2 B: 4 s. Sends: GPU 0
# 8 s, 3 6 s, 2 4 s; receives: GPU 1 13 s, 2 5 s (+ 1 s copying 50 B locally, twice over HBM). Slowest:
# GPU 1, 13 s. GPU 1 talks to 3 peers (0, 3, 2), the most, as a receiver.
A = _fp(alloc={1: 28, 2: 4}, local={2: 50}, pairs={(0, 1): 20, (0, 2): 4, (3, 1): 6, (2, 1): 2})
# nothing moved between GPUs: 100 B copied on GPU 0, 2 s, and no set-up
B = _fp(alloc={0: 100}, local={0: 100})
# GPU 1 sends to 3 peers (the most, as a sender): (1,0) intra 10 B 2 s, (1,3) and (1,2) inter 2 B 4 s each
C = _fp(pairs={(1, 0): 10, (1, 3): 2, (1, 2): 2})


def test_one_primitive_is_its_slowest_gpu_plus_set_up() -> None:
    assert primitive_seconds(A, TOY, 0.5) == pytest.approx(13.5)
    assert primitive_seconds(A, TOY, 0.0) == pytest.approx(13.0)
    assert primitive_seconds(B, TOY, 0.5) == pytest.approx(2.0)
    assert primitive_seconds(C, TOY, 0.5) == pytest.approx(10.5)


def test_fixed_costs_count_peers_on_either_end_and_received_bytes() -> None:
    # A: GPU 1 receives 28 B at 2 B/s (14 s more: 27 s), GPU 2 4 B (2 s: 8 s); 3 peers x 0.25 s
    assert primitive_seconds(A, TOY, 0.5, FIXED) == pytest.approx(27.75)
    no_alloc = FixedCosts(communicator_per_peer_s=0.25, allocation_bytes_per_s=None)
    assert primitive_seconds(A, TOY, 0.5, no_alloc) == pytest.approx(13.75)
    # C: GPU 0 receives 10 B (5 s: 7 s), GPUs 2 and 3 2 B each (1 s: 5 s); the sender's 10 s stays slowest
    assert primitive_seconds(C, TOY, 0.5, FIXED) == pytest.approx(10.75)
    assert primitive_seconds(B, TOY, 0.5, FIXED) == pytest.approx(2.0)  # no pair: no communicator, no receive


@pytest.mark.parametrize("bad", [dict(communicator_per_peer_s=-0.1), dict(generation_reform_s=-1.0)])
def test_fixed_costs_refuse_negative_seconds(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=r"^fixed costs must be >= 0 seconds$"):
        FixedCosts(**bad)


@pytest.mark.parametrize("speed", [0.0, -5.0])
def test_fixed_costs_refuse_no_allocation_speed(speed: float) -> None:
    with pytest.raises(ValueError, match=rf"^allocation_bytes_per_s must be > 0, got {speed}$"):
        FixedCosts(allocation_bytes_per_s=speed)


def test_fixed_costs_accept_zero_seconds_and_any_positive_speed() -> None:
    assert FixedCosts(communicator_per_peer_s=0.0, generation_reform_s=0.0).allocation_bytes_per_s is None
    assert FixedCosts(allocation_bytes_per_s=0.5).allocation_bytes_per_s == 0.5


@dataclass
class _Dag:
    """What the unit-level schedule reads of a TransitionDAG."""

    footprints: tuple[Footprint, ...]
    order: tuple[int, ...]
    data_edges: tuple[tuple[int, int], ...] = ()
    resource_edges: tuple[tuple[int, int], ...] = ()
    replicas: None = None
    nodes: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.nodes = tuple(range(len(self.footprints)))


def _dag(fps: list[Footprint], order: tuple[int, ...], data: tuple[tuple[int, int], ...] = (),
         resource: tuple[tuple[int, int], ...] = ()) -> TransitionDAG:
    return cast(TransitionDAG, _Dag(tuple(fps), order, data, resource))


def _on(*gpus: int) -> Footprint:
    return _fp(alloc={g: 1 for g in gpus})


def test_schedule_follows_edges_and_each_gpus_order() -> None:
    fps = [_on(0), _on(1), _on(0, 1), _on(2), _on(2, 3), _on(4)]
    dag = _dag(fps, order=(1, 0, 3, 2, 4, 5), data=((1, 4),), resource=((2, 5),))
    start, end, held = schedule(dag, [3.0, 2.0, 4.0, 2.0, 6.0, 2.0])
    # 2 waits for GPU 0 (node 0 ends at 3) more than GPU 1 (node 1 at 2); 4's data predecessor 1 and
    # GPU 2's last node 3 both end at 2: the predecessor is named; 5 shares no GPU but its resource edge
    assert start == [0.0, 0.0, 3.0, 0.0, 2.0, 7.0]
    assert end == [3.0, 2.0, 7.0, 2.0, 8.0, 9.0]
    assert held == [-1, -1, 0, -1, 1, 2]


def test_schedule_names_the_first_of_equal_predecessors_and_gpus() -> None:
    # node 2 reads 0 and 1, both ending at 2; node 3 runs on GPU 0 then 1's... GPUs 0 and 1 free at 2
    fps = [_on(0), _on(1), _on(2), _on(0, 1)]
    start, end, held = schedule(_dag(fps, order=(0, 1, 2, 3), data=((0, 2), (1, 2))), [2.0, 2.0, 1.0, 1.0])
    assert (start[2], held[2]) == (2.0, 0)
    assert start[3] == 2.0 and held[3] in (0, 1)
    start, end, held = schedule(_dag(fps, order=(1, 0, 2, 3), data=((1, 2), (0, 2))), [2.0, 2.0, 1.0, 1.0])
    assert (start[2], held[2]) == (2.0, 1)


def test_a_node_waits_for_its_gpu_even_after_its_data() -> None:
    # 1 reads 0 (ends at 1) but GPU 5 is busy with 2 until 4: 1 is held back by 2, not by 0
    fps = [_on(0), _on(0, 5), _on(5)]
    start, end, held = schedule(_dag(fps, order=(0, 2, 1), data=((0, 1),)), [1.0, 1.0, 4.0])
    assert (start, end, held) == ([0.0, 4.0, 0.0], [1.0, 5.0, 4.0], [-1, 2, -1])


def test_transition_cost_sums_bytes_by_link_and_walks_the_critical_path() -> None:
    # A [0, 13.5]; B on GPU 0 after A [13.5, 15.5]; C on GPUs 0..3 after B (GPU 0's last) [15.5, 26]
    cost = transition_cost(_dag([A, B, C], order=(0, 1, 2)), TOY, communicator_setup_s=0.5)
    assert cost.seconds == pytest.approx(26.0)
    assert (cost.intra_node_bytes, cost.inter_node_bytes, cost.bytes_moved) == (30, 16, 46)
    assert cost.critical_path == (0, 1, 2)
    assert cost.start_s == pytest.approx((0.0, 13.5, 15.5))
    assert cost.end_s == pytest.approx((13.5, 15.5, 26.0))
    assert cost.to_dict() == {"seconds": cost.seconds, "bytes_moved": 46, "intra_node_bytes": 30,
                              "inter_node_bytes": 16, "critical_path": [0, 1, 2]}
    # with fixed costs: 27.75 + 2 + 10.75, and the generation re-formed once at the end
    fixed = transition_cost(_dag([A, B, C], order=(0, 1, 2)), TOY, communicator_setup_s=0.5, fixed=FIXED)
    assert fixed.seconds == pytest.approx(40.5 + 7.0)
    assert fixed.end_s[-1] == pytest.approx(40.5)


def test_critical_path_ends_at_the_first_of_equally_late_nodes() -> None:
    cost = transition_cost(_dag([B, _fp(local={1: 100}), _on(2)], order=(0, 1, 2)), TOY)
    assert cost.end_s == (2.0, 2.0, 0.0)
    assert cost.critical_path == (0,) and cost.seconds == 2.0
    cost = transition_cost(_dag([_on(2), _fp(local={1: 100}), B], order=(2, 1, 0)), TOY)
    assert cost.critical_path == (1,)


def test_an_empty_transition_costs_nothing_even_with_fixed_costs() -> None:
    cost = transition_cost(_dag([], order=()), TOY, fixed=FIXED)
    assert (cost.seconds, cost.bytes_moved, cost.critical_path, cost.start_s) == (0.0, 0, (), ())


# --- replica classes: the class-level schedule against the unit-level one of the same order -------

def _grow() -> tuple[TransitionDAG, ClusterSpec]:
    """actor-train 2 x TP2 on GPUs 0-3 -> 8 x TP1 on 0-7, actor-gen 4 x TP1 on 4-7 -> 4 x TP2 on 0-7: its
    classes include members sharing GPUs, a class touching no GPU, copies only local, intra- and
    inter-node pairs."""
    cluster = ClusterSpec(device=CPU, num_nodes=2, gpus_per_node=4, intra_node_link=NVLINK4, inter_node_link=LOOPBACK)
    states = stage_states(TINY_3M, (ACTOR_GEN, ACTOR_TRAIN))
    old = GlobalPlan(version=1, stages=(stage_plan("actor-train", Layout(2, 1), [0, 1, 2, 3], 2),
                                        stage_plan("actor-gen", Layout(1, 1), [4, 5, 6, 7], 4)))
    new = GlobalPlan(version=2, stages=(stage_plan("actor-train", Layout(1, 1), list(range(8)), 8),
                                        stage_plan("actor-gen", Layout(2, 1), list(range(8)), 4)))
    dag = build_transition(states, cluster, old, new, exact=False, capacity_bytes=1 << 50, cache=PlanningCache())
    assert dag.replicas is not None
    assert any(not c.single for c in dag.replicas.classes) and any(not len(c.touched) for c in dag.replicas.classes)
    return dag, cluster


def _same(fast: TransitionCost, unit: TransitionCost) -> None:
    assert fast.seconds == pytest.approx(unit.seconds, rel=1e-12)
    assert fast.start_s == pytest.approx(unit.start_s, rel=1e-12, abs=1e-15)
    assert fast.end_s == pytest.approx(unit.end_s, rel=1e-12, abs=1e-15)
    assert (fast.bytes_moved, fast.intra_node_bytes, fast.inter_node_bytes) == \
        (unit.bytes_moved, unit.intra_node_bytes, unit.inter_node_bytes)
    assert fast.critical_path == unit.critical_path


SLOW_ALLOC = FixedCosts(communicator_per_peer_s=0.003, allocation_bytes_per_s=1e9, generation_reform_s=2.0)


@pytest.mark.parametrize("fixed", [None, DEFAULT_FIXED_COSTS, SLOW_ALLOC,
                                   FixedCosts(communicator_per_peer_s=0.01, allocation_bytes_per_s=None)])
def test_replica_schedule_equals_the_unit_schedule_of_its_order(fixed: FixedCosts | None) -> None:
    dag, cluster = _grow()
    unit_dag = dag.with_order(dag.order)  # no replica plan: the unit-level schedule
    for setup in (0.02, 0.5, 0.0, 0.02):  # the class memo must follow the set-up
        _same(transition_cost(dag, cluster, setup, fixed), transition_cost(unit_dag, cluster, setup, fixed))
    cost = transition_cost(dag, cluster, 0.02, fixed)
    assert 0 < cost.intra_node_bytes < cost.bytes_moved and cost.inter_node_bytes > 0
    assert len(cost.critical_path) > 2


def test_replica_durations_follow_the_cluster_they_are_asked_for() -> None:
    dag, cluster = _grow()
    unit_dag = dag.with_order(dag.order)
    other = ClusterSpec(device=H200, num_nodes=8, gpus_per_node=1, intra_node_link=NVLINK4, inter_node_link=IB_NDR)
    for c in (cluster, other, cluster, other):
        _same(transition_cost(dag, c), transition_cost(unit_dag, c))
    one_per_node = transition_cost(dag, other)  # one GPU a node: every byte crosses nodes
    assert one_per_node.intra_node_bytes == 0 and one_per_node.inter_node_bytes == one_per_node.bytes_moved > 0


def test_class_durations_memo_keeps_the_opt_in_fixed_costs_apart() -> None:
    """Durations memoised without fixed costs are not served to a call with them, nor the other way."""
    dag, cluster = _grow()
    unit_dag = dag.with_order(dag.order)
    for fixed in (None, SLOW_ALLOC, None, DEFAULT_FIXED_COSTS, None):
        _same(transition_cost(dag, cluster, 0.02, fixed), transition_cost(unit_dag, cluster, 0.02, fixed))


def _shrink_tp() -> tuple[TransitionDAG, ClusterSpec]:
    """actor-train 4 x TP2 -> 8 x TP1 on 3 nodes of 3 GPUs: each Split's pair crosses nodes or not
    depending on where its member sits, so members of one class end at different times, and so do the
    Destroys after them (one predecessor each)."""
    cluster = ClusterSpec(device=CPU, num_nodes=3, gpus_per_node=3, intra_node_link=NVLINK4, inter_node_link=LOOPBACK)
    states = stage_states(TINY_3M, (ACTOR_TRAIN,))
    old = GlobalPlan(version=1, stages=(stage_plan("actor-train", Layout(2, 1), list(range(8)), 4),))
    new = GlobalPlan(version=2, stages=(stage_plan("actor-train", Layout(1, 1), list(range(8)), 8),))
    dag = build_transition(states, cluster, old, new, exact=False, capacity_bytes=1 << 50, cache=PlanningCache())
    assert dag.replicas is not None
    return dag, cluster


@pytest.mark.parametrize("fixed", [None, SLOW_ALLOC])
def test_members_of_a_class_start_when_their_own_predecessors_and_gpus_allow(fixed: FixedCosts | None) -> None:
    dag, cluster = _shrink_tp()
    fast = transition_cost(dag, cluster, fixed=fixed)
    _same(fast, transition_cost(dag.with_order(dag.order), cluster, fixed=fixed))
    destroys = [i for i, p in enumerate(dag.nodes) if p.kind is PrimitiveKind.DESTROY]
    assert len({fast.start_s[i] for i in destroys}) > 1


def test_an_empty_class_plan_costs_nothing() -> None:
    states = stage_states(TINY_3M, (ACTOR_TRAIN,))
    same = stage_plan("actor-train", Layout(2, 1), [0, 1, 2, 3], 2)
    cluster = _grow()[1]
    for old, new in ((GlobalPlan(version=1, stages=(same,)), GlobalPlan(version=2, stages=(same,))),
                     (GlobalPlan(version=1, stages=()), GlobalPlan(version=2, stages=()))):
        dag = build_transition(states, cluster, old, new, exact=False, cache=PlanningCache())
        assert dag.replicas is not None
        cost = transition_cost(dag, cluster, fixed=DEFAULT_FIXED_COSTS)  # nothing to re-form either
        assert (cost.seconds, cost.bytes_moved, cost.critical_path, cost.start_s, cost.end_s) == (0.0, 0, (), (), ())


@dataclass
class _Class:
    preds: np.ndarray  # per member, stage-local predecessor ids


@dataclass
class _Plan:
    """What the critical-path walk reads of a ReplicaPlan: one stage, one node a class."""

    classes: list[_Class]
    first: list[int] = field(default_factory=list)
    class_stage: list[int] = field(default_factory=list)
    stage_base: list[int] = field(default_factory=lambda: [0])

    def __post_init__(self) -> None:
        self.first = list(range(len(self.classes)))
        self.class_stage = [0] * len(self.classes)


NONE = np.zeros((1, 0))


def _walk(preds: list[list[int]], start: list[float], end: list[float],
          seen: list[tuple[list[list[float]], list[list[float]], list[list[int]]]]) -> list[int]:
    plan = _Plan([_Class(np.array(p, dtype=np.int64).reshape(1, -1)) for p in preds])
    # replica_schedule keeps them (predecessors or GPUs) x members: one member each here
    arrays = {k: tuple(np.array(a, dtype=np.float64 if j < 2 else np.int64).reshape(-1, 1) for j, a in enumerate(s))
              for k, s in enumerate(seen)}
    return _critical_path(cast(ReplicaPlan, plan), np.array(start), np.array(end), arrays)  # type: ignore[arg-type]


def test_critical_path_walks_back_through_node_zero() -> None:
    # node 0 [0, 3] -> node 1 [3, 5] (its data predecessor) -> node 2 [5, 9] (waited on GPU 1's node 1)
    path = _walk(preds=[[], [0], []], start=[0.0, 3.0, 5.0], end=[3.0, 5.0, 9.0],
                 seen=[([], [0.0], [-1]), ([3.0], [0.0], [-1]), ([], [5.0, 1.0], [1, 0])])
    assert path == [0, 1, 2]


def test_nothing_held_back_a_node_starting_at_zero() -> None:
    # node 1 starts at 0 after a predecessor (node 0) that took no time, on a GPU node 0 used: at 0
    # nothing held it back (as the unit-level schedule says: nothing ended after 0)
    assert _walk(preds=[[], [0]], start=[0.0, 0.0], end=[0.0, 5.0],
                 seen=[([], [0.0], [-1]), ([0.0], [0.0], [0])]) == [1]
    assert _walk(preds=[[], []], start=[0.0, 0.0], end=[0.0, 5.0],
                 seen=[([], [0.0], [-1]), ([], [0.0], [0])]) == [1]
