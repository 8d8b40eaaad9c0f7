"""DagMemo: entries by DAG content, the last few DAGs kept, recency by match. Pure."""

from __future__ import annotations

from typing import cast

from transitions.dag_pieces import DagMemo
from transitions.global_dag import TransitionDAG


class _Dag:
    """What DagMemo reads of a DAG (its content), as a new object each time one arrives by pickle."""

    def __init__(self, version: int) -> None:
        self.old_version, self.new_version = version, version + 1
        self.nodes: tuple[object, ...] = ()
        self.order: tuple[int, ...] = ()


def _arrives(version: int) -> TransitionDAG:
    return cast(TransitionDAG, _Dag(version))


class _Counter:
    def __init__(self) -> None:
        self.made = 0

    def __call__(self) -> int:
        self.made += 1
        return self.made


def _derived_anew(memo: DagMemo, version: int) -> bool:
    """Whether a fresh copy of DAG ``version`` derives its entry again."""
    make = _Counter()
    memo.get(_arrives(version), ("pieces", 0, 0), make)
    return make.made == 1


def test_a_dag_arriving_again_finds_its_entries_by_content() -> None:
    memo = DagMemo()
    make = _Counter()
    assert memo.get(_arrives(1), ("pieces", 0, 0), make) == 1
    assert memo.get(_arrives(1), ("pieces", 0, 0), make) == 1  # another object, same content
    assert make.made == 1
    assert memo.get(_arrives(2), ("pieces", 0, 0), make) == 2  # other content: its own entries
    assert len(memo.by_content) == 2


def test_the_least_recently_matched_dag_is_dropped_first() -> None:
    memo = DagMemo(max_dags=2)
    for version in (1, 2, 3):
        _derived_anew(memo, version)
    assert len(memo.by_content) == 2
    assert not _derived_anew(memo, 3) and not _derived_anew(memo, 2)  # the last two are kept
    assert _derived_anew(memo, 1)  # the oldest went


def test_a_dag_objects_own_lookups_do_not_match_it_again() -> None:
    # an object is matched to its entries once (no hashing of its nodes after that), so only a
    # DAG's arrival makes it recent: here 1 arrived before 2, and 1's later lookups leave it oldest
    memo = DagMemo(max_dags=2)
    one = _arrives(1)
    memo.get(one, ("pieces", 0, 0), _Counter())
    _derived_anew(memo, 2)
    memo.get(one, ("pieces", 1, 0), _Counter())
    _derived_anew(memo, 3)  # drops 1
    assert not _derived_anew(memo, 2)
    assert _derived_anew(memo, 1)
