"""The typed transition errors' messages, word for word (transitions/errors.py).

A caller that logs or reports a DagCycleError or a CoverageError shows its message, so the message
must name what the fields hold: how many nodes never become ready and the first eight of them (an
ellipsis past eight), and the unit, GPU, tensor key and row ranges no source holds. Every expected
string below is written out by hand from those rules, not read back from the code.
"""

from __future__ import annotations

from transitions.errors import CoverageError, DagCycleError


def test_a_short_cycle_lists_every_unordered_node() -> None:
    err = DagCycleError((1, 2, 3))
    assert err.unordered == (1, 2, 3)
    assert str(err) == "transition DAG has a cycle: 3 nodes never become ready (1, 2, 3)"


def test_eight_unordered_nodes_are_all_shown_without_an_ellipsis() -> None:
    err = DagCycleError(tuple(range(10, 18)))
    assert str(err) == ("transition DAG has a cycle: 8 nodes never become ready "
                        "(10, 11, 12, 13, 14, 15, 16, 17)")


def test_past_eight_nodes_the_first_eight_are_shown_then_an_ellipsis() -> None:
    # nine nodes: 0..7 shown, the ninth (8) left to the ellipsis
    assert str(DagCycleError(tuple(range(9)))) == (
        "transition DAG has a cycle: 9 nodes never become ready (0, 1, 2, 3, 4, 5, 6, 7, ...)")
    # twelve nodes: still the first eight, and the count says twelve
    assert str(DagCycleError(tuple(range(100, 112)))) == (
        "transition DAG has a cycle: 12 nodes never become ready (100, 101, 102, 103, 104, 105, 106, 107, ...)")


def test_a_coverage_error_names_unit_gpu_key_and_rows() -> None:
    err = CoverageError("actor-train.s0.v2.r1", 5, ("layers.3.mlp.w1", "param"), ((0, 4), (8, 10)))
    assert (err.target, err.gpu, err.key, err.rows) == (
        "actor-train.s0.v2.r1", 5, ("layers.3.mlp.w1", "param"), ((0, 4), (8, 10)))
    assert str(err) == ("actor-train.s0.v2.r1 on GPU 5: ('layers.3.mlp.w1', 'param') rows [(0, 4), (8, 10)] "
                        "held by no source")
