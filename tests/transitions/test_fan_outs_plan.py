"""fan_outs (transitions.fan_outs) without processes: which Extends of one whole unit form a broadcast,
on real units (tests/transitions/test_restore_dag_plan's fixture) in hand-made DAGs; values by hand."""

from __future__ import annotations

from test_restore_dag_plan import _at

from transitions.dag_record import DagBody, TransitionDAG
from transitions.emu import EMU
from transitions.fan_outs import FanOut, fan_outs
from transitions.placement_dag import placement_units
from transitions.primitives import Destroy, Extend, Primitive


def _unit(uid: str, gpus: tuple[int, ...], stage: str = "gen") -> EMU:
    (u,) = placement_units([_at(stage, [list(gpus)], tp=len(gpus), training=False)], version=1)
    return EMU(uid=uid, state=u.state, layout=u.layout, gpus=gpus, version=1)


def _dag(nodes: list[Primitive], order: list[int] | None = None) -> TransitionDAG:
    order_t = tuple(range(len(nodes))) if order is None else tuple(order)
    gpu_nodes: dict[int, list[int]] = {}
    for n in order_t:
        gpus = {g for u in (*nodes[n].sources, *nodes[n].targets, *nodes[n].frees) for g in u.gpus}
        for g in sorted(gpus):
            gpu_nodes.setdefault(g, []).append(n)
    body = DagBody(nodes=tuple(nodes), stage_order=tuple(0 for _ in nodes), data_edges=(), resource_edges=(),
                   order=order_t, old_units=(), lost_units=(), new_units=(), renamed=(), stale_units=(),
                   peak_bytes={}, footprints=(), gpu_nodes={g: tuple(ns) for g, ns in gpu_nodes.items()})
    return TransitionDAG(old_version=1, new_version=2, capacity_bytes=0, body_=body)


def test_two_whole_copies_of_one_unit_form_one_fan_out() -> None:
    src, a, b = _unit("s", (0, 1)), _unit("a", (2, 3)), _unit("b", (4, 5))
    (fan,) = fan_outs(_dag([Extend(sources=(src,), target=a), Extend(sources=(src,), target=b)]))
    assert fan == FanOut(nodes=(0, 1), source=src, targets=(a, b))
    assert fan.ranks == ((0, (2, 4)), (1, (3, 5)))


def test_exactly_one_copy_is_no_fan_out_and_three_are_one() -> None:
    src = _unit("s", (0, 1))
    a, b, c = _unit("a", (2, 3)), _unit("b", (4, 5)), _unit("c", (6, 7))
    assert fan_outs(_dag([Extend(sources=(src,), target=a)])) == []
    (fan,) = fan_outs(_dag([Extend(sources=(src,), target=t) for t in (a, b, c)]))
    assert fan.nodes == (0, 1, 2) and fan.targets == (a, b, c)
    assert fan.ranks == ((0, (2, 4, 6)), (1, (3, 5, 7)))


def test_nodes_follow_the_execution_order_not_their_ids() -> None:
    src, a, b, c = _unit("s", (0, 1)), _unit("a", (2, 3)), _unit("b", (4, 5)), _unit("c", (6, 7))
    nodes: list[Primitive] = [Extend(sources=(src,), target=t) for t in (a, b, c)]
    (fan,) = fan_outs(_dag(nodes, order=[2, 0, 1]))
    assert fan == FanOut(nodes=(2, 0, 1), source=src, targets=(c, a, b))
    assert fan.ranks == ((0, (6, 2, 4)), (1, (7, 3, 5)))


def test_only_plain_single_source_whole_copies_join() -> None:
    src, a, b = _unit("s", (0, 1)), _unit("a", (2, 3)), _unit("b", (4, 5))
    other = _unit("o", (8, 9))
    ok = [Extend(sources=(src,), target=a), Extend(sources=(src,), target=b)]
    # a second source: not a plain copy of one unit; another layout (TP=1) or model-stage: not whole copies;
    # a target on a GPU of the source: not a copy elsewhere; a Destroy: not an Extend
    excluded: list[Primitive] = [
        Extend(sources=(src, other), target=_unit("x", (6, 7))),
        Extend(sources=(src,), target=_unit("tp1", (6,))),
        Extend(sources=(src,), target=_unit("other-stage", (6, 7), stage="train")),
        Extend(sources=(src,), target=_unit("overlap", (1, 6))),
        Destroy(unit=_unit("d", (6, 7))),
    ]
    for bad in excluded:
        assert fan_outs(_dag([ok[0], bad])) == [], bad
        # after the two good copies (between them it would touch a member GPU): they still fan out alone
        (fan,) = fan_outs(_dag([*ok, bad]))
        assert fan.nodes == (0, 1) and fan.targets == (a, b)


def test_a_node_between_on_another_gpu_is_no_obstacle() -> None:
    src, a, b = _unit("s", (0, 1)), _unit("a", (2, 3)), _unit("b", (4, 5))
    away = Extend(sources=(_unit("p", (8, 9)),), target=_unit("q", (10, 11)))
    (fan,) = fan_outs(_dag([Extend(sources=(src,), target=a), away, Extend(sources=(src,), target=b)]))
    assert fan.nodes == (0, 2)


def test_a_node_between_on_a_member_gpu_blocks_the_fan_out_but_not_one_before_or_after() -> None:
    src, a, b = _unit("s", (0, 1)), _unit("a", (2, 3)), _unit("b", (4, 5))
    copies = [Extend(sources=(src,), target=a), Extend(sources=(src,), target=b)]
    for gpus in ((0, 9), (1, 9), (3, 9), (5, 9)):  # the source's GPUs and the copies'
        near = Destroy(unit=_unit("n", gpus))
        assert fan_outs(_dag([copies[0], near, copies[1]])) == [], gpus
        assert [f.nodes for f in fan_outs(_dag([near, *copies]))] == [(1, 2)]
        assert [f.nodes for f in fan_outs(_dag([*copies, near]))] == [(0, 1)]
        # the same three nodes, ordered so that it runs before them
        assert [f.nodes for f in fan_outs(_dag([copies[0], near, copies[1]], order=[1, 0, 2]))] == [(0, 2)]


def test_two_copies_sharing_a_gpu_are_no_fan_out() -> None:
    src = _unit("s", (0, 1))
    nodes: list[Primitive] = [Extend(sources=(src,), target=_unit("a", (2, 3))),
                              Extend(sources=(src,), target=_unit("b", (3, 4)))]
    assert fan_outs(_dag(nodes)) == []


def test_parts_headed_into_a_merge_are_excluded_as_source_or_target() -> None:
    src, a, b = _unit("s", (0, 1)), _unit("a", (2, 3)), _unit("b", (4, 5))
    part_b = EMU(uid="pb", state=b.state, layout=b.layout, gpus=(4, 5), version=1, final=b)
    assert fan_outs(_dag([Extend(sources=(src,), target=a), Extend(sources=(src,), target=part_b)])) == []
    part_src = EMU(uid="ps", state=src.state, layout=src.layout, gpus=(0, 1), version=1, final=src)
    assert fan_outs(_dag([Extend(sources=(part_src,), target=a), Extend(sources=(part_src,), target=b)])) == []


def test_each_source_has_its_own_fan_out_in_order_of_its_first_node() -> None:
    s1, s2 = _unit("s1", (0, 1)), _unit("s2", (8, 9))
    a1, b1, a2, b2 = _unit("a1", (2, 3)), _unit("b1", (4, 5)), _unit("a2", (10, 11)), _unit("b2", (12, 13))
    nodes: list[Primitive] = [Extend(sources=(s2,), target=a2), Extend(sources=(s1,), target=a1),
                              Extend(sources=(s2,), target=b2), Extend(sources=(s1,), target=b1)]
    fans = fan_outs(_dag(nodes))
    assert fans == [FanOut(nodes=(0, 2), source=s2, targets=(a2, b2)), FanOut(nodes=(1, 3), source=s1, targets=(a1, b1))]
    # a source with a single copy next to one with two
    fans = fan_outs(_dag([Extend(sources=(s2,), target=a2), *nodes[1::2]]))
    assert [f.source.uid for f in fans] == ["s1"]


def test_a_node_between_the_last_two_of_three_copies_blocks_too() -> None:
    src, a, b, c = _unit("s", (0, 1)), _unit("a", (2, 3)), _unit("b", (4, 5)), _unit("c", (6, 7))
    copies = [Extend(sources=(src,), target=t) for t in (a, b, c)]
    assert fan_outs(_dag([*copies[:2], Destroy(unit=_unit("n", (7, 9))), copies[2]])) == []


def test_a_rejected_source_does_not_stop_the_next_one() -> None:
    s1, s2 = _unit("s1", (0, 1)), _unit("s2", (8, 9))
    a2, b2 = _unit("a2", (10, 11)), _unit("b2", (12, 13))
    good = FanOut(nodes=(2, 3), source=s2, targets=(a2, b2))
    shared = [Extend(sources=(s1,), target=_unit("a1", (2, 3))), Extend(sources=(s1,), target=_unit("b1", (3, 4)))]
    assert fan_outs(_dag([*shared, Extend(sources=(s2,), target=a2), Extend(sources=(s2,), target=b2)])) == [good]
    s1_copies = [Extend(sources=(s1,), target=_unit("a1", (2, 3))), Extend(sources=(s1,), target=_unit("b1", (4, 5)))]
    blocked = [s1_copies[0], Destroy(unit=_unit("n", (2, 20))), s1_copies[1]]
    fans = fan_outs(_dag([*blocked, Extend(sources=(s2,), target=a2), Extend(sources=(s2,), target=b2)]))
    assert fans == [FanOut(nodes=(3, 4), source=s2, targets=(a2, b2))]
