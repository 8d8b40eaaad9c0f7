"""The planning cache is an explicit object: bounded memos, filled only by the builds it is passed to,
emptied by its owner, and never a reason for a DAG to differ."""

from __future__ import annotations

import gc
import pickle
import weakref
from collections.abc import Callable

from planner.hardware import CPU, LOOPBACK, NVLINK4, ClusterSpec
from planner.models import ModelSpec
from planner.plan import Layout
from transitions.global_dag import TransitionDAG, build_transition
from transitions.planning_cache import DEFAULT_CACHE, IdentityMemo, Memo, PlanningCache
from transitions.scenarios import PPO_STAGES, ppo_plan, stage_states

TINY = ModelSpec(name="tiny", num_layers=2, hidden_size=8, num_attention_heads=4, num_kv_heads=2, head_dim=2,
                 ffn_hidden_size=24, vocab_size=11)
STATES = stage_states(TINY, PPO_STAGES)
CLUSTER = ClusterSpec(device=CPU, num_nodes=8, gpus_per_node=4, intra_node_link=NVLINK4, inter_node_link=LOOPBACK)
OLD = ppo_plan(1, CLUSTER.num_gpus, {ms.name: Layout(1, 1) for ms in PPO_STAGES})
NEW = ppo_plan(2, CLUSTER.num_gpus, {ms.name: Layout(2, 1) for ms in PPO_STAGES})


def _same(a: TransitionDAG, b: TransitionDAG) -> None:
    assert a.nodes == b.nodes and a.order == b.order and a.data_edges == b.data_edges
    assert a.footprints == b.footprints and a.peak_bytes == b.peak_bytes and a.gpu_nodes == b.gpu_nodes


def test_memos_stay_bounded() -> None:
    flat: Memo[int, str] = Memo(3)
    for k in range(10):
        flat.put(k, str(k))
        assert len(flat) <= 3
    assert flat.get(9) == "9"
    lru: Memo[str, int] = Memo(2, lru=True)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.get("a") == 1  # a used last: b goes first
    lru.put("c", 3)
    assert (lru.get("a"), lru.get("b"), lru.get("c"), len(lru)) == (1, None, 3, 2)
    ident: IdentityMemo[int] = IdentityMemo(4)
    for k in range(10):
        obj = object()
        ident.get_or_make((id(obj), k), (obj,), int)
        assert len(ident) <= 4


def test_identity_memo_pins_its_objects_so_ids_are_never_reused() -> None:
    class Plan:
        def __init__(self, value: int) -> None:
            self.value = value

        def __eq__(self, other: object) -> bool:
            return isinstance(other, Plan) and other.value == self.value

        __hash__ = object.__hash__

    memo: IdentityMemo[int] = IdentityMemo(8)
    made: list[int] = []

    def maker(value: int) -> Callable[[], int]:
        return lambda: made.append(value) or value  # type: ignore[func-returns-value]

    plan = Plan(1)
    alive = weakref.ref(plan)
    other = Plan(1)
    assert memo.get_or_make((id(plan), "x"), (plan,), maker(1)) == 1
    assert memo.get_or_make((id(plan), "x"), (plan,), maker(2)) == 1  # the same object: a hit
    assert memo.get_or_make((id(other), "x"), (other,), maker(3)) == 3  # equal, but another object
    assert memo.get_or_make((id(plan), "y"), (plan,), maker(4)) == 4  # another extra
    assert made == [1, 3, 4]
    del plan
    gc.collect()
    assert alive() is not None  # held by its entry: no other object can take its id meanwhile
    memo.clear()
    gc.collect()
    assert alive() is None


def test_a_build_fills_only_the_cache_it_is_given() -> None:
    before = DEFAULT_CACHE.sizes()
    cache = PlanningCache()
    fast = build_transition(STATES, CLUSTER, OLD, NEW, exact=False, cache=cache)
    assert fast.replicas is not None and not fast.expanded
    filled = cache.sizes()
    # every memo served the fast path (the per-GPU ones serve Splits, Merges and Extends that move bytes,
    # which this change has none of: TP1 -> TP2 merges in place; tests/transitions/test_gpu_traffic.py fills them)
    assert all(n for memo, n in filled.items() if memo not in ("dst_traffic", "pair_wires", "pair_streams")), filled
    _ = fast.nodes  # expanding reads footprints: from the builder's cache too
    exact = build_transition(STATES, CLUSTER, OLD, NEW, exact=True, cache=cache)
    _same(fast, exact)
    assert DEFAULT_CACHE.sizes() == before  # nobody else's cache was touched
    warm = cache.sizes()
    again = build_transition(STATES, CLUSTER, OLD, NEW, exact=False, cache=cache)
    assert cache.sizes() == warm  # every lookup a hit
    assert again.replicas is not None and again.replicas.stages[0] is fast.replicas.stages[0]
    cache.clear()
    assert not any(cache.sizes().values())
    _same(build_transition(STATES, CLUSTER, OLD, NEW, exact=False, cache=cache), fast)  # cold: the same DAG
    _same(build_transition(STATES, CLUSTER, OLD, NEW, exact=False), fast)  # the default: the same DAG


def test_a_pickled_dag_leaves_its_builders_cache_behind() -> None:
    cache = PlanningCache()
    dag = build_transition(STATES, CLUSTER, OLD, NEW, exact=False, cache=cache)
    blob = pickle.dumps(dag)
    assert b"PlanningCache" not in blob
    restored = pickle.loads(blob)
    assert restored.replicas is not None and restored.replicas.cache is None and dag.replicas.cache is cache
    _same(restored, dag)  # expanded with the receiving process's default cache
