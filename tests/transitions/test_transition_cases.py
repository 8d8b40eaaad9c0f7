"""Hand-checked transitions with exact expected offsets: TP 2->4, TP 4->3 (uneven), PP 2->1, DP 2->4,
plus GPU loss, weight sync, buckets, serialisation and the infeasible / last-copy errors."""

from __future__ import annotations

import json

import pytest

from planner.errors import InfeasibleError
from planner.hardware import CPU, IB_NDR, NVLINK4, ClusterSpec
from planner.models import ModelSpec
from planner.plan import GlobalPlan, Layout
from planner.workflow import ACTOR_GEN, ACTOR_TRAIN, REF_INF
from transitions.cost import transition_cost
from transitions.geometry import StateKind
from transitions.global_dag import TransitionDAG, build_transition, build_weight_sync
from transitions.layout import Slot
from transitions.local_dag import LastCopyLostError
from transitions.pieces import pieces, transfers
from transitions.planning_cache import PlanningCache
from transitions.primitives import Destroy, Extend, Merge, Split
from transitions.replay import replay
from transitions.scenarios import stage_plan, stage_states
from transitions.transfer_plan import Piece, messages

# 12 heads (MHA), 4 layers, vocab 10: TP 2, 3, 4 all valid; vocab 10 is uneven over 3 and 4.
MHA = ModelSpec(name="mha12", num_layers=4, hidden_size=24, num_attention_heads=12, num_kv_heads=12,
                head_dim=2, ffn_hidden_size=36, vocab_size=10)
CLUSTER = ClusterSpec(device=CPU, num_nodes=2, gpus_per_node=4, intra_node_link=NVLINK4,
                      inter_node_link=IB_NDR)
STATES = stage_states(MHA, (ACTOR_GEN, REF_INF, ACTOR_TRAIN))
Q0 = "model.layers.0.self_attn.q_proj.weight"
O0 = "model.layers.0.self_attn.o_proj.weight"
EMB = "model.embed_tokens.weight"


def _plans(old: tuple[int, int, list[int], int], new: tuple[int, int, list[int], int],
           stage: str = "actor-train") -> tuple[GlobalPlan, GlobalPlan]:
    def plan(version: int, spec: tuple[int, int, list[int], int]) -> GlobalPlan:
        tp, pp, gpus, dp = spec
        return GlobalPlan(version=version, stages=(stage_plan(stage, Layout(tp, pp), gpus, dp),))
    return plan(1, old), plan(2, new)


def _remote(dag: TransitionDAG, tensor: str, kind: StateKind = StateKind.PARAM) -> list[tuple[int, ...]]:
    """(src gpu, dst gpu, global row/col offset, length, src offsets..., dst offsets...) per transfer."""
    out = []
    for prim in dag.nodes:
        for t in transfers(prim):
            if t.tensor == tensor and StateKind(t.kind) is kind:
                out.append((t.src_worker, t.dst_worker, t.offsets, t.lengths, t.src_offsets, t.dst_offsets))
    return sorted(out)


def _local(dag: TransitionDAG, tensor: str) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    out = []
    for prim in dag.nodes:
        for t in pieces(prim):
            if t.tensor == tensor and StateKind(t.kind) is StateKind.PARAM and t.is_local:
                out.append((t.dst_worker, t.offsets, t.lengths))
    return sorted(out)


def test_tp_2_to_4_on_the_same_gpus() -> None:
    old, new = _plans((2, 1, [0, 1, 2, 3], 2), (4, 1, [0, 1, 2, 3], 1))
    dag = build_transition(STATES, CLUSTER, old, new)
    replay(dag)
    # q (24 rows): TP4 rank r needs rows [6r, 6r+6). GPU0 holds [0,12), GPU1 [12,24) of unit 0;
    # GPU2 [0,12), GPU3 [12,24) of unit 1. GPUs 0 and 3 have theirs already.
    assert _remote(dag, Q0) == [
        (0, 1, (6, 0), (6, 24), (6, 0), (0, 0)),
        (1, 2, (12, 0), (6, 24), (0, 0), (0, 0)),
    ]
    assert _local(dag, Q0) == [(0, (0, 0), (6, 24)), (3, (18, 0), (6, 24))]
    # o_proj is a row split: the same pattern along columns
    assert _remote(dag, O0) == [
        (0, 1, (0, 6), (24, 6), (0, 6), (0, 0)),
        (1, 2, (0, 12), (24, 6), (0, 0), (0, 0)),
    ]
    # every state kind moves with the same geometry; the training unit holds four kinds
    assert len(_remote(dag, Q0, StateKind.EXP_AVG_SQ)) == 2
    kinds = sorted({type(p).__name__ for p in dag.nodes})
    assert kinds == ["Destroy", "Extend", "Merge"]


def test_tp_4_to_3_uneven_vocab() -> None:
    old, new = _plans((4, 1, [0, 1, 2, 3], 1), (3, 1, [0, 1, 2], 1))
    dag = build_transition(STATES, CLUSTER, old, new)
    replay(dag)
    # embedding rows (vocab 10): TP4 chunks [0,3) [3,6) [6,9) [9,10); TP3 chunks [0,4) [4,8) [8,10)
    assert _remote(dag, EMB) == [
        (1, 0, (3, 0), (1, 24), (0, 0), (3, 0)),
        (2, 1, (6, 0), (2, 24), (0, 0), (2, 0)),
        (3, 2, (9, 0), (1, 24), (0, 0), (1, 0)),
    ]
    assert _local(dag, EMB) == [(0, (0, 0), (3, 24)), (1, (4, 0), (2, 24)), (2, (8, 0), (1, 24))]
    # q rows: TP4 chunks of 6, TP3 chunks of 8
    assert _remote(dag, Q0) == [
        (1, 0, (6, 0), (2, 24), (0, 0), (6, 0)),
        (2, 1, (12, 0), (4, 24), (0, 0), (4, 0)),
        (3, 2, (18, 0), (6, 24), (0, 0), (2, 0)),
    ]
    # T_sub is TP1: the unit is split into parts already in their final TP3 shape, then merged
    assert [type(dag.nodes[i]).__name__ for i in dag.order] == ["Split", "Merge", "Destroy"]
    split = next(p for p in dag.nodes if isinstance(p, Split))
    assert [p.gpus for p in split.parts] == [(0,), (1,), (2,)]
    # the Merge reads exactly the parts the Split made, frees them, and makes the TP3 unit on GPUs 0-2
    merge = next(p for p in dag.nodes if isinstance(p, Merge))
    assert merge.sources == merge.frees == split.parts
    assert merge.unit.gpus == (0, 1, 2) and merge.unit.layout == Layout(3, 1)


def test_pp_2_to_1() -> None:
    old, new = _plans((2, 2, [0, 1, 2, 3], 1), (2, 1, [0, 1], 1))
    dag = build_transition(STATES, CLUSTER, old, new)
    replay(dag)
    # stage 1 (GPUs 2, 3) held layers 2-3, the final norm and the head; GPUs 0 and 1 pull them rank-aligned
    moved = {(t.src_worker, t.dst_worker, t.tensor)
             for p in dag.nodes for t in transfers(p) if StateKind(t.kind) is StateKind.PARAM}
    assert (2, 0, "lm_head.weight") in moved and (3, 1, "lm_head.weight") in moved
    assert (2, 0, "model.layers.3.mlp.up_proj.weight") in moved
    assert not any(".layers.0." in name or ".layers.1." in name or name == EMB for _, _, name in moved)
    head = sorted(t for t in _remote(dag, "lm_head.weight"))
    assert head == [(2, 0, (0, 0), (5, 24), (0, 0), (0, 0)), (3, 1, (5, 0), (5, 24), (0, 0), (0, 0))]
    assert {type(p).__name__ for p in dag.nodes} == {"Split", "Destroy"}


def test_dp_2_to_4() -> None:
    old, new = _plans((2, 1, [0, 1, 2, 3], 2), (2, 1, [0, 1, 2, 3, 4, 5, 6, 7], 4))
    dag = build_transition(STATES, CLUSTER, old, new)
    replay(dag)
    assert dag.renamed == (("actor-train@v1#0", "actor-train@v2#0"), ("actor-train@v1#1", "actor-train@v2#1"))
    extends = [p for p in dag.nodes if isinstance(p, Extend)]
    assert [(e.sources[0].uid, e.target.gpus) for e in extends] == [
        ("actor-train@v1#0", (4, 5)), ("actor-train@v1#1", (6, 7))]
    # rank-aligned: whole shards, rank r of a source feeds rank r of the new replica
    assert _remote(dag, Q0) == [
        (0, 4, (0, 0), (12, 24), (0, 0), (0, 0)), (1, 5, (12, 0), (12, 24), (0, 0), (0, 0)),
        (2, 6, (0, 0), (12, 24), (0, 0), (0, 0)), (3, 7, (12, 0), (12, 24), (0, 0), (0, 0))]
    assert extends[0].transfers(4) == transfers(extends[0], 4) and not hasattr(extends[0], "__dict__")
    cost = transition_cost(dag, CLUSTER)
    assert cost.inter_node_bytes == dag.bytes_moved and cost.intra_node_bytes == 0
    # half of the per-replica bytes: DP shrink back is a pure Destroy, nothing moves
    back = build_transition(STATES, CLUSTER, new, GlobalPlan(version=3, stages=old.stages))
    assert {type(p) for p in back.nodes} == {Destroy} and back.bytes_moved == 0


def test_messages_are_contiguous_aligned_and_per_pair() -> None:
    old, new = _plans((2, 1, [0, 1, 2, 3], 2), (4, 1, [0, 1, 2, 3], 1))
    dag = build_transition(STATES, CLUSTER, old, new)
    for prim in dag.nodes:
        wire = messages(transfers(prim))  # the executor's bucketizer
        assert bool(wire) == bool(transfers(prim))
        for m in wire:
            assert all(p.src_worker == m.src_worker and p.dst_worker == m.dst_worker for p in m.pieces)
            ends = [o + p.num_bytes for o, p in zip(m.layout, m.pieces)]
            assert all(e <= o2 for e, o2 in zip(ends, m.layout[1:]))  # in order, never overlapping
            if m.src_start is None and m.dst_start is None:  # a packed bucket: items 16-byte aligned
                assert all(o % 16 == 0 for o in m.layout)
                assert m.length >= ends[-1] and m.length - ends[-1] < 16
            else:  # laid out as one side's buffer holds them: the message spans exactly those bytes
                assert m.length == ends[-1]
        # one GPU derives only its own part, and it is exactly its share of the whole
        for g in range(4):
            mine = transfers(prim, g)
            assert mine == [t for t in transfers(prim) if g in (t.src_worker, t.dst_worker)]


def test_move_to_other_gpus_and_serialise() -> None:
    old, new = _plans((2, 2, [0, 1, 2, 3], 1), (2, 2, [4, 5, 6, 7], 1))
    dag = build_transition(STATES, CLUSTER, old, new)
    replay(dag)
    assert [type(dag.nodes[i]).__name__ for i in dag.order] == ["Extend", "Destroy"]
    doc = json.loads(json.dumps(dag.to_dict()))
    assert doc["nodes"][0]["kind"] == "extend" and doc["new_units"] == ["actor-train@v2#0"]
    assert doc["bytes_moved"] == dag.bytes_moved > 0
    assert dag.nodes_on(5) == [0] and dag.nodes_on(1) == [0, 1]


def test_gpu_loss_rebuilds_from_a_surviving_replica() -> None:
    old, _ = _plans((2, 1, [0, 1, 2, 3], 2), (2, 1, [0, 1], 1))
    new = GlobalPlan(version=2, stages=(stage_plan("actor-train", Layout(2, 1), [0, 1, 4, 5], 2),))
    dag = build_transition(STATES, CLUSTER, old, new, lost_gpus=frozenset({3}))
    replay(dag)
    assert [u.uid for u in dag.lost_units] == ["actor-train@v1#1"]
    assert all(e.sources[0].uid == "actor-train@v1#0" for e in dag.nodes if isinstance(e, Extend))


def test_last_copy_lost_says_checkpoint() -> None:
    old, new = _plans((2, 1, [0, 1], 1), (2, 1, [4, 5], 1))
    with pytest.raises(LastCopyLostError, match="checkpoint") as err:
        build_transition(STATES, CLUSTER, old, new, lost_gpus=frozenset({1}))
    assert err.value.model_stages == ("actor-train",) and err.value.lost_gpus == (1,)


def test_generation_replicas_rebuilt_from_training_after_loss() -> None:
    old = GlobalPlan(version=1, stages=(stage_plan("actor-gen", Layout(1, 1), [0, 1], 2),
                                        stage_plan("actor-train", Layout(2, 2), [4, 5, 6, 7], 1)))
    new = GlobalPlan(version=2, stages=(stage_plan("actor-gen", Layout(2, 1), [2, 3], 1),
                                        stage_plan("actor-train", Layout(2, 2), [4, 5, 6, 7], 1)))
    dag = build_transition(STATES, CLUSTER, old, new, lost_gpus=frozenset({0, 1}))
    replay(dag)
    (ext,) = [p for p in dag.nodes if isinstance(p, Extend)]
    assert ext.sources[0].model_stage == "actor-train"
    assert {StateKind(t.kind) for t in transfers(ext)} == {StateKind.PARAM}


def test_weight_sync_uses_the_same_primitives() -> None:
    plan = GlobalPlan(version=4, stages=(stage_plan("actor-gen", Layout(1, 1), [0, 1, 2, 3], 4),
                                         stage_plan("actor-train", Layout(2, 2), [0, 1, 2, 3], 1)))
    dag = build_weight_sync(STATES, CLUSTER, plan)
    report = replay(dag)  # stale generation bytes never reach the new replicas
    assert sorted(dag.stale_units) == [f"actor-gen@v4#{i}" for i in range(4)]
    assert {type(p).__name__ for p in dag.nodes} == {"Destroy", "Extend"}
    assert dag.order[:4] == tuple(i for i, p in enumerate(dag.nodes) if isinstance(p, Destroy))
    assert report.pieces_local > 0  # each GPU's own training shard is not sent


def test_infeasible_names_gpu_and_bytes() -> None:
    extend_old, extend_new = _plans((2, 1, [0, 1], 1), (2, 1, [0, 1, 2, 3], 2))
    extend = build_transition(STATES, CLUSTER, extend_old, extend_new)
    held = max(u.bytes_on(g) for u in extend.old_units for g in u.gpus)
    # an Extend of a whole replica is one zero-copy message per rank: no bucket memory, so it fits
    # even with the old state filling its GPUs exactly (the executor's own bucketizer says so)
    assert all(not fp.buffer_bytes for fp in extend.footprints)
    build_transition(STATES, CLUSTER, extend_old, extend_new, capacity_bytes=held)
    old, new = _plans((2, 1, [0, 1], 1), (1, 2, [0, 1, 2, 3], 2))
    dag = build_transition(STATES, CLUSTER, old, new)
    assert held == max(u.bytes_on(g) for u in dag.old_units for g in u.gpus)
    # the old state fits exactly, but no room is left for what the change builds on those GPUs
    with pytest.raises(InfeasibleError, match=r"GPU [0-3] needs \d+ bytes .* but has 0 free"):
        build_transition(STATES, CLUSTER, old, new, capacity_bytes=held)
    with pytest.raises(InfeasibleError, match=r"GPU 0 already holds \d+ bytes"):
        build_transition(STATES, CLUSTER, old, new, capacity_bytes=held - 1)


def test_shared_gpus_need_release_before_acquire() -> None:
    """ref-inf grows onto GPUs 4,5 that actor-train leaves: its acquisition (first by stage order)
    is blocked until actor-train's old replica is destroyed, which needs actor-train's Extend first.
    The global order waits and records the resource edge; the naive per-stage order deadlocks."""
    old = GlobalPlan(version=1, stages=(stage_plan("ref-inf", Layout(1, 1), [0, 1], 2),
                                        stage_plan("actor-train", Layout(2, 1), [4, 5], 1)))
    new = GlobalPlan(version=2, stages=(stage_plan("ref-inf", Layout(1, 1), [0, 1, 4, 5], 4),
                                        stage_plan("actor-train", Layout(2, 1), [2, 3], 1)))
    train = next(sp for sp in old if sp.model_stage == "actor-train")
    free_run = build_transition(STATES, CLUSTER, old, new)
    held = free_run.old_units[-1].bytes_on(4)
    ref = next(u for u in free_run.new_units if u.model_stage == "ref-inf" and u.holds(4)).bytes_on(4)
    assert train.gpu_sets[0][0] == 4
    # the old train shard or ref-inf's new replica, never both (the Extends are zero-copy: no buffers)
    capacity = held + ref - 1
    dag = build_transition(STATES, CLUSTER, old, new, capacity_bytes=capacity)
    replay(dag)
    names = [type(dag.nodes[i]).__name__ + ":" + (dag.nodes[i].targets or dag.nodes[i].frees)[0].uid
             for i in dag.order]
    assert names.index("Extend:actor-train@v2#0") < names.index("Destroy:actor-train@v1#0")
    assert names.index("Destroy:actor-train@v1#0") < names.index("Extend:ref-inf@v2#2")
    edges = {(names[dag.order.index(a)], names[dag.order.index(b)]) for a, b in dag.resource_edges}
    assert ("Destroy:actor-train@v1#0", "Extend:ref-inf@v2#2") in edges
    with pytest.raises(InfeasibleError, match="per-stage order cannot wait"):
        build_transition(STATES, CLUSTER, old, new, capacity_bytes=capacity, policy="per_stage")


def test_transfer_slices() -> None:
    def slot(offsets: tuple[int, ...]) -> Slot:
        return Slot(tensor="x", kind=StateKind.PARAM.value, dtype="bfloat16", global_shape=(8, 3),
                    offsets=offsets, lengths=(4, 3), byte_offset=0)

    t = Piece(src_worker=0, dst_worker=1, src_slot=slot((3, 0)), dst_slot=slot((4, 0)), box=((4, 0), (2, 3)),
              src_unit="a", dst_unit="b")
    assert t.src_offsets == (1, 0) and t.dst_offsets == (0, 0) and t.offsets == (4, 0) and t.lengths == (2, 3)
    assert t.src_slices == (slice(1, 3), slice(0, 3)) and t.num_bytes == 12 and not t.is_local


def test_job_spec_input_and_cost_depends_on_links() -> None:
    """A JobSpec works as input; the same move costs more across nodes than inside one (L_tran)."""
    from planner.models import TINY_3M
    from planner.workflow import Workload, ppo, same_model_job

    job = same_model_job(ppo(), TINY_3M, Workload(prompts_per_step=8, prompt_tokens=16, response_tokens=16))
    inside = GlobalPlan(version=2, stages=(stage_plan("actor-train", Layout(2, 1), [2, 3], 1),))
    across = GlobalPlan(version=2, stages=(stage_plan("actor-train", Layout(2, 1), [4, 5], 1),))
    old = GlobalPlan(version=1, stages=(stage_plan("actor-train", Layout(2, 1), [0, 1], 1),))
    near = build_transition(job, CLUSTER, old, inside)
    far = build_transition(job, CLUSTER, old, across)
    assert near.bytes_moved == far.bytes_moved > 0
    cost_near, cost_far = transition_cost(near, CLUSTER), transition_cost(far, CLUSTER)
    assert cost_near.inter_node_bytes == 0 and cost_far.intra_node_bytes == 0
    assert cost_far.seconds > cost_near.seconds
    # the expected time: setup + bytes over the slower link, both ranks in parallel
    per_rank = max(far.footprints[0].pair_bytes.values())
    expected = 0.02 + per_rank / IB_NDR.bytes_per_s + IB_NDR.latency_s
    assert cost_far.seconds == pytest.approx(expected, rel=1e-6)


def test_new_plan_on_a_lost_gpu_is_refused() -> None:
    from planner.errors import SpecError

    old, new = _plans((2, 1, [0, 1, 2, 3], 2), (2, 1, [2, 3], 1))
    with pytest.raises(SpecError, match="lost GPUs"):
        build_transition(STATES, CLUSTER, old, new, lost_gpus=frozenset({3}))


def test_small_buckets_cut_items_and_bound_buffer_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """With 256-byte buckets, items are cut into row ranges, buckets stay within the cap (unless one
    row is bigger), the replay still fills every target exactly, and the memory check's buffer
    figure (two rounds in flight per worker, from the executor's own bucketizer) is what the replay
    measures."""
    from transitions import transfer_plan

    old, new = _plans((2, 1, [0, 1, 2, 3], 2), (4, 1, [0, 1, 2, 3], 1))
    whole_buffers_peak = max(build_transition(STATES, CLUSTER, old, new).peak_bytes.values())
    monkeypatch.setattr(transfer_plan, "DEFAULT_BUCKET_BYTES", 256)
    dag = build_transition(STATES, CLUSTER, old, new, cache=PlanningCache())  # footprints of 256-byte buckets
    assert max(dag.peak_bytes.values()) < whole_buffers_peak
    replay(dag)  # peaks per GPU equal the DAG's, which now count bounded buffers
    for prim in dag.nodes:
        whole = transfers(prim)
        wire = transfer_plan.messages(whole, 256)
        assert sum(p.num_bytes for m in wire for p in m.pieces) == sum(t.num_bytes for t in whole)
        for m in wire:
            assert m.num_bytes <= 256 or len(m.pieces) == 1 or m.num_bytes >= transfer_plan.DIRECT_MIN_BYTES
    # the largest piece that travels in buckets (not as one zero-copy run) is cut along its first
    # stored dim, into pieces of at most one bucket each
    packed = [q for p in dag.nodes for q in transfers(p)
              if q.num_bytes < transfer_plan.DIRECT_MIN_BYTES]
    piece = max(packed, key=lambda q: q.num_bytes)
    assert piece.num_bytes > 256
    cut = [q for m in transfer_plan.messages([piece], 256) for q in m.pieces]
    d = piece.src_slot.order[0] if piece.src_slot.order else 0
    assert len(cut) > 1 and all(q.num_bytes <= 256 for q in cut)
    assert sum(q.box[1][d] for q in cut) == piece.box[1][d] and cut[0].box[0] == piece.box[0]
    assert cut[1].box[0][d] == piece.box[0][d] + cut[0].box[1][d]
