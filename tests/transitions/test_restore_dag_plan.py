"""restore_dag (transitions.restore_dag) without processes: one Restore per unit, in the units' order,
allocating each unit's bytes and moving none; the peaks, capacity and version worked out by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.errors import SpecError
from planner.models import Head, ModelSpec
from planner.plan import Layout
from transitions.emu import EMU
from transitions.geometry import INFERENCE_KINDS, TRAINING_KINDS
from transitions.layout import StagePlacement
from transitions.placement_dag import placement_units
from transitions.primitives import PrimitiveKind, Restore
from transitions.restore_dag import restore_dag

TINY = ModelSpec(name="tiny", num_layers=2, hidden_size=8, num_attention_heads=4, num_kv_heads=2, head_dim=2,
                 ffn_hidden_size=24, vocab_size=11)


def _at(stage: str, gpu_sets: list[list[int]], *, tp: int = 1, training: bool = True) -> StagePlacement:
    return StagePlacement(model_stage=stage, model=TINY, head=Head.LM,
                          kinds=TRAINING_KINDS if training else INFERENCE_KINDS, layout=Layout(tp, 1),
                          gpu_sets=tuple(tuple(g) for g in gpu_sets))


def _units() -> list[EMU]:
    # train: two DP replicas of TP=2 on [0,1] and [2,3]; gen: one TP=1 unit on GPU 1 (shares GPU 1)
    return placement_units([_at("train", [[0, 1], [2, 3]], tp=2), _at("gen", [[1]], training=False)], version=4)


def test_one_restore_node_per_unit_in_order_reading_the_checkpoint() -> None:
    units = _units()
    dag = restore_dag(units, "/ck", "step-3")
    assert len(dag.nodes) == 3
    for node, unit in zip(dag.nodes, units, strict=True):
        assert isinstance(node, Restore)
        assert node.kind is PrimitiveKind.RESTORE
        assert (node.target, node.url, node.tag) == (unit, "/ck", "step-3")
    assert dag.order == (0, 1, 2)
    assert dag.new_units == tuple(units)
    assert dag.old_units == () and dag.lost_units == () and dag.renamed == () and dag.stale_units == ()
    assert dag.data_edges == () and dag.resource_edges == ()
    assert dag.old_version == -1 and dag.new_version == 4


def test_the_stage_order_follows_each_unit() -> None:
    units = _units()
    dag = restore_dag(units, "u", "t")
    # training stages run after inference ones: stage_order 2 for train, 1 for an inference stage
    assert dag.stage_order == (2, 2, 1)


def test_peaks_are_the_sum_of_the_units_bytes_per_gpu_and_capacity_their_max() -> None:
    units = _units()
    dag = restore_dag(units, "u", "t")
    r0, r1 = units[0].bytes_on(0), units[0].bytes_on(1)
    gen = units[2].bytes_on(1)
    assert r0 > 0 and r1 > 0 and gen > 0
    assert (units[1].bytes_on(2), units[1].bytes_on(3)) == (r0, r1)  # same layout, same shares
    expected = {0: r0, 1: r1 + gen, 2: r0, 3: r1}
    assert dag.peak_bytes == expected
    assert dag.capacity_bytes == max(r0, r1 + gen)
    fps = dag.footprints
    assert [fp.alloc_bytes for fp in fps] == [{0: r0, 1: r1}, {2: r0, 3: r1}, {1: gen}]
    assert all(fp.free_bytes == {} and fp.pair_bytes == {} for fp in fps)
    assert dag.gpu_nodes == {0: (0,), 1: (0, 2), 2: (1,), 3: (1,)}


def test_new_version_is_the_highest_of_the_units() -> None:
    units = _units()
    mixed = [replace(units[0], version=2), replace(units[1], version=9), replace(units[2], version=5)]
    assert restore_dag(mixed, "u", "t").new_version == 9
    assert restore_dag(mixed[:1], "u", "t").new_version == 2


def test_a_single_unit_has_its_own_peak() -> None:
    (unit,) = placement_units([_at("gen", [[5]], training=False)], version=1)
    dag = restore_dag([unit], "u", "t")
    assert dag.peak_bytes == {5: unit.bytes_on(5)}
    assert dag.capacity_bytes == unit.bytes_on(5)
    assert dag.order == (0,)


def test_no_unit_is_refused() -> None:
    with pytest.raises(SpecError) as err:
        restore_dag([], "u", "t")
    assert str(err.value) == "units: a restore needs at least one unit to fill"


def test_a_unit_named_twice_is_refused_and_named() -> None:
    units = _units()
    with pytest.raises(SpecError) as err:
        restore_dag([units[0], units[1], units[0]], "u", "t")
    assert err.value.field == "units"
    assert f"['{units[0].uid}', '{units[0].uid}']" in str(err.value)
    assert "named twice" in str(err.value)
