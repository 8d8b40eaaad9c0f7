"""Where the replica-class path now decides instead of falling back to the per-unit path: a class that
waits for a release or a pass after the stage pass (tight capacity), and a node loss (each stage moving
from its survivors). Checked against the per-unit path (``exact=True``) as the oracle: the same
primitives, units and bytes; an order that is valid (transitions.replay: every element, and memory
under capacity at every point) with resource edges from a release to a member that needed it; and a
makespan (transitions.cost) never above the per-unit path's on the fixed cases below, nor a peak above
capacity. (Over 1,200 + 900 random tight cases, bench-style in the branch's report: 109 newly decided,
none slower, 6 faster; over the daemon's 1,024-GPU loss DAGs above 64 nodes: the same or 2-3x faster.)
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest

from planner.errors import InfeasibleError, SpecError
from planner.hardware import CPU, LOOPBACK, NVLINK4, ClusterSpec
from planner.models import ModelSpec
from planner.plan import GlobalPlan, Layout
from transitions.cost import transition_cost
from transitions.feasibility import TIMED_NODE_LIMIT, replay_order
from transitions.global_dag import TransitionDAG, build_transition
from transitions.planning_cache import PlanningCache
from transitions.replay import replay
from transitions.replica_classes import plan_replicas
from transitions.scenarios import ACTOR_GEN, ACTOR_TRAIN, PPO_STAGES, random_model, stage_plan, stage_states

sys.path.insert(0, str(Path(__file__).parent))
from test_replica_classes import _check_order_and_cost, _plan, _same_as_exact, symmetric_case  # noqa: E402

ROOMY = 1 << 50


def _valid(dag: TransitionDAG, capacity: int) -> None:
    """The expanded order replays exactly (peaks as recorded, under capacity), follows every data edge,
    and each resource edge runs a release before a member that allocates on a GPU it freed."""
    fps = list(dag.footprints)
    again = replay_order(fps, list(dag.order), dag.initial_bytes, capacity)
    assert again.peak_bytes == dag.peak_bytes and max(again.peak_bytes.values(), default=0) <= capacity
    pos = {i: k for k, i in enumerate(dag.order)}
    for a, b in dag.resource_edges:
        assert pos[a] < pos[b]
        assert any(fps[a].free_bytes.get(g, 0) > fps[a].alloc_bytes.get(g, 0) for g in fps[b].alloc_bytes)
    _check_order_and_cost(dag, _cluster_of(dag))
    report = replay(dag)
    assert report.final_units == sorted(u.uid for u in dag.new_units)


_CLUSTERS: dict[int, ClusterSpec] = {}


def _cluster_of(dag: TransitionDAG) -> ClusterSpec:
    return _CLUSTERS[id(dag)]


def _build(states: dict, cluster: ClusterSpec, old: GlobalPlan, new: GlobalPlan, **kw: object) -> TransitionDAG:
    dag = build_transition(states, cluster, old, new, cache=PlanningCache(), **kw)  # type: ignore[arg-type]
    _CLUSTERS[id(dag)] = cluster
    return dag


def _as_good(fast: TransitionDAG, unit: TransitionDAG, cluster: ClusterSpec) -> None:
    assert transition_cost(fast, cluster).seconds <= transition_cost(unit, cluster).seconds * (1 + 1e-9)


# --- tight capacity: waits and later passes --------------------------------------------------------

def _tight(seed: int, share: float) -> tuple[dict, ClusterSpec, GlobalPlan, GlobalPlan, int]:
    states, cluster, old, new = symmetric_case(seed)
    roomy = build_transition(states, cluster, old, new, capacity_bytes=ROOMY, exact=True)
    top, held = max(roomy.peak_bytes.values()), max(roomy.initial_bytes.values())
    return states, cluster, old, new, int(held + share * (top - held))


@pytest.mark.parametrize(("seed", "share", "waits"), [(96, 0.6, 8), (129, 0.6, 8), (14, 0.95, 0), (160, 0.9, 0)])
def test_classes_that_wait_or_need_a_later_pass_are_ordered_over_classes(seed: int, share: float,
                                                                         waits: int) -> None:
    """Cases whose class order used to give up (the first pass without waiting blocked): 96 and 129
    wait (8 resource edges each), 14 needs the largest-demand pass, 160 the unlock pass."""
    states, cluster, old, new, capacity = _tight(seed, share)
    fast = _build(states, cluster, old, new, capacity_bytes=capacity, exact=False)
    assert fast.replicas is not None and len(fast.replicas.resource_edges) == waits
    unit = _build(states, cluster, old, new, capacity_bytes=capacity, exact=True)
    _same_as_exact(fast, unit)
    _valid(fast, capacity)
    _as_good(fast, unit, cluster)
    assert max(fast.peak_bytes.values()) == max(unit.peak_bytes.values())


def test_over_random_tight_cases_the_class_path_is_valid_and_never_slower() -> None:
    decided = 0
    for seed in range(60):
        for share in (0.6, 0.9):
            states, cluster, old, new, capacity = _tight(seed, share)
            try:
                fast = _build(states, cluster, old, new, capacity_bytes=capacity, exact=False)
            except InfeasibleError:
                continue
            if fast.replicas is None:
                continue
            decided += 1
            _valid(fast, capacity)
            _as_good(fast, _build(states, cluster, old, new, capacity_bytes=capacity, exact=True), cluster)
    assert decided >= 20, decided


# --- node loss -----------------------------------------------------------------------------------

def _loss_case(seed: int, nodes: tuple[int, int] = (3, 6)) -> tuple[dict, ClusterSpec, GlobalPlan, GlobalPlan,
                                                                       frozenset[int]] | None:
    """Random stages over a pool; one node (or a few GPUs) lost; the new plan on the GPUs left, with
    the old layouts (as after most losses) or new ones."""
    rng = random.Random(seed)
    model = random_model(rng)
    cluster = ClusterSpec(device=CPU, num_nodes=rng.randint(*nodes), gpus_per_node=4, intra_node_link=NVLINK4,
                          inter_node_link=LOOPBACK)
    pool = list(range(cluster.num_gpus))
    if rng.random() < 0.3:
        rng.shuffle(pool)
    stages = sorted(rng.sample(PPO_STAGES, rng.randint(1, 4)), key=PPO_STAGES.index)
    names = [ms.name for ms in stages]
    stride = rng.choice([1, 2, 3])
    groups = {name: sorted(pool[k % stride::stride]) if rng.random() < 0.5 else pool[k % stride::stride]
              for k, name in enumerate(names)}
    old = _plan(rng, 1, model, names, pool, groups)
    node = rng.randrange(cluster.num_nodes)
    lost = frozenset(range(node * 4, node * 4 + 4)) if rng.random() < 0.8 else frozenset(rng.sample(pool, 2))
    alive = {name: [g for g in gs if g not in lost] for name, gs in groups.items()}
    if rng.random() < 0.5:
        kept = []
        for sp in old:
            dp = len(alive[sp.model_stage]) // sp.layout.size
            if not dp:
                return None
            kept.append(stage_plan(sp.model_stage, sp.layout, alive[sp.model_stage], dp))
        new = GlobalPlan(version=2, stages=tuple(kept))
    elif all(alive.values()):
        new = _plan(rng, 2, model, names, [g for g in pool if g not in lost], alive)
    else:
        return None
    return stage_states(model, tuple(stages)), cluster, old, new, lost


def test_a_loss_over_classes_plans_exactly_what_the_per_unit_path_plans() -> None:
    """The same primitives (uids: the survivors keep theirs), old, lost and new units, renamings and
    bytes as the per-unit path, in a valid order, on random losses (exact=False: however small)."""
    taken = lost_some = 0
    for seed in range(80):
        case = _loss_case(seed)
        if case is None:
            continue
        states, cluster, old, new, lost = case
        try:
            unit = _build(states, cluster, old, new, lost_gpus=lost, capacity_bytes=ROOMY, exact=True)
        except InfeasibleError:
            with pytest.raises(InfeasibleError):
                _build(states, cluster, old, new, lost_gpus=lost, capacity_bytes=ROOMY, exact=False)
            continue
        fast = _build(states, cluster, old, new, lost_gpus=lost, capacity_bytes=ROOMY, exact=False)
        if fast.replicas is None:
            continue
        taken += 1
        _same_as_exact(fast, unit)
        assert fast.old_units == unit.old_units and fast.lost_units == unit.lost_units
        assert fast.to_dict()["lost_units"] == unit.to_dict()["lost_units"]
        _valid(fast, ROOMY)
        lost_some += bool(fast.lost_units)
    assert taken >= 50 and lost_some >= 40, (taken, lost_some)


TINY = ModelSpec(name="tiny8", num_layers=2, hidden_size=16, num_attention_heads=8, num_kv_heads=2, head_dim=2,
                 ffn_hidden_size=24, vocab_size=11)
WIDE = ClusterSpec(device=CPU, num_nodes=16, gpus_per_node=4, intra_node_link=NVLINK4, inter_node_link=LOOPBACK)


def _shifted(lost_node: int, tp: int, gen_tp: int = 4, old_tp: int | None = None
             ) -> tuple[dict, GlobalPlan, GlobalPlan, frozenset[int]]:
    """actor-gen (TP``gen_tp``) and actor-train (TP``old_tp``, then ``tp``) over 64 GPUs; a node
    lost, and the new plan packing the layouts onto the 60 GPUs left (every replica after the lost
    node shifts by 4: the daemon's replan after a loss)."""
    states = stage_states(TINY, (ACTOR_GEN, ACTOR_TRAIN))
    pool = list(range(WIDE.num_gpus))
    lost = frozenset(range(lost_node * 4, lost_node * 4 + 4))
    left = [g for g in pool if g not in lost]

    def plan(version: int, gpus: list[int], train: int) -> GlobalPlan:
        return GlobalPlan(version=version, stages=(
            stage_plan("actor-gen", Layout(gen_tp, 1), gpus, len(gpus) // gen_tp),
            stage_plan("actor-train", Layout(train, 1), gpus, len(gpus) // train)))

    return states, plan(1, pool, old_tp or tp), plan(2, left, tp), lost


def test_by_default_a_loss_goes_over_classes_only_above_the_timed_limit() -> None:
    """A loss whose DAG has more than TIMED_NODE_LIMIT nodes is planned over classes (here 89: TP8
    generation and a TP2 -> TP4 training change, shifted); one with fewer (the per-unit path times
    those: its duration-aware pass) unit by unit, unless exact=False."""
    states, old, new, lost = _shifted(0, 4, gen_tp=8, old_tp=2)
    big = _build(states, WIDE, old, new, lost_gpus=lost)
    assert big.replicas is not None and big.num_nodes > TIMED_NODE_LIMIT
    unit = _build(states, WIDE, old, new, lost_gpus=lost, exact=True)
    _same_as_exact(big, unit)
    assert big.lost_units == unit.lost_units and len(big.lost_units) == 3  # a TP8 replica, two TP2
    _valid(big, WIDE.device.memory_bytes)
    _as_good(big, unit, WIDE)
    states, old, new, lost = _shifted(0, 4, old_tp=8)
    small = _build(states, WIDE, old, new, lost_gpus=lost)
    assert small.replicas is None and 0 < small.num_nodes <= TIMED_NODE_LIMIT
    assert _build(states, WIDE, old, new, lost_gpus=lost, exact=False).replicas is not None


def test_the_timed_limit_is_inclusive(monkeypatch: pytest.MonkeyPatch) -> None:
    import transitions.replica_classes as rc

    states, old, new, lost = _shifted(0, 4, old_tp=8)
    nodes = _build(states, WIDE, old, new, lost_gpus=lost, exact=False).num_nodes
    monkeypatch.setattr(rc, "TIMED_NODE_LIMIT", nodes)
    assert _build(states, WIDE, old, new, lost_gpus=lost).replicas is None
    monkeypatch.setattr(rc, "TIMED_NODE_LIMIT", nodes - 1)
    assert _build(states, WIDE, old, new, lost_gpus=lost).replicas is not None


def test_a_shifted_chain_of_extends_runs_in_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """TP8 replicas shifted by a node each read two old replicas, so neighbours share GPUs: one class
    of 7 whose members would run one after another. After a loss its members are split into batches
    that share no GPU, which run side by side: the same DAG, faster than the chain. Without a loss
    the same shift is planned as before (unbatched)."""
    import transitions.replica_classes as rc

    states, old, new, lost = _shifted(0, 8, gen_tp=8)
    fast = _build(states, WIDE, old, new, lost_gpus=lost, exact=False)
    assert fast.replicas is not None and all(c.single for c in fast.replicas.classes)
    gen = [c.size for c in fast.replicas.classes if c.stage == "actor-gen" and c.kind.value == "extend"]
    assert len(gen) >= 2 and sum(gen) == 7
    unit = _build(states, WIDE, old, new, lost_gpus=lost, exact=True)
    _same_as_exact(fast, unit)
    _valid(fast, WIDE.device.memory_bytes)
    monkeypatch.setattr(rc, "batched", lambda mine: mine)
    chain = _build(states, WIDE, old, new, lost_gpus=lost, exact=False)
    assert chain.replicas is not None and not all(c.single for c in chain.replicas.classes)
    assert transition_cost(fast, WIDE).seconds < transition_cost(chain, WIDE).seconds
    monkeypatch.undo()
    shift = GlobalPlan(version=2, stages=new.stages)
    plain = _build(states, WIDE, GlobalPlan(version=1, stages=(stage_plan("actor-gen", Layout(8, 1), list(range(64)), 8),
                                                               old.stage("actor-train"))), shift, exact=False)
    assert plain.replicas is not None and not all(c.single for c in plain.replicas.classes)


def test_what_a_loss_leaves_to_the_per_unit_path() -> None:
    states, old, new, lost = _shifted(0, 4)
    cache = PlanningCache()
    assert plan_replicas(states, WIDE, old, new, ROOMY, lost_gpus=lost, cache=cache) is not None
    # a stage with every replica lost (the per-unit path rebuilds it from another stage, or says the last
    # copy is gone)
    everything = frozenset(range(WIDE.num_gpus))
    assert plan_replicas(states, WIDE, old, new, ROOMY, lost_gpus=everything, cache=cache) is None
    # the new plan on a lost GPU: the per-unit path names it
    on_lost = frozenset({1}) | {60}
    assert plan_replicas(states, WIDE, old, new, ROOMY, lost_gpus=on_lost, cache=cache) is None
    with pytest.raises(SpecError, match="lost GPUs"):
        build_transition(states, WIDE, old, new, lost_gpus=on_lost, exact=False)
    # a lost GPU outside the cluster is nobody's
    outside = plan_replicas(states, WIDE, old, new, ROOMY, lost_gpus=lost | {WIDE.num_gpus}, cache=cache)
    assert outside is not None and len(outside.lost_units) == 2
    # an old plan reaching outside the cluster: the per-unit path names the GPU
    far = GlobalPlan(version=1, stages=(old.stage("actor-gen"),
                                        stage_plan("actor-train", Layout(4, 1), [*range(63), 64], 16)))
    assert plan_replicas(states, WIDE, far, new, ROOMY, lost_gpus=lost, cache=cache) is None
    # a loss that touches no replica changes nothing: the survivors are the plan itself
    none_lost = plan_replicas(states, WIDE, old, new, ROOMY, lost_gpus=frozenset({WIDE.num_gpus + 1}), cache=cache)
    assert none_lost is not None and none_lost.lost_units == () and none_lost.survivors == [None, None]
    assert none_lost.stages[0].stage.current is old.stage("actor-gen")
    plain = plan_replicas(states, WIDE, old, new, ROOMY, cache=cache)  # no loss: no survivors to map
    assert plain is not None and plain.survivors == [] and plain.lost_units == ()


def test_survivors_keep_their_uids_and_the_lost_are_recorded() -> None:
    """Node 1 (GPUs 4-7) holds actor-train's replica 1 (TP4): the survivors are replicas 0, 2, ..., 15,
    whose units keep those numbers; the lost unit is replica 1's."""
    states, old, new, lost = _shifted(1, 4)
    plan = plan_replicas(states, WIDE, old, new, ROOMY, lost_gpus=lost, cache=PlanningCache())
    assert plan is not None
    train = plan.stages[1]
    kept = plan.survivors[1]
    assert kept is not None and kept.tolist() == [0, *range(2, 16)]
    assert train.stage.current.gpu_sets == tuple(s for i, s in enumerate(old.stage("actor-train").gpu_sets) if i != 1)
    assert [u.uid for u in plan.lost_units] == ["actor-gen@v1#1", "actor-train@v1#1"]
    assert all(u.gpus == tuple(range(4, 8)) and u.version == 1 for u in plan.lost_units)
    dag = TransitionDAG(old_version=1, new_version=2, capacity_bytes=ROOMY, replicas=plan)
    olds = {u.uid for u in dag.old_units}
    assert "actor-train@v1#1" not in olds and "actor-train@v1#15" in olds and len(olds) == 30
    assert np.array_equal(plan.initial[4:8], np.zeros(4))
