"""The replay oracle (transitions.replay) refuses what a transition must not do: each check, fed a DAG
broken in the one way it guards against, raises ReplayError saying which check failed; and on a sound
DAG its report counts what the DAG moves."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest

import transitions.replay as replay_module
from planner.hardware import CPU, LOOPBACK, NVLINK4, ClusterSpec
from planner.models import ModelSpec
from planner.plan import GlobalPlan, Layout
from planner.workflow import ACTOR_GEN, ACTOR_TRAIN, REF_INF
from transitions.global_dag import TransitionDAG, build_transition
from transitions.pieces import pieces
from transitions.primitives import Merge, Primitive
from transitions.replay import ReplayError, replay
from transitions.scenarios import stage_plan, stage_states
from transitions.transfer_plan import Piece

TINY = ModelSpec(name="tiny", num_layers=2, hidden_size=8, num_attention_heads=4, num_kv_heads=2, head_dim=2,
                 ffn_hidden_size=24, vocab_size=11)
STATES = stage_states(TINY, (ACTOR_GEN, REF_INF, ACTOR_TRAIN))
CLUSTER = ClusterSpec(device=CPU, num_nodes=1, gpus_per_node=4, intra_node_link=NVLINK4, inter_node_link=LOOPBACK)


def _plan(version: int, *stages: tuple[str, int, int, list[int], int]) -> GlobalPlan:
    return GlobalPlan(version=version, stages=tuple(stage_plan(name, Layout(tp, pp), gpus, dp)
                                                    for name, tp, pp, gpus, dp in stages))


def _build(old: list[tuple[str, int, int, list[int], int]], new: list[tuple[str, int, int, list[int], int]]
           ) -> TransitionDAG:
    return build_transition(STATES, CLUSTER, _plan(1, *old), _plan(2, *new), exact=True)


def _move() -> TransitionDAG:
    """actor-train TP2 from GPUs 0,1 to 2,3: one Extend (all remote), one Destroy."""
    return _build([("actor-train", 2, 1, [0, 1], 1)], [("actor-train", 2, 1, [2, 3], 1)])


def _two_moves() -> TransitionDAG:
    """Two TP1 replicas from GPUs 0,1 to 2,3: Extend, Destroy, Extend, Destroy (each new one from its old one)."""
    dag = _build([("actor-train", 1, 1, [0, 1], 2)], [("actor-train", 1, 1, [2, 3], 2)])
    assert [(type(dag.nodes[i]).__name__, [u.uid for u in (*dag.nodes[i].targets, *dag.nodes[i].sources)])
            for i in dag.order] == [("Extend", ["actor-train@v2#0", "actor-train@v1#0"]),
                                    ("Destroy", []), ("Extend", ["actor-train@v2#1", "actor-train@v1#1"]),
                                    ("Destroy", [])]
    return dag


def _with(dag: TransitionDAG, capacity: int | None = None, **body: object) -> TransitionDAG:
    return TransitionDAG(old_version=dag.old_version, new_version=dag.new_version,
                         capacity_bytes=dag.capacity_bytes if capacity is None else capacity,
                         body_=replace(dag.body, **body))  # type: ignore[arg-type]


def test_a_sound_move_is_counted() -> None:
    dag = _move()
    assert [type(dag.nodes[i]).__name__ for i in dag.order] == ["Extend", "Destroy"]
    report = replay(dag)
    sent = [pc for prim in dag.nodes for pc in pieces(prim)]
    assert report.pieces_local == 0 and report.pieces_remote == len(sent) > 0
    assert report.bytes_remote == sum(pc.num_bytes for pc in sent) == dag.bytes_moved
    assert report.bytes_remote == sum(u.bytes_on(g) for u in dag.old_units for g in u.gpus)
    assert report.final_units == ["actor-train@v2#0"]
    assert report.peak_bytes == dag.peak_bytes


def test_sound_dags_with_merges_and_a_replica_still_to_build_replay() -> None:
    """TP2 x DP2 -> TP4 on the same GPUs: parts Extended (partly from the GPU's own shard), then Merged
    by relabelling; and two replicas moved one after the other, the first old one destroyed while the
    second new one is still to build (the second old replica is then the last copy)."""
    dag = _build([("actor-train", 2, 1, [0, 1, 2, 3], 2)], [("actor-train", 4, 1, [0, 1, 2, 3], 1)])
    assert any(isinstance(p, Merge) for p in dag.nodes)
    report = replay(dag)
    every = [pc for prim in dag.nodes for pc in pieces(prim)]
    assert report.pieces_local == sum(pc.is_local for pc in every) > 0
    assert report.pieces_remote == sum(not pc.is_local for pc in every) > 0
    assert report.bytes_remote == sum(pc.num_bytes for pc in every if not pc.is_local) == dag.bytes_moved
    assert report.final_units == ["actor-train@v2#0"] and report.peak_bytes == dag.peak_bytes
    two = _two_moves()
    assert replay(two).final_units == ["actor-train@v2#0", "actor-train@v2#1"]
    # DP4 x TP1 -> TP4: the four old replicas are the Merge's parts (copied, not relabelled) and freed by it
    merged = _build([("actor-train", 1, 1, [0, 1, 2, 3], 4)], [("actor-train", 4, 1, [0, 1, 2, 3], 1)])
    (merge,) = [p for p in merged.nodes if isinstance(p, Merge)]
    assert [p.uid for p in merge.parts] == [f"actor-train@v1#{i}" for i in range(4)]
    assert all(p.final is None for p in merge.parts)
    assert replay(merged).final_units == ["actor-train@v2#0"]


def test_a_replica_built_by_the_dag_may_feed_a_later_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The second new TP1 replica (GPU 3) copied from the first new one (GPU 2) instead of its old
    one: the first is complete by then and holds the same bytes, so replay accepts it."""
    two = _two_moves()
    real = replay_module.pieces

    def from_new(prim: Primitive) -> list[Piece]:
        ps = list(real(prim))
        if prim.targets and prim.targets[0].uid == "actor-train@v2#1":
            return [replace(pc, src_unit="actor-train@v2#0", src_worker=2) for pc in ps]
        return ps
    monkeypatch.setattr(replay_module, "pieces", from_new)
    assert replay(two).final_units == ["actor-train@v2#0", "actor-train@v2#1"]


def test_a_merged_unit_counts_as_a_copy() -> None:
    """TP2 x DP2 -> TP4 plus a new actor-gen replica (same model and role: the same values) read from
    the old training replicas. Run the Merge and both Destroys before it: the merged unit holds every
    element, so no Destroy drops a last copy; what is refused is the read of a destroyed replica."""
    dag = _build([("actor-train", 2, 1, [0, 1, 2, 3], 2)],
                 [("actor-train", 4, 1, [0, 1, 2, 3], 1), ("actor-gen", 1, 1, [0], 1)])
    (gen,) = [i for i, p in enumerate(dag.nodes) if p.targets and p.targets[0].uid == "actor-gen@v2#0"]
    assert dag.nodes[gen].sources[0].uid == "actor-train@v1#0"
    late = dag.with_order((*(i for i in dag.order if i != gen), gen))
    assert [type(late.nodes[i]).__name__ for i in late.order] == ["Extend", "Extend", "Merge", "Destroy",
                                                                  "Destroy", "Extend"]
    with pytest.raises(ReplayError, match=rf"^node {gen} reads actor-train@v1#0, which is not complete$"):
        replay(late)


@pytest.mark.parametrize(("broken", "message"), [
    ("reversed", r"freeing actor-train@v1#0 drops the last copy of .* on GPU 0"),
    ("extend twice", r"actor-train@v2#0 produced twice"),
    ("no destroy", r"left on GPUs \['actor-train@v1#0'\], missing \[\]"),
    ("nothing run", r"targets never produced: \['actor-train@v2#0'\]"),
    ("destroy twice", r"frees actor-train@v1#0, which is not alive"),
    ("old unit stale", r"actor-train@v2#0 on GPU 2: .* holds the wrong bytes"),
    ("peak off by one", r"GPU 0: replay peak \d+ != predicted \d+"),
    ("capacity one short", r"GPU 0 at \d+ bytes > capacity \d+ \(node 0\)"),
    ("peak of GPU 0 not predicted", r"GPU 0: replay peak \d+ != predicted 0$"),
])
def test_each_check_refuses_the_dag_it_guards_against(broken: str, message: str) -> None:
    dag = _move()
    extend, destroy = dag.order
    peak = max(dag.peak_bytes.values())
    bad = {
        "reversed": lambda: dag.with_order((destroy, extend)),
        "extend twice": lambda: dag.with_order((extend, extend, destroy)),
        "no destroy": lambda: dag.with_order((extend,)),
        "nothing run": lambda: dag.with_order(()),
        "destroy twice": lambda: dag.with_order((extend, destroy, destroy)),
        "old unit stale": lambda: _with(dag, stale_units=(dag.old_units[0].uid,)),
        "peak off by one": lambda: _with(dag, peak_bytes={g: b + (g == 0) for g, b in dag.peak_bytes.items()}),
        "capacity one short": lambda: _with(dag, capacity=peak - 1),
        "peak of GPU 0 not predicted": lambda: _with(dag, peak_bytes={g: b for g, b in dag.peak_bytes.items() if g}),
    }[broken]()
    with pytest.raises(ReplayError, match=message):
        replay(bad)
    replay(_with(dag, capacity=peak))  # at exactly its peak, the sound DAG fits


def test_a_read_after_the_free_and_a_stale_unit_kept_are_refused() -> None:
    two = _two_moves()
    extend0, destroy0, extend1, destroy1 = two.order
    # the other old replica still covers every element, so the Destroy passes; the read does not
    with pytest.raises(ReplayError, match=r"node 0 reads actor-train@v1#0, which is not complete"):
        replay(two.with_order((destroy0, extend0, extend1, destroy1)))
    kept = _build([("actor-train", 2, 1, [0, 1], 1)], [("actor-train", 2, 1, [0, 1], 1)])
    assert not kept.nodes and kept.renamed == (("actor-train@v1#0", "actor-train@v2#0"),)
    replay(kept)
    with pytest.raises(ReplayError, match=r"^stale actor-train@v1#0 survived$"):
        replay(_with(kept, stale_units=("actor-train@v1#0",)))


Breaker = Callable[[list[Piece]], list[Piece]]


def _ends_at_shard_end(pc: Piece, side: str) -> bool:
    slot = pc.src_slot if side == "src" else pc.dst_slot
    offsets = pc.src_offsets if side == "src" else pc.dst_offsets
    return offsets[0] + pc.lengths[0] == slot.lengths[0]


def _one_past(side: str) -> Breaker:
    """The first piece that ends at its shard's end on ``side`` reads (or writes) one row further."""
    def broken(ps: list[Piece]) -> list[Piece]:
        k = next(k for k, pc in enumerate(ps) if _ends_at_shard_end(pc, side))
        slot = ps[k].src_slot if side == "src" else ps[k].dst_slot
        shifted = replace(slot, offsets=(slot.offsets[0] - 1, *slot.offsets[1:]))
        ps[k] = replace(ps[k], src_slot=shifted) if side == "src" else replace(ps[k], dst_slot=shifted)
        return ps
    return broken


BROKEN_PIECES: dict[str, tuple[Breaker, str]] = {
    "a piece sent twice": (lambda ps: [ps[0], *ps],
                           r"actor-train@v2#0 on GPU [23]: .* not written exactly once"),
    "a piece read from its own target": (lambda ps: [replace(ps[0], src_unit=ps[0].dst_unit), *ps[1:]],
                                         r"node 0 reads actor-train@v2#0, which is not complete"),
    "a piece read from a GPU its source is not on": (lambda ps: [replace(ps[0], src_worker=3), *ps[1:]],
                                                     r"node 0: actor-train@v1#0 holds no .* on GPU 3"),
    "a piece reading one row past its source shard": (_one_past("src"), r"node 0: piece .* outside its shards"),
    "a piece writing one row past its target shard": (_one_past("dst"), r"node 0: piece .* outside its shards"),
}


@pytest.mark.parametrize("broken", sorted(BROKEN_PIECES))
def test_a_piece_geometry_bug_is_caught(broken: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """replay copies what transitions.pieces says; a bug there (here: one piece altered) is refused."""
    breaker, message = BROKEN_PIECES[broken]
    dag = _move()
    real = replay_module.pieces
    monkeypatch.setattr(replay_module, "pieces", lambda prim: breaker(list(real(prim))))
    with pytest.raises(ReplayError, match=message):
        replay(dag)


def test_bytes_of_another_model_stage_are_wrong_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """ref-inf and actor-train (same model, same TP2 layout) share GPUs 0,1; ref-inf moves to 2,3. Its
    Extend fed from actor-train's shards (same tensors, same boxes) gets the wrong model's bytes."""
    dag = _build([("ref-inf", 2, 1, [0, 1], 1), ("actor-train", 2, 1, [0, 1], 1)],
                 [("ref-inf", 2, 1, [2, 3], 1), ("actor-train", 2, 1, [0, 1], 1)])
    replay(dag)
    real = replay_module.pieces

    def from_train(prim: Primitive) -> list[Piece]:
        return [replace(pc, src_unit="actor-train@v1#0") for pc in real(prim)]
    monkeypatch.setattr(replay_module, "pieces", from_train)
    with pytest.raises(ReplayError, match=r"ref-inf@v2#0 on GPU [23]: .* holds the wrong bytes"):
        replay(dag)
