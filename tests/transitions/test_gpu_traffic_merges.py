"""A Merge's footprint from its target GPUs' memoised entries (transitions.gpu_traffic, by runs of like
layers) equals the one derived from every piece (footprints.derive_footprint), bytes, bucket memory and
dict order: on hand-made Merges whose parts arrive in final shape on none, some or all of the unit's
GPUs (those are relabelled, not filled: no entry, no bytes), and on the Merges of random plan changes
of a deep model (runs of like layers) and of the scenarios, sharing one cache as the daemon's builds do."""

from __future__ import annotations

import random

from planner.errors import InfeasibleError
from planner.hardware import CPU, LOOPBACK, NVLINK4, ClusterSpec
from planner.models import TINY_3M, ModelSpec
from planner.plan import GlobalPlan, Layout
from planner.workflow import ACTOR_TRAIN
from transitions import gpu_traffic
from transitions.emu import EMU
from transitions.footprints import _canonical_footprint, derive_footprint
from transitions.global_dag import build_transition
from transitions.planning_cache import PlanningCache
from transitions.primitives import Footprint, Merge, Primitive, relabels, target_gpus
from transitions.scenarios import Scenario, random_scenario, random_stage_plan, stage_states

TRAIN = stage_states(TINY_3M, (ACTOR_TRAIN,))["actor-train"]
# deep enough for runs of like layers (as tests/transitions/test_gpu_traffic.py's)
DEEP = ModelSpec(name="deep", num_layers=24, hidden_size=512, num_attention_heads=8, num_kv_heads=4, head_dim=64,
                 ffn_hidden_size=1536, vocab_size=1000)


def _merges(sc: Scenario) -> list[Merge]:
    try:
        dag = build_transition(sc.states, sc.cluster, sc.old, sc.new, lost_gpus=sc.lost_gpus, exact=True,
                               cache=PlanningCache())
    except (InfeasibleError, ValueError):
        return []
    return [p for p in dag.nodes if isinstance(p, Merge)]


def _deep_scenario(rng: random.Random) -> Scenario:
    cluster = ClusterSpec(device=CPU, num_nodes=2, gpus_per_node=4, intra_node_link=NVLINK4, inter_node_link=LOOPBACK)
    states = stage_states(DEEP)
    names = rng.sample(sorted(states), 2)

    def plan(version: int) -> GlobalPlan:
        return GlobalPlan(version=version, stages=tuple(random_stage_plan(rng, n, DEEP, cluster.num_gpus, 2)
                                                        for n in names))

    return Scenario(states={n: states[n] for n in names}, cluster=cluster, old=plan(1), new=plan(2),
                    lost_gpus=frozenset())


def _u(uid: str, tp: int, gpus: tuple[int, ...], final: EMU | None = None) -> EMU:
    return EMU(uid=uid, state=TRAIN, layout=Layout(tp, 1), gpus=gpus, version=1, final=final)


def _items(fp: Footprint) -> list[list[object]]:
    return [list(d.items()) for d in (fp.alloc_bytes, fp.free_bytes, fp.buffer_bytes, fp.local_bytes, fp.pair_bytes)]


def _check(prim: Primitive, cache: PlanningCache) -> None:
    assert gpu_traffic.applies(prim)
    for buffers in (True, False):
        assert _items(_canonical_footprint(prim, cache, buffers)) == _items(derive_footprint(prim, buffers)), prim


def test_hand_made_merges_match_the_derivation_from_every_piece() -> None:
    home = _u("m", 2, (0, 1))
    cases = [
        Merge(parts=(_u("p0", 1, (0,)), _u("p1", 1, (1,))), unit=home),  # neither in final shape
        Merge(parts=(_u("p0", 1, (0,), final=home), _u("p1", 1, (1,))), unit=home),  # GPU 0 relabelled
        Merge(parts=(_u("p0", 1, (2,)), _u("p1", 1, (3,))), unit=home),  # every byte over the wire
        Merge(parts=(_u("p0", 1, (1,)), _u("p1", 1, (0,))), unit=home),  # each part on the other's GPU
        Merge(parts=(_u("p0", 1, (0,), final=home), _u("p1", 1, (1,), final=home)), unit=home),  # relabels
    ]
    for prim in cases:
        _check(prim, PlanningCache())


def test_a_relabelled_gpu_gets_no_entry_and_no_bytes() -> None:
    home = _u("m", 2, (0, 1))
    prim = Merge(parts=(_u("p0", 1, (0,), final=home), _u("p1", 1, (2,))), unit=home)
    assert target_gpus(prim, home) == [1]
    cache = PlanningCache()
    local, pair, buf = gpu_traffic.traffic(prim, cache)
    assert len(cache.dst_traffic) == 1  # GPU 1's entry only
    assert not local and set(pair) == {(0, 1), (2, 1)} and buf  # GPU 1 reads from both parts' GPUs
    assert gpu_traffic.traffic(Merge(parts=(_u("p0", 1, (0,), final=home), _u("p1", 1, (1,), final=home)),
                                     unit=home), cache) == ({}, {}, {})


def test_merges_of_random_plan_changes_match_sharing_one_cache() -> None:
    cache = PlanningCache()
    merges = [p for seed in range(40) for p in _merges(random_scenario(random.Random(seed), loss_probability=0.3))]
    merges += [p for seed in range(6) for p in _merges(_deep_scenario(random.Random(seed)))]
    for prim in merges:
        _check(prim, cache)
    partial = [p for p in merges if not relabels(p) and len(target_gpus(p, p.unit)) < len(p.unit.gpus)]
    assert len(merges) > 60 and len(partial) > 10  # parts in final shape on some of the unit's GPUs
    assert len(cache.dst_traffic)  # (the planner's Merges copy locally: parts arrive on the unit's GPUs)


def test_a_gpu_read_under_two_roles_sums_into_one_pair() -> None:
    """Two parts in other units' final shape on one GPU (each its final's TP rank: one half each of
    every split tensor) fill a TP1 unit elsewhere: that GPU sends under both roles, one pair's bytes."""
    half0, half1 = _u("h0", 2, (2, 3)), _u("h1", 2, (5, 2))
    prim = Merge(parts=(_u("p0", 1, (2,), final=half0), _u("p1", 1, (2,), final=half1)), unit=_u("m", 1, (0,)))
    _check(prim, PlanningCache())
    cache = PlanningCache()
    local, pair, _ = gpu_traffic.traffic(prim, cache)
    entry = cache.dst_traffic.get(gpu_traffic.dst_key(prim, prim.unit, 0, 1, 0))
    assert entry is not None and [role for role, _ in entry.received] == [(0, 0), (1, 0)]
    assert not local and pair == {(2, 0): sum(n for _, n in entry.received)}
