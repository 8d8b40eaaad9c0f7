"""One model-stage's local plan (transitions.local_dag.plan_stage), primitive by primitive, on hand-worked
cases: reuse, Split, Extend (overlap first, else round-robin), Merge, Destroy, stale units, fallback
units and the last copy lost."""

from __future__ import annotations

import pytest

from planner.models import ModelSpec
from planner.plan import Layout
from planner.workflow import ACTOR_TRAIN
from transitions.emu import EMU
from transitions.local_dag import LastCopyLostError, plan_stage, plan_units, target_parts, unit_uid
from transitions.primitives import Destroy, Extend, Merge, Split
from transitions.scenarios import stage_plan, stage_states

# 12 heads, vocab 10: TP 2 chunks the vocab [0,5) [5,10), TP 4 [0,3) [3,6) [6,9) [9,10), so TP 2 -> 4
# parts do not nest (a TP 4 rank's rows are not all inside its TP 2 part rank's)
MHA = ModelSpec(name="mha12", num_layers=4, hidden_size=24, num_attention_heads=12, num_kv_heads=12,
                head_dim=2, ffn_hidden_size=36, vocab_size=10)
STATE = stage_states(MHA, (ACTOR_TRAIN,))["actor-train"]


def _unit(name: str, tp: int, pp: int, gpus: tuple[int, ...], version: int = 1) -> EMU:
    return EMU(uid=name, state=STATE, layout=Layout(tp, pp), gpus=gpus, version=version)


def test_units_of_a_plan_are_named_by_stage_version_and_index() -> None:
    plan = stage_plan("actor-train", Layout(2, 1), [5, 3, 1, 0], 2)
    units = plan_units(STATE, plan, 7)
    assert [(u.uid, u.gpus, u.layout, u.version) for u in units] == [
        ("actor-train@v7#0", (5, 3), Layout(2, 1), 7), ("actor-train@v7#1", (1, 0), Layout(2, 1), 7)]
    assert unit_uid("x", 3, 4) == "x@v3#4"


def test_target_parts_are_strided_and_point_at_their_unit() -> None:
    unit = _unit("t", 2, 2, (4, 5, 6, 7))  # ranks (tp, pp): 4=(0,0) 5=(1,0) 6=(0,1) 7=(1,1)
    assert target_parts(unit, Layout(2, 2)) == [unit]
    parts = target_parts(unit, Layout(1, 1))
    assert [(p.uid, p.gpus) for p in parts] == [("t.p0.0", (4,)), ("t.p1.0", (5,)), ("t.p0.1", (6,)),
                                                ("t.p1.1", (7,))]
    assert all(p.final is unit and p.layout == Layout(1, 1) and p.version == 1 and p.state == STATE
               for p in parts)
    # a TP 2 part of a TP 4 unit takes every other rank
    assert [p.gpus for p in target_parts(_unit("t", 4, 1, (0, 1, 2, 3)), Layout(2, 1))] == [(0, 2), (1, 3)]


def test_two_replicas_merge_into_one_tp2_unit_without_copies() -> None:
    a, b = _unit("a", 1, 1, (0,)), _unit("b", 1, 1, (1,))
    t = _unit("t", 2, 1, (0, 1), version=2)
    out = plan_stage(STATE, [a, b], [t])
    assert out.model_stage == "actor-train" and out.new_units == [t] and out.renamed == []
    assert out.primitives == [Merge(parts=(a, b), unit=t)]


def test_a_merge_takes_its_parts_from_the_gpus_they_sit_on_in_part_order() -> None:
    a, b = _unit("a", 1, 1, (0,)), _unit("b", 1, 1, (1,))
    t = _unit("t", 2, 1, (1, 0), version=2)
    assert plan_stage(STATE, [a, b], [t]).primitives == [Merge(parts=(b, a), unit=t)]


def test_a_tp2_unit_splits_into_two_replicas_then_is_destroyed() -> None:
    u = _unit("u", 2, 1, (0, 1))
    t0, t1 = _unit("t0", 1, 1, (1,), version=2), _unit("t1", 1, 1, (0,), version=2)
    out = plan_stage(STATE, [u], [t0, t1])
    assert out.primitives == [Split(unit=u, parts=(t0, t1)), Destroy(unit=u)]
    assert out.renamed == []


def test_an_unchanged_unit_is_renamed_and_a_new_replica_extended_from_it() -> None:
    u = _unit("u", 1, 1, (0,))
    t0, t1 = _unit("t0", 1, 1, (0,), version=2), _unit("t1", 1, 1, (1,), version=2)
    out = plan_stage(STATE, [u], [t0, t1])
    assert out.renamed == [("u", "t0")]
    assert out.primitives == [Extend(sources=(u,), target=t1)]  # u lives on as t0: no Destroy


def test_a_unit_is_reused_once_the_second_target_on_its_gpus_is_extended() -> None:
    u = _unit("u", 1, 1, (0,))
    t0, t1 = _unit("t0", 1, 1, (0,), version=2), _unit("t1", 1, 1, (0,), version=2)
    out = plan_stage(STATE, [u], [t0, t1])
    assert out.renamed == [("u", "t0")]
    assert out.primitives == [Extend(sources=(u,), target=t1)]


def test_targets_on_fresh_gpus_are_extended_round_robin_and_the_old_units_destroyed() -> None:
    a, b = _unit("a", 1, 1, (0,)), _unit("b", 1, 1, (1,))
    ts = [_unit(f"t{i}", 1, 1, (g,), version=2) for i, g in enumerate((2, 3, 4))]
    out = plan_stage(STATE, [a, b], ts)
    assert out.primitives == [Extend(sources=(a,), target=ts[0]), Extend(sources=(b,), target=ts[1]),
                              Extend(sources=(a,), target=ts[2]), Destroy(unit=a), Destroy(unit=b)]


def test_round_robin_takes_the_current_units_in_order() -> None:
    cur = [_unit(n, 1, 1, (g,)) for n, g in (("a", 0), ("b", 1), ("c", 2))]
    ts = [_unit(f"t{i}", 1, 1, (g,), version=2) for i, g in enumerate((3, 4, 5, 6))]
    got = [p.sources for p in plan_stage(STATE, cur, ts).primitives if isinstance(p, Extend)]
    assert got == [(cur[0],), (cur[1],), (cur[2],), (cur[0],)]


def test_extend_sources_go_by_how_many_gpus_they_share_then_by_first_appearance() -> None:
    # b shares three GPUs with the target, a one: b first although a holds the target's first GPU
    a, b = _unit("a", 4, 1, (0, 1, 2, 3)), _unit("b", 4, 1, (4, 5, 6, 7))
    t = _unit("t", 4, 1, (0, 4, 5, 6), version=2)
    assert plan_stage(STATE, [a, b], [t]).primitives == [Extend(sources=(b, a), target=t), Destroy(unit=a),
                                                         Destroy(unit=b)]
    # one GPU each: the holder of the part's first GPU first, whatever the uids (the replica-class path
    # orders ties so, the same for every replica of a shape; by uid "#10" would come before "#2")
    d, c = _unit("d", 2, 1, (0, 1)), _unit("c", 2, 1, (2, 3))
    t2 = _unit("t", 2, 1, (1, 2), version=2)
    assert plan_stage(STATE, [d, c], [t2]).primitives[0] == Extend(sources=(d, c), target=t2)
    t3 = _unit("t", 2, 1, (2, 1), version=2)
    assert plan_stage(STATE, [d, c], [t3]).primitives[0] == Extend(sources=(c, d), target=t3)


def test_parts_that_do_not_nest_are_extended_not_reused() -> None:
    # TP 2 -> TP 4 over vocab 10: the TP 2 units are T_sub parts on the right GPUs, but a TP 4 rank's
    # rows lie outside them, so each part is extended (from the unit on its GPUs) and merged
    a, b = _unit("a", 2, 1, (0, 2)), _unit("b", 2, 1, (1, 3))
    t = _unit("t", 4, 1, (0, 1, 2, 3), version=2)
    p0, p1 = target_parts(t, Layout(2, 1))
    assert (p0.gpus, p1.gpus) == ((0, 2), (1, 3))
    out = plan_stage(STATE, [a, b], [t])
    assert out.primitives == [Extend(sources=(a,), target=p0), Extend(sources=(b,), target=p1),
                              Merge(parts=(p0, p1), unit=t), Destroy(unit=a), Destroy(unit=b)]


def test_parts_that_nest_reuse_the_units_on_their_gpus() -> None:
    # PP 2 replicas -> TP 2 x PP 2: every TP 2 rank holds a subset of its TP 1 part rank, so the replicas are the parts
    a, b = _unit("a", 1, 2, (0, 1)), _unit("b", 1, 2, (2, 3))
    t = _unit("t", 2, 2, (0, 2, 1, 3), version=2)  # part a=0 on ranks tp 0: GPUs 0, 1
    p = target_parts(t, Layout(1, 2))
    assert [q.gpus for q in p] == [(0, 1), (2, 3)]
    assert plan_stage(STATE, [a, b], [t]).primitives == [Merge(parts=(a, b), unit=t)]


def test_a_split_part_is_cut_once_and_a_second_target_there_is_extended() -> None:
    u = _unit("u", 2, 1, (0, 1))
    t0, t1, t2 = (_unit(f"t{i}", 1, 1, (g,), version=2) for i, g in enumerate((0, 0, 1)))
    out = plan_stage(STATE, [u], [t0, t1, t2])
    assert out.primitives == [Extend(sources=(u,), target=t1), Split(unit=u, parts=(t0, t2)), Destroy(unit=u)]


def test_stale_units_are_destroyed_first_and_fallback_units_feed_the_rebuild() -> None:
    stale = _unit("s", 1, 1, (0,))
    train = _unit("train", 2, 1, (2, 3))
    t0, t1 = _unit("t0", 1, 1, (0,), version=2), _unit("t1", 1, 1, (3,), version=2)
    out = plan_stage(STATE, [], [t0, t1], fallback=[train], stale=[stale])
    assert out.primitives == [Destroy(unit=stale), Extend(sources=(train,), target=t0),
                              Extend(sources=(train,), target=t1)]
    assert out.new_units == [t0, t1] and out.renamed == []


def test_the_first_fallback_unit_on_a_gpu_is_the_one_read_there() -> None:
    f1, f2 = _unit("z", 1, 1, (0,)), _unit("y", 2, 1, (0, 1))
    t = _unit("t", 1, 1, (0,), version=2)
    assert plan_stage(STATE, [], [t], fallback=[f1, f2]).primitives == [Extend(sources=(f1,), target=t)]


def test_fallback_units_are_unused_while_a_current_unit_survives() -> None:
    u = _unit("u", 1, 1, (0,))
    train = _unit("train", 1, 1, (1,))
    t = _unit("t", 1, 1, (1,), version=2)
    assert plan_stage(STATE, [u], [t], fallback=[train]).primitives == [Extend(sources=(u,), target=t),
                                                                       Destroy(unit=u)]


def test_a_stage_without_targets_destroys_its_current_and_stale_units() -> None:
    u, s = _unit("u", 1, 1, (0,)), _unit("s", 1, 1, (1,))
    out = plan_stage(STATE, [u], [], stale=[s])
    assert out.primitives == [Destroy(unit=s), Destroy(unit=u)] and out.new_units == []


def test_no_replica_and_no_fallback_is_the_last_copy_lost() -> None:
    t = _unit("t", 1, 1, (0,), version=2)
    with pytest.raises(LastCopyLostError) as err:
        plan_stage(STATE, [], [t], fallback=[])
    assert err.value.model_stages == ("actor-train",) and err.value.lost_gpus == ()
    with pytest.raises(LastCopyLostError):
        plan_stage(STATE, [], [t])


def test_last_copy_lost_names_the_stages_and_gpus() -> None:
    err = LastCopyLostError(("a", "b"), (3, 5))
    assert err.model_stages == ("a", "b") and err.lost_gpus == (3, 5)
    assert str(err) == ("the last copy of some state was lost; the checkpoint path is needed"
                        "\n  - a: no intact replica survives (lost GPUs [3, 5]) and no other model-stage holds its state"
                        "\n  - b: no intact replica survives (lost GPUs [3, 5]) and no other model-stage holds its state")
