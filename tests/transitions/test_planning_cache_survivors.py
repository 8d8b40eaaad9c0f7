"""Memo bounds, the smallest legal memo, and the names PlanningCache reports its memos by."""

from __future__ import annotations

import pytest

from transitions.planning_cache import IdentityMemo, Memo, PlanningCache


def test_a_plain_memo_empties_at_once_when_full() -> None:
    memo: Memo[str, int] = Memo(2)  # lru is off unless asked for
    memo.put("a", 1)
    memo.put("b", 2)
    memo.put("c", 3)  # full: the two old entries go together
    assert len(memo) == 1
    assert memo.get("b") is None
    assert memo.get("c") == 3


@pytest.mark.parametrize("make", [lambda n: Memo(n), lambda n: IdentityMemo(n)])
def test_one_entry_is_the_smallest_memo(make) -> None:  # type: ignore[no-untyped-def]
    assert make(1).max_entries == 1
    with pytest.raises(ValueError, match="max_entries must be at least 1, got 0"):
        make(0)


def test_an_identity_memo_of_one_keeps_one_entry() -> None:
    memo: IdentityMemo[int] = IdentityMemo(1)
    a, b = object(), object()
    assert memo.get_or_make((id(a),), (a,), lambda: 1) == 1
    assert memo.get_or_make((id(b),), (b,), lambda: 2) == 2
    assert len(memo) == 1


def test_sizes_names_every_memo_by_its_field() -> None:
    cache = PlanningCache()
    cache.footprints.put(("x",), object())  # type: ignore[arg-type]
    sizes = cache.sizes()
    assert sizes == {"footprints": 1, "dst_traffic": 0, "pair_wires": 0, "pair_streams": 0, "class_shapes": 0,
                     "shape_stages": 0, "stage_pairs": 0, "gpu_arrays": 0, "owners": 0, "held_bytes": 0}
