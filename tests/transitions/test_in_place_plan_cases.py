"""Whether a node builds its target inside its donor's buffer (transitions.in_place_plan), branch by
branch: on DAGs of real layout changes, and on small hand-made nodes and steps where one condition at
a time fails (who frees the donor, the last reader before that, a receive into the target, the buffer
sizes, the forward order of the compaction)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

from planner.hardware import cluster_preset
from planner.models import ModelSpec
from planner.plan import GlobalPlan, Layout, StagePlan
from planner.workflow import ACTOR_TRAIN
from transitions.dag_pieces import DagMemo
from transitions.emu import EMU
from transitions.global_dag import TransitionDAG, build_transition
from transitions.in_place_plan import _forward_order, cut_here, in_place_plan
from transitions.layout import Slot, contiguous_range, unit_buffer_bytes
from transitions.node_steps import node_step
from transitions.primitives import Destroy, Extend, Merge, Primitive, Split
from transitions.scenarios import stage_states
from transitions.transfer_plan import Message, Piece, Step

MICRO = ModelSpec(name="micro", num_layers=4, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                  head_dim=16, ffn_hidden_size=176, vocab_size=96, rope_theta=10_000.0)
STATE = stage_states(MICRO, (ACTOR_TRAIN,))["actor-train"]
STATES = {"actor-train": STATE}
CLUSTER = cluster_preset("cpu", 8)


def _plan(version: int, tp: int, pp: int, dp: int) -> GlobalPlan:
    size = tp * pp
    sets = tuple(tuple(range(r * size, (r + 1) * size)) for r in range(dp))
    return GlobalPlan(version=version, stages=(StagePlan(model_stage="actor-train", layout=Layout(tp, pp),
                                                         gpu_sets=sets, micro_batch_size=1),))


def _dag(old: tuple[int, int, int], new: tuple[int, int, int]) -> TransitionDAG:
    return build_transition(STATES, CLUSTER, _plan(1, *old), _plan(2, *new))


def _steps(dag: TransitionDAG, worker: int) -> dict[int, Step]:
    memo = DagMemo()
    return {n: node_step(dag, n, worker, memo) for n in range(len(dag.nodes)) if worker in
            {g for u in (*dag.nodes[n].sources, *dag.nodes[n].targets, *dag.nodes[n].frees) for g in u.gpus}}


def _node(dag: TransitionDAG, kind: type, target: str | None = None) -> int:
    return next(i for i, p in enumerate(dag.nodes) if isinstance(p, kind)
                and (target is None or any(t.uid == target for t in p.targets)))


# --- on real DAGs -----------------------------------------------------------------------------------


def test_a_merge_of_two_replicas_is_built_inside_each_gpus_replica() -> None:
    dag = _dag((1, 1, 2), (2, 1, 1))  # two TP 1 replicas on GPUs 0, 1 -> one TP 2 unit there
    (merge,) = range(len(dag.nodes))
    for worker in (0, 1):
        step = _steps(dag, worker)[merge]
        plan = in_place_plan(dag, merge, step, worker)
        assert plan is not None
        assert plan.node == merge and plan.build_after == merge  # the Merge frees its parts itself
        assert plan.donor == f"actor-train@v1#{worker}" and plan.target.uid == "actor-train@v2#0"
        assert plan.target_bytes == unit_buffer_bytes(plan.target, worker)
        assert plan.target_bytes < unit_buffer_bytes(dag.nodes[merge].sources[worker], worker)
        # every local piece, in the target's byte order
        assert sorted(plan.pieces, key=id) == sorted(step.local, key=id)
        starts = [contiguous_range(p.dst_slot, p.box)[0] for p in plan.pieces]  # type: ignore[index]
        assert starts == sorted(starts) and len(set(starts)) == len(starts)


def test_a_part_cut_before_a_later_destroy_waits_for_the_donors_last_reader() -> None:
    dag = _dag((2, 1, 1), (4, 1, 1))  # TP 2 -> 4 on GPUs 0-3: Extends into parts, a Merge, a Destroy
    part0 = "actor-train@v2#0.p0.0"  # on GPUs 0 and 2
    cut, other = _node(dag, Extend, part0), _node(dag, Extend, "actor-train@v2#0.p1.0")
    merge, destroy = _node(dag, Merge), _node(dag, Destroy)
    steps = _steps(dag, 0)
    assert cut_here(dag.nodes[cut], steps[cut].local, 0) is not None
    # the Extend frees nothing: only a worker order with a later Destroy of the donor allows it
    assert in_place_plan(dag, cut, steps[cut], 0) is None
    assert in_place_plan(dag, cut, steps[cut], 0, [cut, destroy]) is None  # no steps to find readers
    assert in_place_plan(dag, cut, steps[cut], 0, [other, destroy], steps) is None  # not in the order
    done = in_place_plan(dag, cut, steps[cut], 0, [other, cut, destroy], steps)
    assert done is not None and done.build_after == cut and done.target.uid == part0
    # GPU 0 sends its old shard for the other part after the cut: the build waits for that send
    assert {m.src_worker for m in steps[other].messages} == {0} and not steps[other].local
    later = in_place_plan(dag, cut, steps[cut], 0, [cut, other, destroy], steps)
    assert later is not None and later.build_after == other
    # no later Destroy, or a Merge of the target in between: no
    assert in_place_plan(dag, cut, steps[cut], 0, [cut, other], steps) is None
    assert in_place_plan(dag, cut, steps[cut], 0, [cut, merge, destroy], steps) is None


def test_a_split_receiving_into_its_target_is_not_built_in_place() -> None:
    dag = _dag((2, 1, 1), (1, 1, 2))  # TP 2 -> two TP 1 replicas: GPU 0 receives the other half
    split, destroy = _node(dag, Split), _node(dag, Destroy)
    steps = _steps(dag, 0)
    assert cut_here(dag.nodes[split], steps[split].local, 0) is not None
    assert any(m.dst_worker == 0 for m in steps[split].messages)
    assert in_place_plan(dag, split, steps[split], 0, [split, destroy], steps) is None


# --- on hand-made nodes -----------------------------------------------------------------------------


def _emu(uid: str, tp: int, gpus: tuple[int, ...]) -> EMU:
    return EMU(uid=uid, state=STATE, layout=Layout(tp, 1), gpus=gpus, version=1)


DONOR = _emu("donor", 1, (0,))  # a whole replica on GPU 0
TARGET = _emu("target", 2, (0, 1))  # half of it on GPU 0
OTHER = _emu("other", 1, (1,))


def _slot(n: int, at: int, lengths: tuple[int, ...] | None = None, order: tuple[int, ...] = ()) -> Slot:
    lengths = lengths or (n,)
    return Slot(tensor="w", kind="param", dtype="float32", global_shape=lengths, offsets=(0,) * len(lengths),
                lengths=lengths, byte_offset=at, order=order)


def _copy(src_unit: str = "donor", dst_unit: str = "target", src: int = 0, dst: int = 0, n: int = 16,
          src_at: int = 1024, dst_at: int = 0) -> Piece:
    return Piece(src_worker=src, dst_worker=dst, src_slot=_slot(n, src_at), dst_slot=_slot(n, dst_at),
                 box=((0,), (n,)), src_unit=src_unit, dst_unit=dst_unit)


def _step(local: tuple[Piece, ...] = (), sent: tuple[Piece, ...] = ()) -> Step:
    msgs = tuple(Message(src_worker=p.src_worker, dst_worker=p.dst_worker, round=0, tag=i, pieces=(p,), layout=(0,),
                         length=p.num_bytes) for i, p in enumerate(sent))
    return Step(model_stage="actor-train", primitive="x", local=local, messages=msgs, predicted_s=0.0)


def _fake(*nodes: Primitive) -> TransitionDAG:
    return cast(TransitionDAG, SimpleNamespace(nodes=list(nodes)))


CUT = Split(unit=DONOR, parts=(TARGET,))  # frees nothing: a later Destroy must
READ = Extend(sources=(DONOR,), target=OTHER)
FREE = Destroy(unit=DONOR)


def test_the_build_waits_for_the_last_local_or_sent_read_of_the_donor() -> None:
    dag = _fake(CUT, READ, FREE)
    cut = _step(local=(_copy(),))
    for local, want in (((), 0), ((_copy(dst_unit="other", dst_at=4096),), 1)):  # no read, a local copy
        plan = in_place_plan(dag, 0, cut, 0, [0, 1, 2], {0: cut, 1: _step(local=local), 2: _step()})
        assert plan is not None and plan.build_after == want, local
    sends = _step(sent=(_copy(dst_unit="other", dst=1),))
    assert in_place_plan(dag, 0, cut, 0, [0, 1, 2], {0: cut, 1: sends, 2: _step()}).build_after == 1  # type: ignore[union-attr]
    # reads by another worker, or of another unit, are not this worker's reads of the donor
    theirs = _step(local=(_copy(src=1, dst=1),), sent=(_copy(src=1, dst=0), _copy(src_unit="x", dst=1)))
    assert in_place_plan(dag, 0, cut, 0, [0, 1, 2], {0: cut, 1: theirs, 2: _step()}).build_after == 0  # type: ignore[union-attr]
    # a reader whose step is not known is not waited for
    assert in_place_plan(dag, 0, cut, 0, [0, 1, 2], {0: cut, 2: _step()}).build_after == 0  # type: ignore[union-attr]
    # the node that frees the donor must not read it itself
    assert in_place_plan(dag, 0, cut, 0, [0, 1, 2], {0: cut, 1: _step(), 2: _step(local=(_copy(dst_unit="z"),))}) is None


def test_only_a_free_of_the_donor_ends_the_search() -> None:
    other_here = _emu("other0", 1, (0,))
    dag = _fake(CUT, Destroy(unit=other_here), READ, FREE)
    cut = _step(local=(_copy(),))
    reads = _step(local=(_copy(dst_unit="other", dst_at=4096),))
    plan = in_place_plan(dag, 0, cut, 0, [0, 1, 2, 3], {0: cut, 1: _step(), 2: reads, 3: _step()})
    assert plan is not None and plan.build_after == 2


def test_a_node_touching_the_target_or_merging_the_donor_in_between_rules_it_out() -> None:
    cut = _step(local=(_copy(),))
    for between in (Extend(sources=(TARGET,), target=OTHER),
                    Merge(parts=(DONOR,), unit=_emu("m", 1, (0,))),
                    Merge(parts=(_emu("q", 1, (0,)),), unit=TARGET)):
        dag = _fake(CUT, between, FREE)
        assert in_place_plan(dag, 0, cut, 0, [0, 1, 2], {0: cut, 1: _step(), 2: _step()}) is None, between
    # a node reading the donor (not merging it) is fine
    dag = _fake(CUT, READ, FREE)
    assert in_place_plan(dag, 0, cut, 0, [0, 1, 2], {0: cut, 1: _step(), 2: _step()}) is not None


def test_a_merge_freeing_its_donor_builds_right_after_itself() -> None:
    dag = _fake(Merge(parts=(DONOR,), unit=TARGET))
    plan = in_place_plan(dag, 0, _step(local=(_copy(),)), 0)
    assert plan is not None and (plan.node, plan.build_after, plan.donor, plan.target) == (0, 0, "donor", TARGET)
    assert plan.target_bytes == unit_buffer_bytes(TARGET, 0)


def test_a_receive_into_the_target_here_rules_it_out_but_not_one_elsewhere() -> None:
    dag = _fake(Merge(parts=(DONOR,), unit=TARGET))
    local = (_copy(),)
    assert in_place_plan(dag, 0, _step(local=local, sent=(_copy(src=1, dst=0, src_unit="x"),)), 0) is None
    assert in_place_plan(dag, 0, _step(local=local, sent=(_copy(src=1, dst=0, src_unit="x", dst_unit="y"),)), 0)
    assert in_place_plan(dag, 0, _step(local=local, sent=(_copy(src=0, dst=1),)), 0)


def test_a_target_bigger_than_its_donor_is_not_built_in_place() -> None:
    half, whole = _emu("donor", 2, (0, 1)), _emu("target", 1, (0,))
    assert unit_buffer_bytes(whole, 0) > unit_buffer_bytes(half, 0)
    assert in_place_plan(_fake(Merge(parts=(half,), unit=whole)), 0, _step(local=(_copy(),)), 0) is None


def test_a_target_as_big_as_its_donor_is_built_in_place() -> None:
    same = _emu("target", 1, (0,))
    assert unit_buffer_bytes(same, 0) == unit_buffer_bytes(DONOR, 0)
    plan = in_place_plan(_fake(Merge(parts=(DONOR,), unit=same)), 0, _step(local=(_copy(),)), 0)
    assert plan is not None and plan.target_bytes == unit_buffer_bytes(DONOR, 0)


def test_an_unsafe_compaction_order_rules_it_out() -> None:
    dag = _fake(Merge(parts=(DONOR,), unit=TARGET))
    assert in_place_plan(dag, 0, _step(local=(_copy(src_at=0, dst_at=64),)), 0) is None


def test_cut_here_wants_local_copies_from_one_unit_held_here_into_the_only_target_here() -> None:
    two = Split(unit=DONOR, parts=(TARGET, _emu("t2", 1, (0,))))
    assert cut_here(CUT, [_copy()], 0) == (DONOR, TARGET)
    assert cut_here(CUT, [], 0) is None
    assert cut_here(CUT, [_copy(), _copy(dst_unit="t2")], 0) is None  # two pairs
    assert cut_here(CUT, [_copy(src=1)], 0) is None  # received, not local
    assert cut_here(CUT, [_copy(src_unit="other")], 0) is None  # not from a source of the node
    assert cut_here(Split(unit=DONOR, parts=(TARGET,)), [_copy(src=1, dst=1)], 1) is None  # donor not on GPU 1
    assert cut_here(two, [_copy()], 0) is None  # two targets on GPU 0
    assert cut_here(Split(unit=DONOR, parts=(OTHER, TARGET)), [_copy()], 0) == (DONOR, TARGET)
    assert cut_here(Split(unit=DONOR, parts=(_emu("t3", 1, (0,)),)), [_copy()], 0) is None  # another target
    # a Merge whose part already in final shape sits here: the target exists before the copies
    final_here = EMU(uid="fp", state=STATE, layout=Layout(1, 1), gpus=(0,), version=2, final=TARGET)
    final_there = EMU(uid="fp", state=STATE, layout=Layout(1, 1), gpus=(1,), version=2, final=TARGET)
    assert cut_here(Merge(parts=(DONOR, final_here), unit=TARGET), [_copy()], 0) is None
    assert cut_here(Merge(parts=(DONOR, final_there), unit=TARGET), [_copy()], 0) == (DONOR, TARGET)
    assert cut_here(Merge(parts=(DONOR, _emu("np", 1, (0,))), unit=TARGET), [_copy()], 0) == (DONOR, TARGET)


# --- the forward order ------------------------------------------------------------------------------


def _rows(rows: int, cols: int, src_cols: int, src_at: int, dst_at: int, dtype: str = "float32") -> Piece:
    """rows x cols at the start of a rows x src_cols donor slot, into a rows x cols target slot."""
    src = Slot(tensor="w", kind="param", dtype=dtype, global_shape=(rows, src_cols), offsets=(0, 0),
               lengths=(rows, src_cols), byte_offset=src_at)
    dst = Slot(tensor="w", kind="param", dtype=dtype, global_shape=(rows, src_cols), offsets=(0, 0),
               lengths=(rows, cols), byte_offset=dst_at)
    return Piece(src_worker=0, dst_worker=0, src_slot=src, dst_slot=dst, box=((0, 0), (rows, cols)),
                 src_unit="a", dst_unit="b")


def test_forward_order_sorts_by_destination_and_allows_touching_bounds() -> None:
    a, b = _copy(n=16, src_at=64, dst_at=0), _copy(n=16, src_at=128, dst_at=64)  # a ends where b is read
    assert _forward_order([b, a]) == (a, b)
    assert _forward_order([_copy(n=16, src_at=64, dst_at=64)]) is not None  # already in place
    assert _forward_order([_copy(n=16, src_at=60, dst_at=64)]) is None  # a destination ahead of its source
    # the first ends exactly where the second (in place) is read, then one element past it
    assert _forward_order([_copy(n=16, src_at=68, dst_at=0), _copy(n=16, src_at=64, dst_at=64)]) is not None
    assert _forward_order([_copy(n=17, src_at=68, dst_at=0), _copy(n=16, src_at=64, dst_at=64)]) is None
    assert _forward_order([]) == ()


def test_forward_order_wants_rows_no_longer_than_the_source_pitch() -> None:
    # a column split: 8-byte rows out of a 16-byte pitch
    assert _forward_order([_rows(4, 2, 4, 0, 0)]) is not None
    # whole rows: row length equals the pitch
    assert _forward_order([_rows(4, 4, 4, 0, 0)]) is not None
    # a destination slot wider than the box: not one run
    wide = _rows(4, 2, 4, 0, 0)
    wide = Piece(src_worker=0, dst_worker=0, src_slot=wide.src_slot, dst_slot=wide.src_slot, box=wide.box,
                 src_unit="a", dst_unit="b")
    assert _forward_order([wide]) is None


def test_forward_order_reads_rows_along_the_stored_first_dim() -> None:
    # a row-parallel slot stored column-major: the "rows" are its columns
    src = _slot(0, 0, lengths=(4, 8), order=(1, 0))
    dst = _slot(0, 0, lengths=(2, 8), order=(1, 0))
    p = Piece(src_worker=0, dst_worker=0, src_slot=src, dst_slot=dst, box=((0, 0), (2, 8)), src_unit="a",
              dst_unit="b")  # 8 stored columns of 2 of 4 rows: 8 bytes out of a 16-byte pitch
    assert _forward_order([p]) == (p,)
    ahead = Piece(src_worker=0, dst_worker=0, src_slot=src, dst_slot=_slot(0, 8, lengths=(2, 8), order=(1, 0)),
                  box=((0, 0), (2, 8)), src_unit="a", dst_unit="b")
    assert _forward_order([ahead]) is None


def test_forward_order_refuses_a_row_that_is_not_one_run_in_the_source() -> None:
    # 3-D: a row (1 x 2 x 2 of a 4 x 3 plane) cut in its last dim is strided in the source
    src = Slot(tensor="w", kind="param", dtype="float32", global_shape=(2, 4, 3), offsets=(0, 0, 0),
               lengths=(2, 4, 3), byte_offset=0)
    dst = Slot(tensor="w", kind="param", dtype="float32", global_shape=(2, 4, 3), offsets=(0, 0, 0),
               lengths=(2, 2, 2), byte_offset=0)
    p = Piece(src_worker=0, dst_worker=0, src_slot=src, dst_slot=dst, box=((0, 0, 0), (2, 2, 2)), src_unit="a",
              dst_unit="b")
    assert _forward_order([p]) is None
    whole_inner = Slot(tensor="w", kind="param", dtype="float32", global_shape=(2, 4, 3), offsets=(0, 0, 0),
                       lengths=(2, 2, 3), byte_offset=0)
    q = Piece(src_worker=0, dst_worker=0, src_slot=src, dst_slot=whole_inner, box=((0, 0, 0), (2, 2, 3)),
              src_unit="a", dst_unit="b")  # rows of 2 x 3 out of a 4 x 3 pitch: one run each
    assert _forward_order([q]) == (q,)
