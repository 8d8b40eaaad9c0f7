"""The replay oracle (transitions.replay) on what its other tests left open: a Merge's relabelled parts
leave the coverage count and the set of complete units, a Merge that frees whole old replicas (parts
copied, not relabelled) gives their bytes back, and the element values are such that a stale copy
(negated) never equals a fresh element."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import transitions.replay as replay_module
from planner.hardware import CPU, LOOPBACK, NVLINK4, ClusterSpec
from planner.models import ModelSpec
from planner.plan import GlobalPlan, Layout
from planner.workflow import ACTOR_GEN, ACTOR_TRAIN, REF_INF
from transitions.feasibility import apply_footprint
from transitions.global_dag import TransitionDAG, build_transition
from transitions.primitives import Destroy, Merge, Primitive
from transitions.replay import ReplayError, _Replay, replay
from transitions.scenarios import stage_plan, stage_states
from transitions.transfer_plan import Piece

TINY = ModelSpec(name="tiny", num_layers=2, hidden_size=8, num_attention_heads=4, num_kv_heads=2, head_dim=2,
                 ffn_hidden_size=24, vocab_size=11)
STATES = stage_states(TINY, (ACTOR_GEN, REF_INF, ACTOR_TRAIN))
CLUSTER = ClusterSpec(device=CPU, num_nodes=1, gpus_per_node=4, intra_node_link=NVLINK4, inter_node_link=LOOPBACK)
Stage = tuple[str, int, int, list[int], int]  # name, TP, PP, GPUs, DP


def _build(old: list[Stage], new: list[Stage]) -> TransitionDAG:
    def plan(version: int, stages: list[Stage]) -> GlobalPlan:
        return GlobalPlan(version=version, stages=tuple(stage_plan(name, Layout(tp, pp), gpus, dp)
                                                        for name, tp, pp, gpus, dp in stages))
    return build_transition(STATES, CLUSTER, plan(1, old), plan(2, new), exact=True)


def _with(dag: TransitionDAG, **body: object) -> TransitionDAG:
    return TransitionDAG(old_version=dag.old_version, new_version=dag.new_version,
                         capacity_bytes=dag.capacity_bytes, body_=replace(dag.body, **body))  # type: ignore[arg-type]


def _reordered(dag: TransitionDAG, order: tuple[int, ...]) -> TransitionDAG:
    """``dag`` run in ``order``, with the peaks its footprints' timeline reaches in that order."""
    late = dag.with_order(order)
    used, peak = dict(late.initial_bytes), dict(late.initial_bytes)
    for i in order:
        apply_footprint(late.footprints[i], used, peak)
    return _with(late, peak_bytes=peak)


def _merge_and_gen() -> tuple[TransitionDAG, int, int]:
    """TP2 x DP2 -> TP4 on GPUs 0-3 (two parts Extended, then relabelled by the Merge) and a new
    actor-gen replica on GPU 0 (the same domain: actor-gen and actor-train share one)."""
    dag = _build([("actor-train", 2, 1, [0, 1, 2, 3], 2)],
                 [("actor-train", 4, 1, [0, 1, 2, 3], 1), ("actor-gen", 1, 1, [0], 1)])
    (merge,) = [i for i, p in enumerate(dag.nodes) if isinstance(p, Merge)]
    (gen,) = [i for i, p in enumerate(dag.nodes) if p.targets and p.targets[0].uid == "actor-gen@v2#0"]
    parts = dag.nodes[merge].parts  # type: ignore[attr-defined]
    assert [p.uid for p in parts] == ["actor-train@v2#0.p0.0", "actor-train@v2#0.p1.0"]
    assert all(p.final is not None and p.final.uid == "actor-train@v2#0" for p in parts)
    # together the parts sit on every GPU of the merged unit: relabelling them covers all of it
    assert sorted(g for p in parts for g in p.gpus) == [0, 1, 2, 3]
    return dag, merge, gen


def test_destroying_the_merged_unit_while_a_replica_of_its_domain_waits_drops_the_last_copy() -> None:
    """Run the Merge and both old Destroys, then destroy the merged unit itself before actor-gen is
    built: the merged unit is the only copy left (its parts were relabelled into it, not kept), so
    that free is refused as dropping the last copy, before the read of a destroyed old replica."""
    dag, merge, gen = _merge_and_gen()
    merged = dag.nodes[merge].targets[0]
    rest = [i for i in dag.order if i != gen]
    assert [type(dag.nodes[i]).__name__ for i in rest] == ["Extend", "Extend", "Merge", "Destroy", "Destroy"]
    kill = len(dag.nodes)
    bad = _with(dag, nodes=(*dag.nodes, Destroy(unit=merged)), order=(*rest, kill, gen))
    with pytest.raises(ReplayError, match=r"^freeing actor-train@v2#0 drops the last copy of .* on GPU 0$"):
        replay(bad)


def test_a_relabelled_part_is_no_longer_complete(monkeypatch: pytest.MonkeyPatch) -> None:
    """After the Merge, its parts are gone (their bytes are the merged unit's): actor-gen, run after
    the Merge and fed from a part instead of an old replica, reads a unit that is not complete."""
    dag, merge, gen = _merge_and_gen()
    rest = [i for i in dag.order if i != gen]
    late = _reordered(dag, (*rest[:3], gen, *rest[3:]))
    assert [type(late.nodes[i]).__name__ for i in late.order] == ["Extend", "Extend", "Merge", "Extend",
                                                                  "Destroy", "Destroy"]
    replay(late)  # fed from the old replica (still alive), the late actor-gen is sound
    real = replay_module.pieces

    def from_part(prim: Primitive) -> list[Piece]:
        ps = list(real(prim))
        if prim.targets and prim.targets[0].uid == "actor-gen@v2#0":
            return [replace(pc, src_unit="actor-train@v2#0.p0.0", src_worker=0) for pc in ps]
        return ps
    monkeypatch.setattr(replay_module, "pieces", from_part)
    with pytest.raises(ReplayError, match=rf"^node {gen} reads actor-train@v2#0.p0.0, which is not complete$"):
        replay(late)


def test_a_merge_of_whole_replicas_gives_their_bytes_back_before_a_later_node() -> None:
    """DP4 x TP1 -> TP4 on GPUs 0-3 (the four old replicas are the Merge's parts, copied, and freed by
    it) while ref-inf moves from GPU 1 to GPU 0, run after the Merge: the Merge frees the old replicas'
    bytes, so GPU 0 peaks during the Merge (old replica + merged unit), not during ref-inf's copy."""
    dag = _build([("actor-train", 1, 1, [0, 1, 2, 3], 4), ("ref-inf", 1, 1, [1], 1)],
                 [("actor-train", 4, 1, [0, 1, 2, 3], 1), ("ref-inf", 1, 1, [0], 1)])
    (merge,) = [i for i, p in enumerate(dag.nodes) if isinstance(p, Merge)]
    (extend,) = [i for i, p in enumerate(dag.nodes) if p.targets and p.targets[0].uid == "ref-inf@v2#0"]
    (destroy,) = [i for i, p in enumerate(dag.nodes) if isinstance(p, Destroy)]
    assert all(p.final is None for p in dag.nodes[merge].parts)  # type: ignore[attr-defined]
    late = _reordered(dag, (merge, extend, destroy))
    old0 = next(u for u in dag.old_units if u.uid == "actor-train@v1#0").bytes_on(0)
    merged0 = dag.nodes[merge].targets[0].bytes_on(0)
    ref0 = dag.nodes[extend].targets[0].bytes_on(0)
    assert 0 < ref0 < old0
    # the Merge's moment; ref-inf's copy, after it, needs merged0 + ref0 only
    assert late.peak_bytes[0] == old0 + merged0
    report = replay(late)
    assert report.peak_bytes == late.peak_bytes
    assert report.final_units == ["actor-train@v2#0", "ref-inf@v2#0"]


def test_no_fresh_element_value_is_zero_or_the_negation_of_another() -> None:
    """Every element of every old unit gets its own value; stale copies carry the negation, which must
    never equal a fresh element's value (else a read of stale bytes could pass the value check)."""
    dag = _build([("actor-train", 2, 1, [0, 1], 1), ("ref-inf", 1, 1, [2], 1)],
                 [("actor-train", 2, 1, [2, 3], 1), ("ref-inf", 1, 1, [3], 1)])
    r = _Replay(dag, frozenset())
    for u in dag.old_units:
        for g in u.gpus:
            for s in u.shards(g):
                r.expected(u, s.key, s.offsets, s.lengths, s.global_shape)
    # one array per (domain, tensor, kind): actor and ref are two domains of the same tensors
    assert len({domain for domain, _, _ in r.full}) == 2 and len(r.full) > 2
    fresh = np.concatenate([a.ravel() for a in r.full.values()])
    assert fresh.size == len(np.unique(fresh))
    assert not np.isin(-fresh, fresh).any()
    assert (fresh != 0).all()


def test_relabelled_parts_keep_their_bytes_on_their_gpus() -> None:
    """TP2 x DP2 -> TP4 while ref-inf moves from GPU 1 to GPU 3, its copy run right after the Merge
    (old replicas still alive): the relabelled parts' bytes are now the merged unit's and stay on
    GPU 3, so GPU 3 peaks during ref-inf's copy at old replica + merged unit + ref-inf."""
    dag = _build([("actor-train", 2, 1, [0, 1, 2, 3], 2), ("ref-inf", 1, 1, [1], 1)],
                 [("actor-train", 4, 1, [0, 1, 2, 3], 1), ("ref-inf", 1, 1, [3], 1)])
    (merge,) = [i for i, p in enumerate(dag.nodes) if isinstance(p, Merge)]
    assert all(p.final is not None for p in dag.nodes[merge].parts)  # type: ignore[attr-defined]
    (ref,) = [i for i, p in enumerate(dag.nodes) if p.targets and p.targets[0].uid == "ref-inf@v2#0"]
    (gone,) = [i for i, p in enumerate(dag.nodes) if isinstance(p, Destroy) and p.unit.uid == "ref-inf@v1#0"]
    train = [i for i in dag.order if i not in (ref, gone)]
    cut = train.index(merge) + 1
    late = _reordered(dag, (*train[:cut], ref, *train[cut:], gone))
    old3 = next(u for u in dag.old_units if u.uid == "actor-train@v1#1").bytes_on(3)
    merged3 = dag.nodes[merge].targets[0].bytes_on(3)
    ref3 = dag.nodes[ref].targets[0].bytes_on(3)
    assert dag.footprints[ref].buffer_bytes.get(3, 0) == 0
    assert late.peak_bytes[3] == old3 + merged3 + ref3
    assert replay(late).peak_bytes == late.peak_bytes
