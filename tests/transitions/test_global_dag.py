"""build_transition (transitions.global_dag) on hand-checked changes: the checks of its inputs, the fallback
sources of a rebuilt stage, and what it counts and orders."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.errors import SpecError
from planner.hardware import CPU, LOOPBACK, NVLINK4, ClusterSpec
from planner.models import ModelSpec
from planner.plan import GlobalPlan, Layout
from planner.workflow import ACTOR_GEN, ACTOR_TRAIN, CRITIC_TRAIN, REF_INF
from transitions.cost import DEFAULT_COMMUNICATOR_SETUP_S, primitive_seconds
from transitions.emu import UnitState
from transitions.exact_order import makespan
from transitions.feasibility import MemoryOrder
from transitions.global_dag import _durations, _fastest, build_transition, build_weight_sync, primitive_count
from transitions.local_dag import LastCopyLostError
from transitions.primitives import Destroy, Extend, Footprint
from transitions.replay import replay
from transitions.scenarios import stage_plan, stage_states

TINY = ModelSpec(name="tiny", num_layers=2, hidden_size=8, num_attention_heads=4, num_kv_heads=2, head_dim=2,
                 ffn_hidden_size=24, vocab_size=11)
STATES = stage_states(TINY, (ACTOR_GEN, REF_INF, ACTOR_TRAIN, CRITIC_TRAIN))
CLUSTER = ClusterSpec(device=CPU, num_nodes=1, gpus_per_node=4, intra_node_link=NVLINK4, inter_node_link=LOOPBACK)


def _plan(version: int, *stages: tuple[str, int, list[int], int]) -> GlobalPlan:
    return GlobalPlan(version=version, stages=tuple(stage_plan(n, Layout(tp, 1), g, dp) for n, tp, g, dp in stages))


def test_the_inputs_are_checked_field_by_field() -> None:
    old = _plan(1, ("actor-train", 2, [0, 1], 1))
    with pytest.raises(SpecError) as err:
        build_transition(STATES, CLUSTER, old, _plan(1, ("actor-train", 2, [2, 3], 1)))
    assert err.value.field == "new.version" and str(err.value) == "new.version: 1 must exceed the old plan's 1"
    with pytest.raises(SpecError) as err:
        build_transition({}, CLUSTER, None, _plan(0, ("actor-train", 2, [2, 3], 1)))
    assert err.value.field == "plan.model_stage" and "'actor-train' has no state description" in str(err.value)
    for gpus in ([3, 4], [-1, 0]):
        with pytest.raises(SpecError) as err:
            build_transition(STATES, CLUSTER, old, _plan(2, ("actor-train", 2, gpus, 1)))
        bad = gpus[0] if gpus[0] < 0 else gpus[1]
        assert str(err.value) == f"actor-train.gpu_sets: GPU {bad} outside the cluster (allowed: 0..3)"
    with pytest.raises(SpecError, match=r"^actor-train.gpu_sets: GPU 7 outside the cluster"):
        build_transition(STATES, CLUSTER, _plan(1, ("actor-train", 2, [3, 7], 1)), _plan(2, ("actor-train", 2, [0, 1], 1)))
    with pytest.raises(SpecError) as err:
        build_transition(STATES, CLUSTER, old, _plan(2, ("actor-train", 2, [1, 2], 1)), lost_gpus=frozenset({0, 1, 3}))
    assert str(err.value) == ("new.gpu_sets: the new plan places units on lost GPUs [1] "
                              "(allowed: GPUs outside lost_gpus)")


def test_without_an_old_plan_the_version_starts_at_minus_one_and_capacity_is_the_device_memory() -> None:
    with pytest.raises(SpecError, match=r"^new.version: -1 must exceed the old plan's -1$"):
        build_transition(STATES, CLUSTER, None, _plan(-1, ("actor-train", 2, [2, 3], 1)))
    # version 0 passes that check; with nothing to build the training state from, the last copy is lost
    with pytest.raises(LastCopyLostError):
        build_transition(STATES, CLUSTER, None, _plan(0, ("actor-train", 2, [2, 3], 1)))
    for exact in (True, None):
        dag = build_transition(STATES, CLUSTER, _plan(1, ("actor-train", 2, [0, 1], 1)),
                               _plan(2, ("actor-train", 2, [2, 3], 1)), exact=exact)
        assert dag.capacity_bytes == CPU.memory_bytes and (dag.old_version, dag.new_version) == (1, 2)


def test_primitive_count_is_the_unit_level_dag_size() -> None:
    cases = [(_plan(1, ("actor-train", 2, [0, 1], 1)), _plan(2, ("actor-train", 2, [2, 3], 1)), frozenset()),
             (_plan(1, ("actor-train", 1, [0, 1], 2)), _plan(2, ("actor-train", 2, [0, 1], 1)), frozenset()),
             (_plan(1, ("actor-train", 1, [0, 1], 2)), _plan(2, ("actor-train", 1, [0, 2], 2)), frozenset({1}))]
    for old, new, lost in cases:
        dag = build_transition(STATES, CLUSTER, old, new, lost_gpus=lost, exact=True)
        assert primitive_count(STATES, old, new, lost) == len(dag.nodes) > 0
        replay(dag)
    # without an old plan nothing holds the training state: the same error as building it
    with pytest.raises(LastCopyLostError):
        primitive_count(STATES, None, _plan(0, ("actor-train", 2, [2, 3], 1)))


def test_a_lost_generation_replica_is_rebuilt_from_a_training_stage_of_its_role() -> None:
    """actor-gen loses its only replica: it is rebuilt from actor-train (same role and model, all its
    state), never from critic-train or ref-inf (other roles) that also hold the model's parameters."""
    old = _plan(1, ("actor-gen", 1, [0], 1), ("ref-inf", 1, [1], 1), ("critic-train", 1, [2], 1),
                ("actor-train", 1, [3], 1))
    new = _plan(2, ("actor-gen", 1, [1], 1), ("ref-inf", 1, [1], 1), ("critic-train", 1, [2], 1),
                ("actor-train", 1, [3], 1))
    dag = build_transition(STATES, CLUSTER, old, new, lost_gpus=frozenset({0}), exact=True)
    (ext,) = [p for p in dag.nodes if isinstance(p, Extend)]
    assert ext.target.uid == "actor-gen@v2#0" and [u.uid for u in ext.sources] == ["actor-train@v1#0"]
    assert [u.uid for u in dag.lost_units] == ["actor-gen@v1#0"]
    replay(dag)
    # with actor-train gone too, nothing of the actor role is left: the error names actor-gen
    gone = _plan(2, ("actor-gen", 1, [1], 1), ("ref-inf", 1, [1], 1), ("critic-train", 1, [2], 1))
    with pytest.raises(LastCopyLostError) as err:
        build_transition(STATES, CLUSTER, old, gone, lost_gpus=frozenset({0, 3}), exact=True)
    assert err.value.model_stages == ("actor-gen",) and err.value.lost_gpus == (0, 3)


def test_a_weight_sync_refreshes_generation_from_training_at_the_next_version() -> None:
    plan = _plan(3, ("actor-gen", 1, [0, 1], 2), ("actor-train", 2, [2, 3], 1))
    dag = build_weight_sync(STATES, CLUSTER, plan, capacity_bytes=1 << 30)
    assert dag.old_version == 3 and dag.new_version == 4 and dag.capacity_bytes == 1 << 30
    assert sorted(dag.stale_units) == ["actor-gen@v3#0", "actor-gen@v3#1"]
    extends = [p for p in dag.nodes if isinstance(p, Extend)]
    assert sorted(p.target.uid for p in extends) == ["actor-gen@v4#0", "actor-gen@v4#1"]
    assert all(u.model_stage == "actor-train" for p in extends for u in p.sources)
    assert sorted(p.unit.uid for p in dag.nodes if isinstance(p, Destroy)) == ["actor-gen@v3#0", "actor-gen@v3#1"]
    assert dag.renamed == (("actor-train@v3#0", "actor-train@v4#0"),)
    replay(dag)


def test_plain_changes_may_take_the_replica_class_path_and_nothing_else_does() -> None:
    old = _plan(1, ("actor-gen", 1, [0, 1], 2), ("actor-train", 2, [2, 3], 1))
    new = _plan(2, ("actor-gen", 1, [0, 1], 2), ("actor-train", 2, [0, 1], 1))
    fast = build_transition(STATES, CLUSTER, old, new, exact=False)
    assert fast.replicas is not None and not fast.expanded
    assert (fast.old_version, fast.new_version, fast.capacity_bytes) == (1, 2, CPU.memory_bytes)
    # by default a change this small (fewer units than replica_classes.MIN_UNITS) is planned unit by unit
    assert build_transition(STATES, CLUSTER, old, new).replicas is None
    after_loss = _plan(2, ("actor-gen", 1, [0, 2], 2), ("actor-train", 2, [2, 3], 1))
    unit_level = {
        "exact": build_transition(STATES, CLUSTER, old, new, exact=True),
        "lost GPUs": build_transition(STATES, CLUSTER, old, after_loss, lost_gpus=frozenset({1})),
        "refresh": build_transition(STATES, CLUSTER, old, new, refresh={"actor-gen": "actor-train"}, exact=False),
        "per_stage": build_transition(STATES, CLUSTER, old, new, policy="per_stage", exact=False),
    }
    for why, dag in unit_level.items():
        assert dag.replicas is None, why
        replay(dag)
    # each node carries its model-stage's order (generation 0, training 2): actor-gen stays, actor-train moves
    exact = unit_level["exact"]
    assert exact.stage_order == (2,) * len(exact.nodes) and len(exact.nodes) > 1
    assert set(unit_level["refresh"].stage_order) == {0, 2}
    assert [u.uid for u in unit_level["lost GPUs"].lost_units] == ["actor-gen@v1#1"]
    # a loss moves from the survivors over replica classes too (by default only above TIMED_NODE_LIMIT nodes)
    lost = build_transition(STATES, CLUSTER, old, after_loss, lost_gpus=frozenset({1}), exact=False)
    assert lost.replicas is not None and [u.uid for u in lost.lost_units] == ["actor-gen@v1#1"]
    replay(lost)


def test_the_greedy_order_is_replaced_only_by_a_strictly_faster_one() -> None:
    """A (GPUs 0, 2) and C (1, 3) send 1 MiB each, B (0, 1) a few bytes. In the greedy order A, B, C, B
    waits for A and C for B; A, C, B (or B, A, C) runs A and C side by side, B before or after."""
    def sends(src: int, dst: int, nbytes: int) -> Footprint:
        return Footprint(alloc_bytes={}, free_bytes={}, buffer_bytes={}, local_bytes={}, pair_bytes={(src, dst): nbytes})
    fps = [sends(0, 2, 1 << 20), sends(0, 1, 16), sends(1, 3, 1 << 20)]
    durations = [primitive_seconds(fp, CLUSTER, DEFAULT_COMMUNICATOR_SETUP_S) for fp in fps]
    greedy = MemoryOrder(order=(0, 1, 2), resource_edges=(), peak_bytes={})
    got = _fastest(fps, [], {}, 1 << 30, durations, greedy)
    assert got.order.index(1) in (0, 2) and sorted(got.order) == [0, 1, 2]
    assert makespan(fps, [], got.order, durations) < makespan(fps, [], greedy.order, durations)
    assert got.peak_bytes == {} and got.resource_edges == ()
    # an order that is already the fastest is kept as it is
    best = MemoryOrder(order=got.order, resource_edges=(), peak_bytes={})
    assert _fastest(fps, [], {}, 1 << 30, durations, best) is best
    # the replacement is replayed on memory: with GPU 0 full, B's byte waits on R's release (node 3)
    release = Footprint(alloc_bytes={}, free_bytes={0: 1}, buffer_bytes={}, local_bytes={0: 1}, pair_bytes={})
    small = Footprint(alloc_bytes={0: 1}, free_bytes={}, buffer_bytes={}, local_bytes={}, pair_bytes={(0, 1): 16})
    fps = [fps[0], small, fps[2], release]
    greedy = MemoryOrder(order=(3, 0, 1, 2), resource_edges=((3, 1),), peak_bytes={0: 10})
    got = _fastest(fps, [(3, 1)], {0: 10}, 10, _durations(fps, CLUSTER), greedy)
    assert got.order != greedy.order and got.order.index(3) < got.order.index(1)
    assert got.resource_edges == ((3, 1),) and got.peak_bytes[0] == 10


def _with_second_actor_train(model: ModelSpec) -> dict[str, UnitState]:
    """The PPO stages plus "actor-train-2": another actor training stage, of ``model``."""
    train = STATES["actor-train"]
    return {**STATES, "actor-train-2": replace(train, model_stage="actor-train-2", model=model)}


def test_a_fallback_source_holds_the_same_model_and_head_and_refresh_names_its_source() -> None:
    """actor-gen loses its replica on GPU 0 and is rebuilt on GPU 2. actor-train (GPU 3) holds its
    state; "actor-train-2" (GPU 2, right where the new replica goes) is an actor training stage too
    but of another model: never a source. Of the same model, it would be the nearer source; a
    refresh naming actor-train still reads actor-train only."""
    other = replace(TINY, name="tiny-b")
    old = _plan(1, ("actor-gen", 1, [0], 1), ("actor-train-2", 1, [2], 1), ("actor-train", 1, [3], 1))
    new = _plan(2, ("actor-gen", 1, [2], 1), ("actor-train-2", 1, [2], 1), ("actor-train", 1, [3], 1))

    def gen_sources(states: dict[str, UnitState], **kw: object) -> list[str]:
        dag = build_transition(states, CLUSTER, old, new, exact=True, **kw)  # type: ignore[arg-type]
        replay(dag)
        return sorted({u.model_stage for p in dag.nodes if isinstance(p, Extend) and p.target.model_stage
                       == "actor-gen" for u in p.sources})
    assert gen_sources(_with_second_actor_train(other), lost_gpus=frozenset({0})) == ["actor-train"]
    same = _with_second_actor_train(TINY)
    assert gen_sources(same, lost_gpus=frozenset({0})) == ["actor-train-2"]
    assert gen_sources(same, refresh={"actor-gen": "actor-train"}) == ["actor-train"]
    # rebuilt on GPU 1, which neither holds: the first candidate stage in order, actor-train, is read
    elsewhere = _plan(2, ("actor-gen", 1, [1], 1), ("actor-train-2", 1, [2], 1), ("actor-train", 1, [3], 1))
    dag = build_transition(same, CLUSTER, old, elsewhere, lost_gpus=frozenset({0}), exact=True)
    assert [u.model_stage for p in dag.nodes if isinstance(p, Extend) for u in p.sources] == ["actor-train"]
    # actor-train itself, lost, is rebuilt from actor-train-2: the same state kinds are enough
    moved = _plan(2, ("actor-gen", 1, [0], 1), ("actor-train-2", 1, [2], 1), ("actor-train", 1, [1], 1))
    dag = build_transition(same, CLUSTER, old, moved, lost_gpus=frozenset({3}), exact=True)
    assert [u.uid for p in dag.nodes if isinstance(p, Extend) for u in p.sources] == ["actor-train-2@v1#0"]
    replay(dag)


def test_an_undescribed_stage_is_named_with_the_stages_that_are() -> None:
    states = {name: STATES[name] for name in ("actor-gen", "ref-inf")}
    with pytest.raises(SpecError) as err:
        build_transition(states, CLUSTER, None, _plan(0, ("actor-train", 2, [2, 3], 1)))
    assert str(err.value) == "plan.model_stage: 'actor-train' has no state description (allowed: actor-gen, ref-inf)"


def test_every_stage_that_lost_its_last_copy_is_named() -> None:
    old = _plan(1, ("ref-inf", 1, [0], 1), ("actor-train", 1, [1], 1), ("actor-gen", 1, [2], 1))
    new = _plan(2, ("ref-inf", 1, [3], 1), ("actor-train", 1, [3], 1), ("actor-gen", 1, [2], 1))
    with pytest.raises(LastCopyLostError) as err:
        build_transition(STATES, CLUSTER, old, new, lost_gpus=frozenset({0, 1}), exact=True)
    assert err.value.model_stages == ("ref-inf", "actor-train") and err.value.lost_gpus == (0, 1)


def test_two_refreshed_stages_are_both_stale_and_a_dropped_stage_is_destroyed() -> None:
    """Two generation stages ("actor-gen-2" a copy of actor-gen) refreshed from actor-train: the old
    units of both are stale. ref-inf left out of the new plan: its unit is destroyed."""
    states = {**STATES, "actor-gen-2": replace(STATES["actor-gen"], model_stage="actor-gen-2")}
    plan = (("actor-gen", 1, [0], 1), ("actor-gen-2", 1, [1], 1), ("actor-train", 2, [2, 3], 1))
    dag = build_transition(states, CLUSTER, _plan(1, *plan), _plan(2, *plan),
                           refresh={"actor-gen": "actor-train", "actor-gen-2": "actor-train"})
    assert sorted(dag.stale_units) == ["actor-gen-2@v1#0", "actor-gen@v1#0"]
    replay(dag)
    old = _plan(1, ("actor-gen", 1, [0], 1), ("ref-inf", 1, [1], 1), ("actor-train", 2, [2, 3], 1))
    dropped = build_transition(STATES, CLUSTER, old, _plan(2, ("actor-gen", 1, [0], 1), ("actor-train", 2, [2, 3], 1)),
                               exact=True)
    assert [p.unit.uid for p in dropped.nodes if isinstance(p, Destroy)] == ["ref-inf@v1#0"]
    assert replay(dropped).final_units == ["actor-gen@v2#0", "actor-train@v2#0"]


def test_a_refresh_is_only_a_weight_sync_from_a_training_stage_of_the_same_role() -> None:
    """(found by the replay-oracle mutation run: refresh={"ref-inf": "actor-train"} was built, and
    replaying that DAG raised a KeyError inside the oracle)"""
    from planner.errors import SpecError
    from planner.hardware import cluster_preset
    from planner.models import model_preset
    from planner.plan import GlobalPlan, Layout, StagePlan
    from planner.workflow import Workload, same_model_job, workflow_preset
    from transitions.global_dag import build_transition

    job = same_model_job(workflow_preset("grpo"), model_preset("tiny-3m"),
                         Workload(prompts_per_step=4, prompt_tokens=8, response_tokens=8))
    cluster = cluster_preset("cpu", 2)

    def plan(version: int) -> GlobalPlan:
        return GlobalPlan(version=version, stages=tuple(
            StagePlan(model_stage=ms.name, layout=Layout(1, 1), gpu_sets=((0,), (1,)), micro_batch_size=2)
            for ms in job.workflow.model_stages))

    synced = build_transition(job, cluster, plan(1), plan(2), refresh={"actor-gen": "actor-train"})
    assert synced.to_dict()["nodes"]  # the weight sync moves the trained weights
    for refresh, field, text in (
            ({"ref-inf": "actor-train"}, "refresh.ref-inf", "refreshes from 'actor-train': only a training stage"),
            ({"actor-gen": "ref-inf"}, "refresh.actor-gen", "refreshes from 'ref-inf': only a training stage"),
            ({"actor-train": "actor-train"}, "refresh.actor-train", "refreshes from 'actor-train'"),
            ({"actor-gen": "critic-train"}, "refresh", "unknown model-stage 'critic-train'")):
        with pytest.raises(SpecError) as err:
            build_transition(job, cluster, plan(1), plan(2), refresh=refresh)
        assert err.value.field == field and text in str(err.value), str(err.value)
