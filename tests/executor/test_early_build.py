"""Early builds from moved pages (CPU): a worker that cuts its new TP shard from the replica it
gives up builds it before the nodes that send from the old replica, by moving the old buffer's pages
(row-parallel weights are stored column-major, so every TP shard is one run), and sends from it as
one zero-copy message. Both ends must derive that same message; a failure must give the old replica
its pages back; the state must stay bit-exact end to end over real gloo."""

from __future__ import annotations

import pytest
import torch
from executor_helpers import assert_same_state, logical_state

from agent.coordinator import LocalCoordinator
from planner.hardware import cluster_preset
from planner.models import Head, ModelSpec
from planner.plan import GlobalPlan, Layout, StagePlan
from planner.workflow import ACTOR_TRAIN
from transitions.dag_pieces import DagMemo, node_pieces
from transitions.early_builds import early_builds
from transitions.executor import allocate_unit
from transitions.executor.buffers import piece_view
from transitions.executor.early_build import build_early
from transitions.geometry import TRAINING_KINDS
from transitions.global_dag import TransitionDAG, build_transition
from transitions.layout import PAGE_BYTES, StagePlacement, contiguous_range, rank_slots, unit_buffer_bytes
from transitions.local_dag import plan_units
from transitions.node_steps import node_step
from transitions.scenarios import stage_states

MEMO = DagMemo()  # the tests' own: what a worker derives from each DAG

# big enough that every weight's shard spans whole pages (page moves), small enough for 4 processes
PAGED = ModelSpec(name="paged", num_layers=2, hidden_size=128, num_attention_heads=4, num_kv_heads=2,
                  head_dim=32, ffn_hidden_size=512, vocab_size=256, rope_theta=10_000.0)
STATES = stage_states(PAGED, (ACTOR_TRAIN,))
CLUSTER = cluster_preset("cpu", 4)
TIMEOUT_S = 6.0


def _plan(version: int, tp: int, sets: list[list[int]]) -> GlobalPlan:
    return GlobalPlan(version=version, stages=(StagePlan(model_stage="actor-train", layout=Layout(tp, 1),
                                                         gpu_sets=tuple(map(tuple, sets)), micro_batch_size=1),))


OLD, NEW = _plan(1, 1, [[0], [1]]), _plan(2, 2, [[0, 1], [2, 3]])  # TP1 x DP2 -> TP2 x DP2


def _dag() -> TransitionDAG:
    return build_transition(STATES, CLUSTER, OLD, NEW)


def _old_units() -> list:
    return [u for sp in OLD for u in plan_units(STATES[sp.model_stage], sp, 1)]


def test_row_parallel_weights_are_stored_column_major_so_tp_shards_are_runs() -> None:
    full = StagePlacement(model_stage="s", model=PAGED, head=Head.LM, kinds=TRAINING_KINDS,
                          layout=Layout(1, 1), gpu_sets=((0,),))
    half = StagePlacement(model_stage="s", model=PAGED, head=Head.LM, kinds=TRAINING_KINDS,
                          layout=Layout(2, 1), gpu_sets=((0, 1),))
    slots = {s.key: s for s in rank_slots(full, 0)[0]}
    o_proj = slots[("model.layers.0.self_attn.o_proj.weight", "master")]
    q_proj = slots[("model.layers.0.self_attn.q_proj.weight", "master")]
    assert o_proj.order == (1, 0) and q_proj.order == ()
    assert o_proj.byte_offset % PAGE_BYTES == 0  # big slots start on a page
    # TP rank 1 of a row-parallel weight (its second half of columns) is one run of the TP1 buffer,
    # holding exactly those columns, column by column
    state = allocate_unit(plan_units(STATES["actor-train"], OLD.stages[0], 1)[0], 0, torch.device("cpu"))
    logical = torch.randn(o_proj.lengths)
    state.view(*o_proj.key).copy_(logical)
    rank1 = {s.key: s for s in rank_slots(half, 1)[0]}[o_proj.key]
    start, end = contiguous_range(o_proj, (rank1.offsets, rank1.lengths))  # type: ignore[misc]
    cols = rank1.lengths[1]
    run = state.flat[start:end].view(torch.float32).view(cols, rank1.lengths[0])
    assert torch.equal(run, logical[:, rank1.offsets[1]:].t())


def test_senders_build_early_and_both_ends_derive_one_message() -> None:
    dag = _dag()
    for sender, receiver in ((0, 2), (1, 3)):
        (build,) = early_builds(dag, sender, MEMO).values()
        assert build.donor.endswith(f"v1#{sender}") and build.target.uid.endswith("v2#0")
        (reader,) = build.readers
        mine = node_step(dag, reader, sender, MEMO, early=True).messages
        theirs = node_step(dag, reader, receiver, MEMO, early=True).messages
        assert mine == theirs  # the receiver derived the sender's early build on its own
        (message,) = mine
        assert message.direct and message.length == unit_buffer_bytes(build.target, sender)
        # without early builds the same node packs strided halves into many messages
        assert len(node_step(dag, reader, sender, MEMO).messages) > 1
        # the building node has nothing left to copy: the build made its pieces
        assert not node_step(dag, build.node, sender, MEMO, early=True).local
    assert early_builds(dag, 2, MEMO) == {} and early_builds(dag, 3, MEMO) == {}


def test_early_build_moves_pages_copies_nothing_and_undo_restores_the_donor() -> None:
    dag = _dag()
    (build,) = early_builds(dag, 0, MEMO).values()
    donor = allocate_unit(next(u for u in _old_units() if u.uid == build.donor), 0, torch.device("cpu"))
    donor.flat.copy_(torch.randint(0, 256, donor.flat.shape, generator=torch.Generator().manual_seed(3),
                                   dtype=torch.uint8))
    original = donor.flat.clone()
    units = {build.donor: donor}
    done = build_early(build, units, dag, MEMO)
    target = units[build.target.uid]
    # the target holds exactly what copying its pieces from an untouched donor gives
    pristine = allocate_unit(next(u for u in _old_units() if u.uid == build.donor), 0, torch.device("cpu"))
    pristine.flat.copy_(original)
    for p in node_pieces(dag, build.node, 0, MEMO):
        if p.dst_worker == 0 and p.dst_unit == build.target.uid:
            got, want = piece_view(target, p.dst_slot, p.box), piece_view(pristine, p.src_slot, p.box)
            assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)), p.dst_slot.key
    # every byte either changed buffers as part of a page or was copied; here most were moved (slots
    # under PAGE_ALIGN_MIN_BYTES, the counters and ragged ends are copied; tiny-25m moves them all)
    pieces = sum(p.num_bytes for p in node_pieces(dag, build.node, 0, MEMO)
                 if p.dst_worker == 0 and p.dst_unit == build.target.uid)
    assert done.moved_bytes + done.copied == pieces and done.moved_bytes > 0.75 * pieces
    # moved, not copied: the donor no longer holds those bytes (its emptied pages read zero)
    dst, src, n = done.moved[0]
    offset = src - donor.flat.data_ptr()
    assert not torch.equal(donor.flat[offset: offset + n], original[offset: offset + n])
    assert int(donor.flat[offset: offset + n].count_nonzero()) == 0
    done.undo()
    assert torch.equal(donor.flat, original)  # every page back: the old replica is whole again


@pytest.mark.multiprocess
@pytest.mark.xdist_group("executor-early-build")
def test_tp_change_with_early_builds_is_exact_and_moves_pages() -> None:
    dag = _dag()
    with LocalCoordinator(4, timeout_s=TIMEOUT_S) as pool:
        pool.form_generation()
        pool.init_units(_old_units(), seed=9)
        before = logical_state(pool.dump())
        outcome = pool.run_dag(dag, CLUSTER)
        assert outcome.committed, outcome.errors
        after = logical_state(pool.dump())
    assert_same_state(before, after)
    for sender in (0, 1):
        built = [r for r in outcome.reports[sender] if r.in_place]
        assert len(built) == 1 and built[0].bytes_remapped > 0
        sent = [r for r in outcome.reports[sender] if r.bytes_sent]
        assert sum(r.pack_s for r in sent) == 0.0  # nothing packed: one message straight from the new unit


@pytest.mark.multiprocess
@pytest.mark.xdist_group("executor-early-build")
@pytest.mark.parametrize("in_place", [False, True])
def test_receiver_killed_after_an_early_build_gives_the_donor_back(in_place: bool) -> None:
    """Worker 2 dies before receiving: worker 0 had built its new shard from the old replica's pages
    (in place) or was about to send from the old replica (not): either way it must end up holding
    the old replica whole, so nothing is lost."""
    from agent.worker import held_units

    dag = _dag()
    with LocalCoordinator(4, timeout_s=TIMEOUT_S) as pool:
        pool.form_generation()
        pool.init_units(_old_units(), seed=11)
        before = logical_state(pool.dump())
        outcome = pool.run_dag(dag, CLUSTER, kill_at={2: ("actor-train", 0)}, in_place=in_place)
        assert not outcome.committed and outcome.dead_workers == (2,)
        held = pool.call(held_units)
        survivors = logical_state(pool.dump([0]))
    assert held[0] == ["actor-train@v1#0"]
    assert not outcome.needs_checkpoint and not outcome.lost
    assert_same_state(before, survivors)  # worker 0 alone holds the whole state again, bit for bit
