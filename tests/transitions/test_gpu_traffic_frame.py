"""The TP groups' keys of transitions.gpu_traffic (``tp_frame``): target GPUs of one TP group share one
derivation, their roles moved; every GPU's entry and pair wires equal those derived for it alone, and
every footprint the one from every piece (footprints.derive_footprint), on random placements of plans
of one TP degree, regular and not (uneven chunks, kv heads shared by ranks)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
from test_gpu_traffic import DEEP, _items, _nodes

from planner.hardware import CPU, LOOPBACK, NVLINK4, ClusterSpec
from planner.models import Head, ModelSpec
from planner.plan import GlobalPlan, Layout, StagePlan
from transitions import gpu_traffic
from transitions.emu import EMU
from transitions.footprints import _canonical_footprint, derive_footprint
from transitions.gpu_traffic import _commutes, _moved, regular, tp_frame, tp_rank
from transitions.planning_cache import PlanningCache
from transitions.primitives import Extend, Primitive, target_gpus
from transitions.scenarios import Scenario, stage_states

# 6 kv heads, vocab 1002: TP 2, 3 and 6 regular; TP 4 chunks the vocab and kv rows unevenly
ODD = ModelSpec(name="odd", num_layers=6, hidden_size=132, num_attention_heads=12, num_kv_heads=6, head_dim=11,
                ffn_hidden_size=264, vocab_size=1002)


def _one_tp_scenario(rng: random.Random, model: ModelSpec, tp: int) -> Scenario:
    """Old and new plans of 1-2 model-stages, all of TP ``tp``, random PP, replicas and placements."""
    cluster = ClusterSpec(device=CPU, num_nodes=4, gpus_per_node=4, intra_node_link=NVLINK4, inter_node_link=LOOPBACK)
    states = stage_states(model)
    names = rng.sample(sorted(states), rng.randint(1, 2))

    def plan(version: int) -> GlobalPlan:
        stages = []
        for name in names:
            pp = rng.choice([p for p in range(1, min(model.num_layers, 16 // tp) + 1)])
            layout = Layout(tp, pp)
            dp = rng.randint(1, min(2, 16 // layout.size))
            gpus = rng.sample(range(16), dp * layout.size)
            sets = tuple(tuple(gpus[r * layout.size:(r + 1) * layout.size]) for r in range(dp))
            stages.append(StagePlan(model_stage=name, layout=layout, gpu_sets=sets, micro_batch_size=1))
        return GlobalPlan(version=version, stages=tuple(stages))

    return Scenario(states={n: states[n] for n in names}, cluster=cluster, old=plan(1), new=plan(2),
                    lost_gpus=frozenset())


def _framed(model: ModelSpec, tp: int, seeds: range) -> list[Primitive]:
    return [p for seed in seeds for p in _nodes(_one_tp_scenario(random.Random(seed), model, tp))]


@pytest.mark.parametrize(("model", "tp"), [(DEEP, 2), (DEEP, 4), (ODD, 3), (ODD, 6)])
def test_tp_groups_share_entries_and_match_the_derivation_from_every_piece(model: ModelSpec, tp: int) -> None:
    prims = _framed(model, tp, range(12))
    framed = [p for p in prims if tp_frame(p) == tp]
    assert len(framed) >= 8
    cache = PlanningCache()
    for prim in prims:  # one cache, as the daemon's builds share one
        assert _items(_canonical_footprint(prim, cache)) == _items(derive_footprint(prim)), prim
        assert _items(_canonical_footprint(prim, cache, buffers=False)) == _items(derive_footprint(prim, False))
    gpus = {gpu_traffic.dst_key(p, t, g, 1, 0) for p in prims for t in p.targets for g in target_gpus(p, t)}
    assert len(cache.dst_traffic) < len(gpus)  # groups shared what the GPUs' own keys would not


@pytest.mark.parametrize(("model", "tp"), [(DEEP, 2), (DEEP, 4), (ODD, 3)])
def test_each_gpu_of_a_group_gets_its_own_entry_and_wires(model: ModelSpec, tp: int) -> None:
    """Entries served by a group key (derived for another GPU of the group, in another order of GPUs)
    equal the entry and wires each GPU gets under its own key, in a cache of its own."""
    met = 0
    for prim in (p for p in _framed(model, tp, range(12, 24)) if tp_frame(p) == tp):
        shared = PlanningCache()
        gpus = [(t, g) for t in prim.targets for g in target_gpus(prim, t)]
        for target, gpu in gpus[::-1] + gpus:
            by = tp_rank(target, gpu, tp)
            key = gpu_traffic.dst_key(prim, target, gpu, tp, -by)
            entry, segs = gpu_traffic.dst_traffic(prim, target, gpu, key, shared, tp, by)
            wires = gpu_traffic.dst_wires(prim, target, gpu, key, entry, segs, shared, tp, by)
            alone = PlanningCache()
            own = gpu_traffic.dst_key(prim, target, gpu, 1, 0)
            want, want_segs = gpu_traffic.dst_traffic(prim, target, gpu, own, alone, 1, 0)
            assert entry == want
            assert wires == gpu_traffic.dst_wires(prim, target, gpu, own, want, want_segs, alone, 1, 0)
            met += segs is None and by != 0
    assert met > 20


def test_regular_boxes() -> None:
    lm = Head.LM
    assert regular(DEEP, lm, 2) and regular(DEEP, lm, 4) and regular(ODD, lm, 3) and regular(ODD, lm, 6)
    assert not regular(DEEP, lm, 1)  # nothing to move
    assert not regular(DEEP, lm, 8)  # 4 kv heads: ranks 2k and 2k+1 share one
    assert not regular(ODD, lm, 4)  # 1002 vocab rows, 66 kv rows: uneven chunks
    assert regular(ODD, lm, 2) and regular(ODD, Head.VALUE, 4) is False


def test_moved_positions_and_commuting_maps() -> None:
    assert [_moved(p, 4, 1) for p in (-1, 0, 3, 4, 7, 9)] == [-1, 1, 0, 5, 4, 10]
    assert [_moved(p, 4, -3) for p in (0, 3, 6)] == [1, 0, 7]
    assert _moved(5, 1, 0) == 5
    assert _commutes((0, 1, 2, 3), 2) and _commutes((2, 3, 0, 1), 2) and _commutes((1, 0, 3, 2), 2)
    assert not _commutes((0, 2, 1, 3), 2)  # TP ranks of the part are PP stages of the final
    assert not _commutes((0, 1, 2), 2)


def _unit(uid: str, layout: Layout, gpus: tuple[int, ...], final: EMU | None = None, stage: str = "actor-train"
          ) -> EMU:
    return EMU(uid=uid, state=stage_states(DEEP)[stage], layout=layout, gpus=gpus, version=0, final=final)


def test_frame_needs_one_tp_one_model_and_commuting_finals() -> None:
    a = _unit("a", Layout(2, 2), (0, 1, 2, 3))
    assert tp_frame(Extend(sources=(a,), target=_unit("b", Layout(2, 1), (4, 5)))) == 2
    assert tp_frame(Extend(sources=(a,), target=_unit("b", Layout(4, 1), (4, 5, 6, 7)))) is None
    assert tp_frame(Extend(sources=(a,), target=_unit("b", Layout(1, 2), (4, 5)))) is None
    assert tp_frame(Extend(sources=(a,), target=_unit("b", Layout(8, 1), tuple(range(4, 12))))) is None
    assert tp_frame(Extend(sources=(a,), target=_unit("b", Layout(2, 1), (4, 5), stage="critic-train"))) is None
    final = _unit("f", Layout(2, 2), (4, 5, 6, 7))
    assert tp_frame(Extend(sources=(a,), target=_unit("b", Layout(2, 2), (4, 5, 6, 7), final))) == 2
    assert tp_frame(Extend(sources=(a,), target=_unit("b", Layout(2, 2), (4, 6, 5, 7), final))) is None
    wide = _unit("w", Layout(4, 1), (4, 5, 6, 7))
    assert tp_frame(Extend(sources=(a,), target=_unit("b", Layout(2, 2), (4, 5, 6, 7), wide))) is None
    assert tp_frame(Extend(sources=(_unit("s", Layout(2, 2), (4, 5, 6, 7), final),),
                           target=_unit("b", Layout(2, 1), (0, 1)))) == 2
    assert tp_frame(Extend(sources=(_unit("s", Layout(2, 2), (4, 6, 5, 7), final),),
                           target=_unit("b", Layout(2, 1), (0, 1)))) is None
    # a final with a final of its own is left to every GPU's own key
    deep = _unit("d", Layout(2, 2), (4, 5, 6, 7), _unit("e", Layout(2, 2), (4, 5, 6, 7)))
    assert tp_frame(Extend(sources=(a,), target=_unit("b", Layout(2, 2), (4, 5, 6, 7), deep))) is None


def test_a_tp_group_is_derived_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every GPU of a TP group after the first is served from the memos: one segment derivation per
    group key, one wire per pair entry, the segments laid out by sender once per GPU with a pair missed."""
    calls = {"segments": 0, "wire": 0, "by_sender": 0}

    def counted(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            calls[name] += 1
            return real(*args)
        return call

    for name, attr in (("segments", "gpu_segments"), ("wire", "_wire"), ("by_sender", "by_sender")):
        monkeypatch.setattr(gpu_traffic, attr, counted(name, getattr(gpu_traffic, attr)))
    shared = 0
    for prim in (p for p in _framed(DEEP, 4, range(12)) if tp_frame(p) == 4):
        cache = PlanningCache()
        calls.update(segments=0, wire=0, by_sender=0)
        gpu_traffic.traffic(prim, cache)
        gpus = [(t, g) for t in prim.targets for g in target_gpus(prim, t)]
        keys = {gpu_traffic.dst_key(prim, t, g, 4, -tp_rank(t, g, 4)) for t, g in gpus}
        assert calls["segments"] == len(keys) == len(cache.dst_traffic)
        assert calls["wire"] == len(cache.pair_wires)
        assert calls["by_sender"] == len({pkey[0] for pkey in cache.pair_wires._data})
        shared += len(gpus) - len(keys)
    assert shared > 20
