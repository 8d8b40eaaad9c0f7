"""Which early builds a worker makes and what they copy (transitions.early_builds), term by term:
each rejection of a candidate node, the reader list, the redirect on both ends and the runs an
early build copies. Pure, no processes.

Most cases are hand-made DAGs: the primitives of a TP 1 x DP 2 -> TP 2 x DP 2 change (GPUs 0, 1 ->
(0, 1), (2, 3); test_early_builds_cases), reordered or joined by a few extra primitives (a Destroy, an
Extend, a Split of the same units), with footprints derived from the primitives
(footprints.derive_footprint). ``early_builds`` takes any DAG; what each case expects follows from
the rule in its docstring: a node that cuts its only target here from one unit held since the start,
whose donor a later node frees here, builds early when the nodes up to that free that read the donor
here read only bytes the target keeps, and the first of them comes before it; no node but the free
may free the donor, take it as a Merge part, or make, free or merge the target in that window."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_early_builds_cases import _dag, _plan

from planner.plan import Layout
from transitions import early_builds as eb_module
from transitions.dag_pieces import DagMemo, node_pieces
from transitions.dag_record import TransitionDAG, gpu_index
from transitions.early_builds import build_pieces, early_builds, redirected
from transitions.footprints import derive_footprint
from transitions.layout import COUNTERS, Slot, contiguous_range, unit_slots
from transitions.primitives import Destroy, Extend, Merge, Primitive, Split
from transitions.transfer_plan import Piece

# 0 Merge(v1#0, v1#1 -> v2#0 on (0, 1)), frees both; 1 Extend(v1#0 -> v2#1.p0.0 on 2);
# 2 Extend(v1#1 -> v2#1.p1.0 on 3); 3 Merge(the two parts -> v2#1 on (2, 3)), a relabel
BASE = _dag(_plan(1, 1, [[0], [1]]), _plan(2, 2, [[0, 1], [2, 3]]))
MERGE0, EXT1, EXT2, MERGE3 = BASE.nodes
assert isinstance(MERGE0, Merge) and isinstance(EXT1, Extend)
V10, V11 = MERGE0.parts  # TP 1 replicas on GPU 0 and GPU 1: everything on one GPU
V20 = MERGE0.unit  # TP 2 on (0, 1): GPU 0 keeps the first half of each split tensor, GPU 1 the second
P00 = EXT1.target  # the part of v2#1 on GPU 2: the first half, like v2#0 on GPU 0
# more units of the same model-stage: OTHER (TP 2 on (0, 1)) and OTHER2 (TP 2 on (1, 0)) held since the start
OTHER = replace(V20, uid="actor-train@v1#8", version=1)
OTHER2 = replace(V20, uid="actor-train@v1#9", version=1, gpus=(1, 0))
Z = replace(V10, uid="actor-train@v3#9", version=3)  # a whole copy on GPU 0
ZH = replace(V20, uid="actor-train@v3#1", version=3)  # laid out as v2#0
V30 = replace(V20, uid="actor-train@v3#0", version=3)  # laid out as v2#0


def _dag_of(nodes: list[Primitive], order: list[int]) -> TransitionDAG:
    fps = tuple(derive_footprint(p) for p in nodes)
    body = replace(BASE.body, nodes=tuple(nodes), footprints=fps, order=tuple(order),
                   gpu_nodes=gpu_index(list(fps), tuple(order)))
    return TransitionDAG(old_version=1, new_version=2, capacity_bytes=BASE.capacity_bytes, body_=body)


def _builds(dag: TransitionDAG) -> dict[int, dict[int, tuple[str, str, tuple[int, ...], int]]]:
    memo = DagMemo()
    return {w: {n: (b.donor, b.target.uid, b.readers, b.frees_at) for n, b in early_builds(dag, w, memo).items()}
            for w in sorted(dag.gpu_nodes)}


# the base DAG's builds: GPU 0 (1) builds v2#0 from v1#0 (v1#1) at the Merge, before the Extend
# sending the first (second) half, which is what GPU 0 (1) keeps of v2#0
BASE_BUILDS = {0: {0: ("actor-train@v1#0", "actor-train@v2#0", (1,), 0)},
               1: {0: ("actor-train@v1#1", "actor-train@v2#0", (2,), 0)}, 2: {}, 3: {}}


def test_the_base_change_builds_at_the_merge_on_both_old_gpus() -> None:
    assert _builds(BASE) == BASE_BUILDS
    assert _builds(_dag_of(list(BASE.nodes), [1, 2, 3, 0])) == BASE_BUILDS  # the rebuild changes nothing


def test_a_target_freed_before_the_donor_is_freed_builds_nothing() -> None:
    # a Destroy of v2#0 (on GPUs 0 and 1) between the Extends and the Merge: the target is touched
    # in the window, so neither old GPU builds it early
    dag = _dag_of([*BASE.nodes, Destroy(unit=V20)], [1, 2, 4, 3, 0])
    assert _builds(dag) == {0: {}, 1: {}, 2: {}, 3: {}}


def test_nodes_after_the_donors_free_do_not_count() -> None:
    # the same Destroy of the target right after the Merge that frees the donor: outside the window
    dag = _dag_of([*BASE.nodes, Destroy(unit=V20)], [1, 2, 3, 0, 4])
    assert _builds(dag) == BASE_BUILDS


def test_a_donor_freed_by_another_node_first_is_not_built_from() -> None:
    # v1#0 destroyed (on GPU 0) before the Merge: GPU 0 cannot build from it; GPU 1 still builds
    dag = _dag_of([*BASE.nodes, Destroy(unit=V10)], [1, 2, 4, 3, 0])
    assert _builds(dag) == {0: {}, 1: BASE_BUILDS[1], 2: {}, 3: {}}


def test_an_extend_builds_early_when_a_later_destroy_frees_its_donor() -> None:
    # node 1 builds v2#0 as an Extend (frees nothing) from v1#0 on GPU 0, v1#1 on GPU 1; a Destroy of
    # another unit on GPU 0 (node 3) comes before the Destroy of v1#0 (node 2): the build's free is
    # node 2; the reader is the Extend sending the first half (node 0), before it (or after it: the
    # target is then built at the reader, still from the donor)
    e = Extend(sources=(V10, V11), target=V20)
    nodes = [EXT1, e, Destroy(unit=V10), Destroy(unit=OTHER)]
    for order in ([0, 1, 3, 2], [1, 0, 3, 2], [1, 3, 0, 2]):
        assert _builds(_dag_of(nodes, order)) == {0: {1: ("actor-train@v1#0", "actor-train@v2#0", (0,), 2)},
                                                  1: {}, 2: {}}, order
    # GPU 1: v1#1 is never freed there (nor read by another node): nothing to build early
    # without any free of v1#0 on GPU 0 nothing is built there either
    assert _builds(_dag_of([EXT1, e], [0, 1])) == {0: {}, 1: {}, 2: {}}


def test_a_donor_merged_as_a_part_later_is_built_from_by_that_merge_only() -> None:
    # node 1 (an Extend) cuts v2#0 from v1#0, but node 2, a Merge of v1#0 and v1#1 into v3#0 (laid out
    # as v2#0), frees v1#0 here as one of its parts: no early build at node 1. Node 2 cuts v3#0 from
    # v1#0 and frees it: the Extend sending the first half (0) and node 1's local copy of the first
    # half (a read of the donor by another node) come first and read only what v3#0 keeps
    e = Extend(sources=(V10, V11), target=V20)
    dag = _dag_of([EXT1, e, Merge(parts=(V10, V11), unit=V30)], [0, 1, 2])
    assert _builds(dag) == {0: {2: ("actor-train@v1#0", "actor-train@v3#0", (0, 1), 2)},
                            1: {2: ("actor-train@v1#1", "actor-train@v3#0", (1,), 2)}, 2: {}}


def test_a_local_copy_of_bytes_the_target_drops_stops_the_build() -> None:
    # an Extend copying all of v1#0 into Z on GPU 0 between the sending Extend and the Merge: it reads
    # the half v2#0 does not keep, so GPU 0 builds nothing early (GPU 1's Merge has no reader there);
    # the same copy after the Merge (outside the window) leaves the build as it is
    nodes = [MERGE0, EXT1, Extend(sources=(V10,), target=Z)]
    assert _builds(_dag_of(nodes, [1, 2, 0])) == {0: {}, 1: {}, 2: {}}
    assert _builds(_dag_of(nodes, [1, 0, 2])) == {0: {0: ("actor-train@v1#0", "actor-train@v2#0", (1,), 0)},
                                                  1: {}, 2: {}}


def test_rejected_candidates_before_the_build_do_not_stop_the_search() -> None:
    # first on GPU 0: an Extend filling Z from two units held here (OTHER's first half, OTHER2's second:
    # no single donor) and an Extend cutting ZH from OTHER, which nothing frees; the Merge still builds
    k3 = Extend(sources=(OTHER, OTHER2), target=Z)
    k = Extend(sources=(OTHER,), target=ZH)
    dag = _dag_of([*BASE.nodes, k3, k], [4, 5, 1, 2, 3, 0])
    assert dag.nodes_on(0)[:2] == [4, 5]
    assert _builds(dag) == BASE_BUILDS


# a Split of v1#0 into P0 (a part of v2#0 on GPU 0: the first half) and P00 (on GPU 2: the first half
# too): GPU 0 keeps P0 and sends P00 the same half; the Extend to GPU 2 before it reads that half too
P0 = replace(P00, uid="actor-train@v2#0.p0.0", gpus=(0,), final=V20)
SPLIT = _dag_of([EXT1, Split(unit=V10, parts=(P0, P00)), Destroy(unit=V10)], [0, 1, 2])


def test_a_split_that_sends_what_it_keeps_reads_from_its_own_target() -> None:
    memo = DagMemo()
    assert {n: (b.donor, b.target.uid, b.readers, b.frees_at) for n, b in early_builds(SPLIT, 0, memo).items()} == \
        {1: ("actor-train@v1#0", P0.uid, (0, 1), 2)}
    pieces = node_pieces(SPLIT, 1, 0, memo)
    sends = [p for p in pieces if p.dst_worker == 2]
    copies = [p for p in pieces if p.dst_worker == 0]
    assert sends and copies and len(sends) + len(copies) == len(pieces)
    assert pieces[0] in copies and pieces[1] in sends  # the counters come first: P0's, then P00's
    # the build does the local copies; the sends read P0's slots instead of v1#0's
    slots = unit_slots(P0, 0)
    want = [replace(p, src_unit=P0.uid, src_slot=slots[p.src_slot.key]) for p in sends]
    for worker in (0, 2):  # the receiver derives the same
        got = redirected(SPLIT, 1, worker, list(node_pieces(SPLIT, 1, worker, memo)), memo)
        assert got == want
    # what the build copies: every local piece into P0, none of the sends
    runs, strided = build_pieces(SPLIT, 1, 0, P0.uid, memo)
    assert strided == ()
    assert sum(n for _, _, n in runs) == sum(p.num_bytes for p in copies)
    for p in copies:
        src, dst = contiguous_range(p.src_slot, p.box), contiguous_range(p.dst_slot, p.box)
        assert src is not None and dst is not None
        assert any(s <= src[0] and src[1] <= s + n and dst[0] - src[0] == d - s for s, d, n in runs)


def test_a_strided_local_piece_is_copied_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    # real local pieces are contiguous on both sides; a made-up pair of pieces of the embedding (a
    # row-major (vocab, hidden) slot on GPU 0): two rows, half of their columns, from the whole
    # tensor into a slot exactly that box (strided on the source only), then from a slot exactly
    # the box into the whole tensor (strided on the target only), then a whole row after them
    (build,) = early_builds(BASE, 0, DagMemo()).values()
    key = ("model.embed_tokens.weight", "param")
    whole: Slot = unit_slots(V10, 0)[key]
    vocab, hidden = whole.lengths
    box = ((0, 0), (2, hidden // 2))
    exact = replace(whole, offsets=box[0], lengths=box[1])
    assert contiguous_range(whole, box) is None and contiguous_range(exact, box) is not None
    kw = dict(src_worker=0, dst_worker=0, src_unit=V10.uid, dst_unit=build.target.uid)
    one = Piece(src_slot=whole, dst_slot=exact, box=box, **kw)  # type: ignore[arg-type]
    two = Piece(src_slot=exact, dst_slot=whole, box=box, **kw)  # type: ignore[arg-type]
    row = Piece(src_slot=whole, dst_slot=whole, box=((3, 0), (1, hidden)), **kw)  # type: ignore[arg-type]
    monkeypatch.setattr(eb_module, "node_pieces", lambda dag, node, worker, memo: (one, two, row))
    start = whole.byte_offset + 3 * hidden * whole.element_bytes
    assert build_pieces(BASE, build.node, 0, build.target.uid, DagMemo()) == \
        (((start, start, hidden * whole.element_bytes),), (one, two))



def test_counters_copied_from_another_unit_make_no_single_donor() -> None:
    # T: PP 2 on (0, 1), GPU 0 holds stage 0 (embedding, layers 0, 1). Node 1 fills it from U (PP 2 on
    # (1, 0): stage 1 on GPU 0) then v1#0: on GPU 0 U holds none of stage 0, so every byte is copied
    # from v1#0, but the counters come from U, the first source held here: two units copied from,
    # no early build. Node 0 sends stage 0 from v1#0 on GPU 0 to a part on GPU 2 (only what T keeps
    # on GPU 0), node 2 frees v1#0. The same with v1#0 as the only source: an early build.
    u = replace(V10, uid="actor-train@v1#4", layout=Layout(1, 2), gpus=(1, 0))
    t = replace(V10, uid="actor-train@v3#5", version=3, layout=Layout(1, 2), gpus=(0, 1))
    part = replace(V10, uid="actor-train@v3#6.p0", version=3, gpus=(2,), final=replace(t, gpus=(2, 3)))
    send = Extend(sources=(V10,), target=part)
    dag = _dag_of([send, Extend(sources=(u, V10), target=t), Destroy(unit=V10)], [0, 1, 2])
    memo = DagMemo()
    assert {p.src_unit for p in node_pieces(dag, 1, 0, memo) if p.dst_worker == 0} == {u.uid, V10.uid}
    assert {p.src_unit for p in node_pieces(dag, 1, 0, memo) if p.dst_worker == 0 and p.dst_slot.tensor != COUNTERS} \
        == {V10.uid}
    assert _builds(dag)[0] == {}
    mine = replace(V10, uid="actor-train@v3#5.p0", version=3, gpus=(0,), final=t)  # T's stage 0 alone
    dag = _dag_of([send, Extend(sources=(V10,), target=mine), Destroy(unit=V10)], [0, 1, 2])
    assert _builds(dag)[0] == {1: (V10.uid, mine.uid, (0,), 2)}


def test_a_node_copying_only_the_donors_counters_reads_the_donor() -> None:
    # D: PP 2 on (0, 1), GPU 0 holds the embedding and layers 0, 1. An Extend (node 0) fills a part on
    # GPU 0 of a PP 2 unit whose stage 1 (layers 2, 3, norm, head) sits there, from D then v1#0: D
    # holds none of that on GPU 0, v1#0 copies it all, but the counters come from D, the first
    # source held here. Node 1 copies D into TD (D's layout) here, node 2 frees D: node 0 is TD's
    # reader on GPU 0 (the counters are in TD too)
    d = replace(V10, uid="actor-train@v1#5", layout=Layout(1, 2), gpus=(0, 1))
    final = replace(d, uid="actor-train@v3#4", version=3, gpus=(1, 0))
    part = replace(V10, uid="actor-train@v3#4.p1", version=3, gpus=(0,), final=final)
    td = replace(d, uid="actor-train@v3#3", version=3)
    dag = _dag_of([Extend(sources=(d, V10), target=part), Extend(sources=(d,), target=td), Destroy(unit=d)],
                  [0, 1, 2])
    memo = DagMemo()
    assert {(p.src_worker, p.dst_slot.tensor) for p in node_pieces(dag, 0, 0, memo) if p.src_unit == d.uid} == \
        {(0, COUNTERS)}
    assert _builds(dag) == {0: {1: (d.uid, td.uid, (0,), 2)}, 1: {}}


def test_a_readers_pieces_from_another_unit_keep_their_source() -> None:
    # node 0 fills Z (all of it, GPU 0) from P0 (a part on GPU 0 holding v2#0's first half) and then
    # v1#0, which gives the second half; node 1 cuts T7 (TP 2 on (1, 0): GPU 0 keeps the second
    # half) from v1#0 here, node 2 frees v1#0: node 0 reads from v1#0 only what T7 keeps
    t7 = replace(V20, uid="actor-train@v3#7", version=3, gpus=(1, 0))
    dag = _dag_of([Extend(sources=(P0, V10), target=Z), Extend(sources=(V10, V11), target=t7), Destroy(unit=V10)],
                  [0, 1, 2])
    assert _builds(dag)[0] == {1: (V10.uid, t7.uid, (0,), 2)}
    memo = DagMemo()
    pieces = list(node_pieces(dag, 0, 0, memo))
    assert {p.src_unit for p in pieces} == {P0.uid, V10.uid}
    slots = unit_slots(t7, 0)
    assert redirected(dag, 0, 0, pieces, memo) == [
        replace(p, src_unit=t7.uid, src_slot=slots[p.src_slot.key]) if p.src_unit == V10.uid else p for p in pieces]
