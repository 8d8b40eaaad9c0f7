"""Which early builds a worker makes (transitions.early_builds), pure, on real layout changes: the
sender of a TP 1 -> TP 2 change builds its new shard before the Extend that sends it, whichever of
the two nodes comes first in its order; nothing else builds early; reads are redirected on both ends;
what the build copies is every local piece into the target, as merged runs."""

from __future__ import annotations

from planner.hardware import cluster_preset
from planner.models import ModelSpec
from planner.plan import GlobalPlan, Layout, StagePlan
from planner.workflow import ACTOR_TRAIN
from transitions.dag_pieces import DagMemo, node_pieces
from transitions.early_builds import EarlyBuild, build_pieces, early_builds, redirected
from transitions.global_dag import TransitionDAG, build_transition
from transitions.layout import contiguous_range, unit_slots
from transitions.primitives import Extend, Merge
from transitions.scenarios import stage_states

MICRO = ModelSpec(name="micro", num_layers=4, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                  head_dim=16, ffn_hidden_size=176, vocab_size=96, rope_theta=10_000.0)
STATES = stage_states(MICRO, (ACTOR_TRAIN,))
CLUSTER = cluster_preset("cpu", 4)


def _plan(version: int, tp: int, sets: list[list[int]], pp: int = 1) -> GlobalPlan:
    return GlobalPlan(version=version, stages=(StagePlan(model_stage="actor-train", layout=Layout(tp, pp),
                                                         gpu_sets=tuple(map(tuple, sets)), micro_batch_size=1),))


def _dag(old: GlobalPlan, new: GlobalPlan) -> TransitionDAG:
    return build_transition(STATES, CLUSTER, old, new)


def _node(dag: TransitionDAG, kind: type, source: str) -> int:
    return next(i for i, p in enumerate(dag.nodes) if isinstance(p, kind) and any(u.uid == source for u in p.sources))


def test_the_sender_of_a_tp1_to_tp2_change_builds_its_shard_before_sending_it() -> None:
    # TP 1 x DP 2 on GPUs 0, 1 -> TP 2 x DP 2 on (0, 1), (2, 3): GPU 0 keeps half of its replica in
    # the new unit on (0, 1) and sends GPU 2 that very half
    dag = _dag(_plan(1, 1, [[0], [1]]), _plan(2, 2, [[0, 1], [2, 3]]))
    memo = DagMemo()
    for sender in (0, 1):
        donor = f"actor-train@v1#{sender}"
        merge, extend = _node(dag, Merge, donor), _node(dag, Extend, donor)
        assert dag.nodes_on(sender) == [extend, merge]  # the send is ordered first
        target = dag.nodes[merge].targets[0]
        assert early_builds(dag, sender, memo) == {merge: EarlyBuild(node=merge, worker=sender, donor=donor,
                                                                     target=target, readers=(extend,), frees_at=merge)}
    for receiver in (2, 3):
        assert early_builds(dag, receiver, memo) == {}


def test_an_early_build_after_its_reader_in_the_order_is_found_the_same() -> None:
    # the new unit on GPUs (0, 1) second: its Merge is last, the Extends (to 2 and 3) first
    dag = _dag(_plan(1, 1, [[0], [1]]), _plan(2, 2, [[2, 3], [0, 1]]))
    memo = DagMemo()
    for sender in (0, 1):
        donor = f"actor-train@v1#{sender}"
        merge, extend = _node(dag, Merge, donor), _node(dag, Extend, donor)
        (build,) = early_builds(dag, sender, memo).values()
        assert (build.node, build.readers, build.frees_at, build.donor) == (merge, (extend,), merge, donor)


def test_changes_without_a_kept_half_sent_elsewhere_build_nothing_early() -> None:
    for old, new in [(_plan(1, 2, [[0, 1]]), _plan(2, 4, [[0, 1, 2, 3]])),  # TP 2 -> 4: parts, then a Merge
                     (_plan(1, 1, [[0], [1]]), _plan(2, 2, [[0, 1]])),  # a Merge that nobody else reads
                     (_plan(1, 2, [[0, 1]]), _plan(2, 1, [[0], [1]])),  # a Split receiving the other half
                     (_plan(1, 1, [[0, 1]], 2), _plan(2, 1, [[0, 1, 2, 3]], 4))]:  # PP 2 -> 4
        dag = _dag(old, new)
        memo = DagMemo()
        assert all(early_builds(dag, w, memo) == {} for w in range(4)), (old, new)


def test_reads_from_the_donor_come_from_the_target_on_both_ends() -> None:
    dag = _dag(_plan(1, 1, [[0], [1]]), _plan(2, 2, [[0, 1], [2, 3]]))
    memo = DagMemo()
    (build,) = early_builds(dag, 0, memo).values()
    (reader,) = build.readers
    target_slots = unit_slots(build.target, 0)
    for worker in (0, 2):  # the sender and the receiver derive the same redirected pieces
        plain = node_pieces(dag, reader, worker, memo)
        got = redirected(dag, reader, worker, list(plain), memo)
        assert len(got) == len(plain)
        for before, after in zip(plain, got):
            if before.src_worker == 0 and before.src_unit == build.donor:
                assert after.src_unit == build.target.uid and after.src_slot == target_slots[before.src_slot.key]
                assert (after.dst_unit, after.dst_slot, after.box) == (before.dst_unit, before.dst_slot, before.box)
            else:
                assert after == before
        assert any(p.src_unit == build.target.uid for p in got)
    # the building node's own copies into the target are left to the build; its other pieces stay
    pieces = node_pieces(dag, build.node, 0, memo)
    kept = redirected(dag, build.node, 0, list(pieces), memo)
    assert kept == [p for p in pieces if not (p.src_worker == p.dst_worker == 0 and p.dst_unit == build.target.uid)]
    assert len(kept) < len(pieces)
    # without early builds (TP 2 -> 4) every piece is left as it is
    plain = _dag(_plan(1, 2, [[0, 1]]), _plan(2, 4, [[0, 1, 2, 3]]))
    for worker in range(4):
        for n in plain.nodes_on(worker):
            pieces = node_pieces(plain, n, worker, memo)
            assert redirected(plain, n, worker, list(pieces), memo) == list(pieces)


def test_the_build_copies_every_local_piece_into_the_target_as_merged_runs() -> None:
    dag = _dag(_plan(1, 1, [[0], [1]]), _plan(2, 2, [[0, 1], [2, 3]]))
    memo = DagMemo()
    (build,) = early_builds(dag, 0, memo).values()
    runs, strided = build_pieces(dag, build.node, 0, build.target.uid, memo)
    local = [p for p in node_pieces(dag, build.node, 0, memo)
             if p.src_worker == p.dst_worker == 0 and p.dst_unit == build.target.uid]
    assert sum(n for _, _, n in runs) + sum(p.num_bytes for p in strided) == sum(p.num_bytes for p in local)
    # every byte of every contiguous piece lies in exactly one run, at the same offset on both sides
    cover = {}
    for s, d, n in runs:
        assert n > 0
        cover[(s, d)] = n
    for p in local:
        src, dst = contiguous_range(p.src_slot, p.box), contiguous_range(p.dst_slot, p.box)
        if src is None or dst is None:
            assert p in strided
            continue
        assert any(s <= src[0] and src[1] <= s + n and dst[0] - src[0] == d - s for (s, d), n in cover.items())
    # back-to-back runs were merged: no run starts where the previous one ends on both sides
    assert all(not (a[0] + a[2] == b[0] and a[1] + a[2] == b[1]) for a, b in zip(runs, runs[1:]))
    assert len(runs) < len(local)  # some pieces did lie back to back
    # nothing for a unit the node does not build here
    assert build_pieces(dag, build.node, 0, "nobody", memo) == ((), ())
