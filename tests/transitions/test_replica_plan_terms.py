"""transitions.replica_plan: terms pinned one by one (mutation survivors of the replica-class fast path)."""

from __future__ import annotations

import pickle

import numpy as np
from test_replica_classes import symmetric_case

from transitions.global_dag import build_transition
from transitions.planning_cache import PlanningCache
from transitions.primitives import Footprint, PrimitiveKind
from transitions.replica_plan import ReplicaClass, unit_emu


def _replica_plan():
    for seed in range(20):
        cache = PlanningCache()
        dag = build_transition(*symmetric_case(seed), capacity_bytes=1 << 50, exact=False, cache=cache)
        if dag.replicas is not None:
            return dag.replicas, cache
    raise AssertionError("no symmetric case of seeds 0-19 took the replica-class path")


def test_a_replica_plan_pickles_without_its_builders_cache_and_expands_alike() -> None:
    plan, cache = _replica_plan()
    assert plan.cache is cache
    wire = pickle.dumps(plan)
    assert b"PlanningCache" not in wire  # the builder's memos are not shipped with the plan
    back = pickle.loads(wire)
    assert back.cache is None and plan.cache is cache  # pickling leaves the builder's plan as it was
    for name in ("old_version", "new_version", "class_stage", "first", "stage_base", "class_order",
                 "num_nodes"):
        assert getattr(back, name) == getattr(plan, name), name
    assert np.array_equal(back.initial, plan.initial) and len(back.classes) == len(plan.classes)
    assert back.order() == plan.order() and back.bytes_moved == plan.bytes_moved
    assert back.expand() == plan.expand()


def test_expansion_gives_each_node_its_own_stage_order() -> None:
    plan, _ = _replica_plan()
    nodes, stage_order, old_units, new_units, _renamed = plan.expand()
    assert len(stage_order) == len(nodes) == plan.num_nodes
    for prim, order in zip(nodes, stage_order):
        units = (*prim.sources, *prim.targets, *prim.frees)
        assert {u.state.stage_order for u in units} == {order}


def test_a_stage_unit_is_named_by_stage_version_and_index_on_its_plans_gpus() -> None:
    plan, _ = _replica_plan()
    st = plan.stages[-1].stage
    last = len(st.target.gpu_sets) - 1
    now = unit_emu(st, 7, 0, True)
    then = unit_emu(st, 8, last, False)
    assert (now.uid, now.version, now.layout, now.gpus, now.state) == (
        f"{st.name}@v7#0", 7, st.current.layout, tuple(st.current.gpu_sets[0]), st.state)
    assert (then.uid, then.version, then.layout, then.gpus) == (
        f"{st.name}@v8#{last}", 8, st.target.layout, tuple(st.target.gpu_sets[last]))


def _class(canon: Footprint, gpus: list[list[int]], touched: list[int]) -> ReplicaClass:
    c = ReplicaClass(kind=PrimitiveKind.EXTEND, stage="s", stage_order=0, canon=canon,
                     gpus=np.array(gpus, dtype=np.int64), unit=np.zeros(len(gpus), dtype=np.int64),
                     refs=np.zeros((len(gpus), 1), dtype=np.int64), touched=np.array(touched, dtype=np.int64))
    c._finish()
    return c


def test_a_class_keeps_its_footprint_per_touched_label_and_knows_when_members_share_a_gpu() -> None:
    # labels 0..3; label 1 only holds a buffer, label 3 only frees; label 2 is untouched
    canon = Footprint(alloc_bytes={0: 8, 3: 0}, free_bytes={3: 5, 0: 2}, buffer_bytes={1: 4},
                      local_bytes={}, pair_bytes={(0, 1): 3})
    c = _class(canon, [[10, 11, 12, 13], [20, 21, 22, 23]], [0, 1, 3])
    assert c.alloc.tolist() == [8, 0, 0] and c.buf.tolist() == [0, 4, 0]
    assert c.delta.tolist() == [6, 0, -5] and c.acquire
    assert c.g.tolist() == [[10, 11, 13], [20, 21, 23]] and c.single and c.size == 2
    shared = _class(canon, [[10, 11, 12, 13], [13, 21, 22, 23]], [0, 1, 3])  # GPU 13 twice
    assert not shared.single
    once = _class(canon, [[10, 11, 12, 13], [12, 21, 22, 23]], [0, 1, 3])  # 12 is untouched in member 0
    assert once.single
    frees_only = _class(Footprint(alloc_bytes={}, free_bytes={0: 5}, buffer_bytes={}, local_bytes={},
                                  pair_bytes={}), [[4]], [0])
    assert not frees_only.acquire and frees_only.delta.tolist() == [-5]
    nothing = _class(Footprint(alloc_bytes={}, free_bytes={}, buffer_bytes={}, local_bytes={}, pair_bytes={}),
                     [[4], [5]], [])
    assert nothing.single and not nothing.acquire
    for arr in (nothing.alloc, nothing.buf, nothing.delta):
        assert arr.dtype == np.int64 and arr.shape == (0,)
