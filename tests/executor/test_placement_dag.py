"""Pure: stage placements as TransitionDAGs (transitions.placement_dag) and what survives a failure
(transitions.survival), both importable without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
from executor_helpers import placement

from planner.errors import SpecError
from transitions.placement_dag import placement_cluster, placement_dag, placement_units
from transitions.survival import uncovered_state


def test_pure_modules_import_without_torch() -> None:
    code = ("import sys, transitions.placement_dag, transitions.survival; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_units_cluster_and_versions() -> None:
    old = [placement("a", 2, 1, [[0, 1], [2, 3]]), placement("r", 1, 1, [[4]], training=False)]
    units = placement_units(old, version=3)
    assert [(u.uid, u.gpus) for u in units] == [("a@v3#0", (0, 1)), ("a@v3#1", (2, 3)), ("r@v3#0", (4,))]
    assert placement_cluster(old).num_gpus == 5
    new = [placement("a", 1, 1, [[5]]), placement("r", 1, 1, [[0]], training=False)]
    dag = placement_dag(old, new, old_version=3)
    assert {u.uid for u in dag.old_units} == {u.uid for u in units}
    assert {u.uid for u in dag.new_units} == {u.uid for u in placement_units(new, version=4)}


def test_refuses_other_stages_or_another_model() -> None:
    old = [placement("a", 1, 1, [[0]])]
    with pytest.raises(SpecError, match="differ"):
        placement_dag(old, [placement("b", 1, 1, [[0]])])
    with pytest.raises(SpecError, match="model, head and state kinds"):
        placement_dag(old, [placement("a", 1, 1, [[1]], training=False)])


def test_uncovered_state_follows_what_survivors_hold() -> None:
    """TP2 x DP2: each TP rank survives in one replica or is lost with both of its holders."""
    old = [placement("a", 2, 1, [[0, 1], [2, 3]])]
    dag = placement_dag(old, [placement("a", 1, 1, [[0], [1]])])
    everyone = {0: {"a@v1#0"}, 1: {"a@v1#0"}, 2: {"a@v1#1"}, 3: {"a@v1#1"}}
    assert uncovered_state(dag, everyone) == {}
    assert uncovered_state(dag, {w: everyone[w] for w in (1, 2)}) == {}  # rank 1 on 1, rank 0 on 2
    lost = uncovered_state(dag, {w: everyone[w] for w in (1, 3)})["a"]  # TP rank 0 gone from both
    assert "model.embed_tokens.weight/param" in lost and "model.norm.weight/param" not in lost
