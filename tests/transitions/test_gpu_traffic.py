"""A Split's, Merge's or Extend's footprint from its target GPUs' memoised entries, by runs of like layers
(transitions.gpu_traffic, layer_runs, wire_stream), equals the one derived from every piece at once
(footprints.derive_footprint: covers, pieces, the executor's bucketizer): bytes, bucket memory and
even dict order, on random plan changes that share one cache, as the daemon's builds do."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from planner.errors import InfeasibleError
from planner.hardware import CPU, LOOPBACK, NVLINK4, ClusterSpec
from planner.models import ModelSpec
from planner.plan import GlobalPlan, StagePlan
from transitions import gpu_traffic
from transitions.covers import counter_pieces, derive_target
from transitions.footprints import _canonical_footprint, derive_footprint
from transitions.global_dag import build_transition
from transitions.gpu_traffic import PairWire
from transitions.planning_cache import PlanningCache
from transitions.primitives import Footprint, Primitive
from transitions.scenarios import Scenario, random_scenario, random_stage_plan, stage_states
from transitions.transfer_plan import Piece

# deep enough for runs of like layers, big enough (MBs a tensor) that buckets fill and rounds turn over
DEEP = ModelSpec(name="deep", num_layers=24, hidden_size=512, num_attention_heads=8, num_kv_heads=4, head_dim=64,
                 ffn_hidden_size=1536, vocab_size=1000)
SMALL_BUCKET = 64 << 10


def _items(fp: Footprint) -> list[list[object]]:
    return [list(d.items()) for d in (fp.alloc_bytes, fp.free_bytes, fp.buffer_bytes, fp.local_bytes, fp.pair_bytes)]


def _nodes(sc: Scenario) -> list[Primitive]:
    try:
        dag = build_transition(sc.states, sc.cluster, sc.old, sc.new, lost_gpus=sc.lost_gpus, exact=True,
                               cache=PlanningCache())
    except (InfeasibleError, ValueError):
        return []
    return [p for p in dag.nodes if gpu_traffic.applies(p)]


def _deep_scenario(rng: random.Random) -> Scenario:
    cluster = ClusterSpec(device=CPU, num_nodes=2, gpus_per_node=4, intra_node_link=NVLINK4, inter_node_link=LOOPBACK)
    states = stage_states(DEEP)
    names = rng.sample(sorted(states), 2)
    states = {n: states[n] for n in names}

    def plan(version: int) -> GlobalPlan:
        return GlobalPlan(version=version, stages=tuple(random_stage_plan(rng, n, DEEP, cluster.num_gpus, 2)
                                                        for n in names))

    return Scenario(states=states, cluster=cluster, old=plan(1), new=plan(2), lost_gpus=frozenset())


def _check(nodes: list[Primitive], cache: PlanningCache) -> int:
    for prim in nodes:
        assert _items(_canonical_footprint(prim, cache)) == _items(derive_footprint(prim)), prim
        assert _items(_canonical_footprint(prim, cache, buffers=False)) == _items(derive_footprint(prim, False))
    return len(nodes)


def test_random_plan_changes_match_the_derivation_from_every_piece() -> None:
    cache = PlanningCache()
    checked = sum(_check(_nodes(random_scenario(random.Random(seed), loss_probability=0.3)), cache)
                  for seed in range(60))
    assert checked > 100
    assert len(cache.dst_traffic) and len(cache.pair_wires)


@pytest.mark.parametrize("seed", range(6))
def test_deep_models_match_with_layers_skipped(seed: int) -> None:
    nodes = _nodes(_deep_scenario(random.Random(seed)))
    assert _check(nodes, PlanningCache()) == len(nodes)


def _pairs(prim: Primitive, bucket: int | None = SMALL_BUCKET) -> Iterator[tuple[list[Piece], PairWire | None]]:
    """Every pair of ``prim``: its pieces from every piece at once, and its wire streamed by layer runs
    with buckets of ``bucket`` bytes (None: the default)."""
    for target in prim.targets:
        for gpu in target.gpus:
            segs = gpu_traffic.gpu_segments(prim, target, gpu)
            counter = [p for p in counter_pieces(prim) if p.dst_worker == gpu]
            every = counter + derive_target(target, prim.sources, gpu)
            for src in sorted({p.src_worker for p in every} - {gpu}):
                wire = gpu_traffic.streamed(prim, target, gpu, src, segs, (counter or [None])[0], bucket)
                yield [p for p in every if p.src_worker == src], wire


def test_streamed_rounds_match_the_bucketizer_when_rounds_turn_over() -> None:
    """Small buckets: each pair's rounds fill and turn over, and the streamed wire (periods skipped)
    still equals the bucketizer's own over every piece."""
    pairs = [pair for seed in range(6) for prim in _nodes(_deep_scenario(random.Random(seed)))
             for pair in _pairs(prim)]
    streamed = [(pieces, wire) for pieces, wire in pairs if wire is not None]
    for pieces, wire in streamed:
        assert wire == gpu_traffic.pair_wire(pieces, SMALL_BUCKET)
    assert len(streamed) > 50 and max(len(w.sent) for _, w in streamed) > 3  # type: ignore[union-attr]
    assert any(max(w.received, default=0) for _, w in streamed)  # type: ignore[union-attr]


def test_stage_plans_reuse_entries_across_placements() -> None:
    """The same layouts at another offset on the GPUs: every target GPU's entry is met again."""
    rng = random.Random(3)
    cluster = ClusterSpec(device=CPU, num_nodes=4, gpus_per_node=4, intra_node_link=NVLINK4, inter_node_link=LOOPBACK)
    states = {"actor-train": stage_states(DEEP)["actor-train"]}
    old = random_stage_plan(rng, "actor-train", DEEP, 8, 1)
    new = random_stage_plan(rng, "actor-train", DEEP, 8, 1)
    cache = PlanningCache()
    for offset in (0, 8):
        def moved(sp: StagePlan, version: int, offset: int = offset) -> GlobalPlan:
            sets = tuple(tuple(g + offset for g in s) for s in sp.gpu_sets)
            return GlobalPlan(version=version, stages=(StagePlan(model_stage=sp.model_stage, layout=sp.layout,
                                                                 gpu_sets=sets, micro_batch_size=1),))
        sc = Scenario(states=states, cluster=cluster, old=moved(old, 1), new=moved(new, 2), lost_gpus=frozenset())
        _check(_nodes(sc), cache)
        if offset == 0:
            entries = len(cache.dst_traffic)
    assert len(cache.dst_traffic) == entries


def test_pairs_of_zero_copy_pieces_hold_no_bucket_as_the_bucketizer_says() -> None:
    """A pair whose every piece goes direct by itself (contiguous on both sides, DIRECT_MIN_BYTES long:
    a real 8B model's weights) is answered without streaming; the answer is the bucketizer's own."""
    from planner.models import LLAMA_31_8B
    from transitions.transfer_plan import DEFAULT_BUCKET_BYTES

    cluster = ClusterSpec(device=CPU, num_nodes=2, gpus_per_node=4, intra_node_link=NVLINK4, inter_node_link=LOOPBACK)
    rng = random.Random(3)
    states = stage_states(LLAMA_31_8B)
    names = ["actor-gen", "ref-inf"]
    alone = other = 0
    for _ in range(8):
        sc = Scenario(states={n: states[n] for n in names}, cluster=cluster, lost_gpus=frozenset(),
                      old=GlobalPlan(version=1, stages=tuple(random_stage_plan(rng, n, LLAMA_31_8B, 8, 2) for n in names)),
                      new=GlobalPlan(version=2, stages=tuple(random_stage_plan(rng, n, LLAMA_31_8B, 8, 2) for n in names)))
        for prim in _nodes(sc):
            counters = counter_pieces(prim)
            for pieces, wire in _pairs(prim, None):
                assert wire == gpu_traffic.pair_wire(pieces, DEFAULT_BUCKET_BYTES)
                if all(gpu_traffic._direct_alone(p) for p in pieces if p not in counters):
                    alone += 1
                else:
                    other += 1
    assert alone >= 10 and other >= 10  # both paths taken


def test_a_piece_goes_direct_alone_from_exactly_direct_min_bytes() -> None:
    """The shortcut's test is the bucketizer's: a contiguous run of DIRECT_MIN_BYTES goes direct."""
    from transitions.layout import make_slot
    from transitions.transfer_plan import DIRECT_MIN_BYTES, messages

    n = DIRECT_MIN_BYTES // 4
    slot = make_slot("w", "param", "float32", (2 * n,), (0,), (2 * n,), 0, ())

    def piece(k: int) -> Piece:
        return Piece(src_worker=0, dst_worker=1, src_slot=slot, dst_slot=slot, box=((0,), (k,)), src_unit="a",
                     dst_unit="b")

    assert gpu_traffic._direct_alone(piece(n)) and not gpu_traffic._direct_alone(piece(n - 1))
    # the one a run by itself, the other a bucket by itself that lies in place on both sides: neither holds memory
    assert [m.src_start for m in messages([piece(n), piece(n - 1)])] == [0, 0]
    assert gpu_traffic.pair_wire([piece(n - 1)]) == gpu_traffic.pair_wire([piece(n)]) == PairWire((), ())
    strided = make_slot("w", "param", "float32", (4, 2 * n), (0, 0), (4, 2 * n), 0, ())
    wide = Piece(src_worker=0, dst_worker=1, src_slot=strided, dst_slot=strided, box=((0, 0), (2, n)), src_unit="a",
                 dst_unit="b")  # n columns of 2 rows of 2n: 2 * DIRECT_MIN_BYTES, not contiguous
    assert wide.num_bytes == 2 * DIRECT_MIN_BYTES and not gpu_traffic._direct_alone(wide)


def test_a_piece_goes_direct_alone_only_if_contiguous_on_both_sides() -> None:
    """A whole slot on one side, a strided box of the other's: not direct alone, whichever side it is."""
    from transitions.layout import make_slot
    from transitions.transfer_plan import DIRECT_MIN_BYTES

    n = DIRECT_MIN_BYTES // 4
    whole = make_slot("w", "param", "float32", (4, 2 * n), (0, 0), (2, n), 0, ())
    strided = make_slot("w", "param", "float32", (4, 2 * n), (0, 0), (4, 2 * n), 0, ())
    box = ((0, 0), (2, n))  # all of ``whole``, n columns of 2 rows of ``strided``

    def piece(src: object, dst: object) -> Piece:
        return Piece(src_worker=0, dst_worker=1, src_slot=src, dst_slot=dst, box=box, src_unit="a",  # type: ignore[arg-type]
                     dst_unit="b")

    assert gpu_traffic._direct_alone(piece(whole, whole))
    assert not gpu_traffic._direct_alone(piece(strided, whole))
    assert not gpu_traffic._direct_alone(piece(whole, strided))
