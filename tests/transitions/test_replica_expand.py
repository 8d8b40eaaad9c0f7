"""The expansion of a replica-class plan to units (transitions.dag_record._expand and
transitions.replica_plan.ReplicaPlan.expand) over the class arrays gives exactly what the plain
per-member derivation gives: the units and parts of ``plan_units`` / ``target_parts``, each member
as ``member``, footprints as ``on_gpus``, peaks as ``apply_footprint`` replayed member by member in
order, and the per-GPU node lists as ``gpu_index``. Over random symmetric cases, including classes
whose members share a GPU (replayed one by one) and classes touching none."""

from __future__ import annotations

import inspect
from dataclasses import fields
from types import SimpleNamespace

import numpy as np
from test_replica_classes import symmetric_case

from planner.plan import Layout
from transitions.dag_record import (
    _expand,
    class_gpu_index,
    class_peaks,
    gpu_index,
    held_bytes,
    member_footprints,
)
from transitions.emu import EMU
from transitions.feasibility import apply_footprint
from transitions.footprints import on_gpus
from transitions.global_dag import build_transition
from transitions.local_dag import plan_units, target_parts
from transitions.planning_cache import PlanningCache
from transitions.primitives import Footprint, PrimitiveKind
from transitions.replica_plan import ReplicaClass, ReplicaPlan, make_emu, member


def test_make_emu_sets_every_field_as_the_dataclass_does() -> None:
    assert list(inspect.signature(make_emu).parameters) == [f.name for f in fields(EMU)]
    state = next(iter(symmetric_case(0)[0].values()))
    final = EMU(uid="u", state=state, layout=Layout(1, 1), gpus=(3,), version=2)
    values = dict(uid="u.p0.0", state=state, layout=Layout(1, 1), gpus=(3,), version=2, final=final)
    fast, slow = make_emu(**values), EMU(**values)  # type: ignore[arg-type]
    assert fast == slow and hash(fast) == hash(slow)
    assert {f.name: getattr(fast, f.name) for f in fields(EMU)} == values


def _reference(plan: ReplicaPlan) -> tuple[list, list, list, list, dict[int, int], dict[int, tuple[int, ...]]]:
    """(nodes, old units, new units, footprints, peaks, GPU index) the per-member way."""
    nodes, old_units, new_units = [], [], []
    for sc in plan.stages:
        st = sc.stage
        cur = plan_units(st.state, st.current, plan.old_version)
        tgt = plan_units(st.state, st.target, plan.new_version)
        parts = [p for u in tgt for p in target_parts(u, st.sub)]
        old_units += cur
        new_units += tgt
        nodes += [member(c, m, cur, tgt, parts) for c in sc.classes for m in range(c.size)]
    fps = [on_gpus(c.canon, gpus) for sc in plan.stages for c in sc.classes for gpus in c.gpus.tolist()]
    used = held_bytes(old_units)
    peak = dict(used)
    for i in plan.order():
        apply_footprint(fps[i], used, peak)
    return nodes, old_units, new_units, fps, peak, gpu_index(fps, tuple(plan.order()))


def _fields(units: list[EMU] | tuple[EMU, ...]) -> list[tuple[object, ...]]:
    return [(u.uid, u.state, u.layout, u.gpus, u.version, u.final) for u in units]


def test_the_class_level_expansion_is_the_per_member_one() -> None:
    seen = {"plans": 0, "shared": 0, "untouched": 0, "parts": 0}
    for seed in range(60):
        dag = build_transition(*symmetric_case(seed), capacity_bytes=1 << 50, exact=False, cache=PlanningCache())
        plan = dag.replicas
        if plan is None:
            continue
        seen["plans"] += 1
        seen["shared"] += any(not c.single and len(c.touched) for c in plan.classes)
        seen["untouched"] += any(not len(c.touched) for c in plan.classes)
        seen["parts"] += any(sc.stage.nq > 1 for sc in plan.stages)
        nodes, old_units, new_units, fps, peak, index = _reference(plan)
        body = _expand(plan)
        assert list(body.nodes) == nodes
        assert _fields(body.old_units) == _fields(old_units) and _fields(body.new_units) == _fields(new_units)
        # the parts inside the nodes, field by field (a part's final unit included)
        assert [_fields(p.sources + p.targets) for p in body.nodes] == [_fields(p.sources + p.targets) for p in nodes]
        assert list(body.footprints) == fps
        assert all(type(fp) is Footprint for fp in body.footprints)
        assert body.peak_bytes == peak
        assert list(body.peak_bytes)[:len(held_bytes(old_units))] == list(held_bytes(old_units))
        assert body.gpu_nodes == index
        assert body.order == tuple(plan.order())
    assert seen["plans"] >= 20 and seen["shared"] and seen["untouched"] and seen["parts"], seen


def test_member_footprints_map_every_label_map() -> None:
    canon = Footprint(alloc_bytes={0: 5, 2: 7}, free_bytes={1: 3}, buffer_bytes={2: 11}, local_bytes={0: 13},
                      pair_bytes={(0, 1): 17, (2, 0): 19})
    rows = [[4, 5, 6], [9, 8, 7]]
    assert member_footprints(canon, rows) == [on_gpus(canon, row) for row in rows]
    assert member_footprints(canon, []) == []


def test_class_peaks_and_index_over_random_plans_from_an_empty_start() -> None:
    for seed in range(60):
        dag = build_transition(*symmetric_case(seed), capacity_bytes=1 << 50, exact=False, cache=PlanningCache())
        if dag.replicas is None:
            continue
        plan = dag.replicas
        used: dict[int, int] = {}
        peak: dict[int, int] = {}
        fps = [on_gpus(c.canon, g) for sc in plan.stages for c in sc.classes for g in c.gpus.tolist()]
        for i in plan.order():
            apply_footprint(fps[i], used, peak)
        assert class_peaks(plan, {}) == peak
        assert class_gpu_index(plan) == gpu_index(fps, tuple(plan.order()))


def _class(canon: Footprint, gpus: list[list[int]], first: int) -> ReplicaClass:
    c = ReplicaClass(kind=PrimitiveKind.EXTEND, stage="s", stage_order=0, canon=canon,
                     gpus=np.array(gpus, dtype=np.int64).reshape(len(gpus), -1), unit=np.arange(len(gpus)),
                     refs=np.zeros((len(gpus), 0), dtype=np.int64),
                     touched=np.array(sorted(canon.gpus), dtype=np.int64), first=first)
    c._finish()
    return c


def _replay(classes: list[ReplicaClass], order: list[int], held: dict[int, int]) -> dict[int, int]:
    used, peak = dict(held), dict(held)
    for k in order:
        for row in classes[k].gpus.tolist():
            apply_footprint(on_gpus(classes[k].canon, row), used, peak)
    return peak


def test_class_peaks_by_hand_with_members_sharing_a_gpu() -> None:
    # A: two members on GPUs (0, 1) and (2, 3), allocating 5 (+1 bucket) on label 0, freeing 2 on label 1,
    # copying locally on label 2 (touched, nothing allocated: GPUs 6 and 7 never rise above zero).
    # B: two members sharing GPU 4 (label 0), each allocating 3 there and 1 on label 1: the second sees
    # the first's 3; GPU 5 peaks at exactly 1 byte.
    a = _class(Footprint(alloc_bytes={0: 5}, free_bytes={1: 2}, buffer_bytes={0: 1}, local_bytes={2: 4},
                         pair_bytes={}), [[0, 1, 6], [2, 3, 7]], first=0)
    b = _class(Footprint(alloc_bytes={0: 3, 1: 1}, free_bytes={}, buffer_bytes={}, local_bytes={},
                         pair_bytes={(1, 0): 8}), [[4, 5], [4, 8]], first=2)
    empty = _class(Footprint(alloc_bytes={}, free_bytes={}, buffer_bytes={}, local_bytes={}, pair_bytes={}),
                   [[], []], first=4)
    assert a.single and not b.single and not len(empty.touched)
    plan = SimpleNamespace(initial=np.zeros(10, dtype=np.int64), classes=[a, b, empty], class_order=[2, 1, 0],
                           first=[0, 2, 4])
    held = {3: 10, 1: 10, 4: 2}
    got = class_peaks(plan, held)  # type: ignore[arg-type]
    assert got == _replay([a, b, empty], [2, 1, 0], held)
    assert got == {3: 10, 1: 10, 4: 8, 0: 6, 2: 6, 5: 1, 8: 1}
    assert list(got) == [3, 1, 4, 0, 2, 5, 8] and all(type(v) is int for v in got.values())
    assert class_gpu_index(plan) == {0: (0,), 1: (0,), 2: (1,), 3: (1,), 4: (2, 3), 5: (2,), 6: (0,), 7: (1,),  # type: ignore[arg-type]
                                     8: (3,)}
    only_empty = SimpleNamespace(initial=np.zeros(10, dtype=np.int64), classes=[empty], class_order=[0], first=[0])
    assert class_gpu_index(only_empty) == {}  # type: ignore[arg-type]
    assert class_gpu_index(SimpleNamespace(classes=[], class_order=[], first=[])) == {}  # type: ignore[arg-type]
    assert class_peaks(only_empty, {}) == {}  # type: ignore[arg-type]
