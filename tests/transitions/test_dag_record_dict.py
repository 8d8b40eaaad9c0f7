"""A transition DAG's record (transitions.dag_record.TransitionDAG): its JSON form, its per-GPU node
lists and the same DAG in another order, on a move worked out by hand (one TP1 replica from GPU 0 to
GPU 1: an Extend, then the Destroy of the old copy)."""

from __future__ import annotations

import json

from test_replica_classes import symmetric_case

from planner.hardware import CPU, LOOPBACK, NVLINK4, ClusterSpec
from planner.models import ModelSpec
from planner.plan import GlobalPlan, Layout
from planner.workflow import ACTOR_TRAIN, CRITIC_TRAIN
from transitions.dag_record import data_edges, held_bytes
from transitions.emu import EMU
from transitions.global_dag import build_transition
from transitions.local_dag import target_parts
from transitions.planning_cache import PlanningCache
from transitions.primitives import Destroy, Extend, Merge
from transitions.scenarios import stage_plan, stage_states

TINY = ModelSpec(name="tiny", num_layers=2, hidden_size=8, num_attention_heads=2, num_kv_heads=2, head_dim=4,
                 ffn_hidden_size=16, vocab_size=8)
STATES = stage_states(TINY, (ACTOR_TRAIN,))
CLUSTER = ClusterSpec(device=CPU, num_nodes=1, gpus_per_node=4, intra_node_link=NVLINK4, inter_node_link=LOOPBACK)
OLD, NEW = "actor-train@v1#0", "actor-train@v2#0"


def _move(old_gpus: list[int], new_gpus: list[int], replicas: int = 1):
    old = GlobalPlan(version=1, stages=(stage_plan("actor-train", Layout(1, 1), old_gpus, replicas),))
    new = GlobalPlan(version=2, stages=(stage_plan("actor-train", Layout(1, 1), new_gpus, replicas),))
    return build_transition(STATES, CLUSTER, old, new, capacity_bytes=1 << 30, exact=True)


def test_the_json_record_of_a_one_replica_move() -> None:
    dag = _move([0], [1])
    size = dag.old_units[0].total_bytes()  # the replica's whole state: what the Extend sends
    out = json.loads(json.dumps(dag.to_dict()))  # plain JSON all through
    units = out.pop("units")
    assert out == {
        "old_version": 1, "new_version": 2,
        "nodes": [{"id": 0, "kind": "extend", "sources": [OLD], "targets": [NEW], "frees": [], "bytes_moved": size},
                  {"id": 1, "kind": "destroy", "sources": [], "targets": [], "frees": [OLD], "bytes_moved": 0}],
        "data_edges": [[0, 1]], "resource_edges": [], "order": [0, 1],
        "old_units": [OLD], "lost_units": [], "new_units": [NEW], "renamed": [], "stale_units": [],
        "capacity_bytes": 1 << 30, "peak_bytes": {"0": size, "1": size}, "bytes_moved": size}
    assert list(units) == [OLD, NEW]  # each unit once, in first mention
    assert units[OLD] == {"uid": OLD, "model_stage": "actor-train", "tp": 1, "pp": 1, "gpus": [0], "version": 1}
    assert units[NEW] == {"uid": NEW, "model_stage": "actor-train", "tp": 1, "pp": 1, "gpus": [1], "version": 2}


def test_a_kept_replica_is_described_though_no_node_names_it() -> None:
    dag = _move([0, 1], [0, 2], replicas=2)  # replica 0 stays on GPU 0 (renamed), replica 1 moves to GPU 2
    out = dag.to_dict()
    assert [n["kind"] for n in out["nodes"]] == ["extend", "destroy"]
    assert out["renamed"] == [[OLD, NEW]]
    named = {u for n in out["nodes"] for k in ("sources", "targets", "frees") for u in n[k]}
    assert NEW not in named  # the kept replica's new name is in no node ...
    assert set(out["units"]) == {OLD, NEW, "actor-train@v1#1", "actor-train@v2#1"}  # ... but is described
    assert out["units"][OLD]["gpus"] == [0] and out["units"]["actor-train@v2#1"]["gpus"] == [2]
    assert out["units"][NEW] == {"uid": NEW, "model_stage": "actor-train", "tp": 1, "pp": 1, "gpus": [0],
                                 "version": 2}


def test_nodes_on_a_gpu_and_the_same_dag_in_another_order() -> None:
    dag = _move([0, 1], [2, 3], replicas=2)  # two Extends (0->2, 1->3), two Destroys
    kinds = [p.kind.value for p in dag.nodes]
    assert sorted(kinds) == ["destroy", "destroy", "extend", "extend"]
    by_gpu = {g: [kinds[i] for i in dag.nodes_on(g)] for g in range(4)}
    assert by_gpu == {0: ["extend", "destroy"], 1: ["extend", "destroy"], 2: ["extend"], 3: ["extend"]}
    assert dag.nodes_on(7) == []
    rev = tuple(reversed(dag.order))
    other = dag.with_order(rev, resource_edges=((rev[0], rev[1]),))
    assert other.order == rev and other.resource_edges == ((rev[0], rev[1]),)
    assert (other.old_version, other.new_version, other.capacity_bytes) == (1, 2, dag.capacity_bytes)
    assert other.nodes == dag.nodes and other.data_edges == dag.data_edges
    for g in range(4):  # each GPU's list follows the new order
        assert other.nodes_on(g) == sorted(dag.nodes_on(g), key=rev.index)
    assert dag.order != rev and dag.resource_edges == ()  # the original is untouched


def test_held_bytes_sum_every_units_own_bytes_per_gpu() -> None:
    both = stage_states(TINY, (ACTOR_TRAIN, CRITIC_TRAIN))
    actor, critic = both["actor-train"], both["critic-train"]
    one, two = Layout(1, 1), Layout(2, 1)  # one layout object shared by two states
    big = EMU(uid="big", state=actor, layout=two, gpus=(0, 1), version=1)
    units = [EMU(uid="a", state=actor, layout=one, gpus=(0,), version=1),
             EMU(uid="c", state=critic, layout=one, gpus=(0,), version=1),  # same layout object, other state
             EMU(uid="a2", state=actor, layout=two, gpus=(2, 3), version=1),  # same state, other layout
             EMU(uid="a3", state=actor, layout=one, gpus=(3,), version=1),
             *target_parts(big, one)]  # T_sub parts: each holds its final unit's shards
    assert all(p.final is big for p in units[4:]) and len(units) == 6
    want: dict[int, int] = {}
    for u in units:
        for g in u.gpus:
            want[g] = want.get(g, 0) + u.bytes_on(g)
    assert held_bytes(units) == want
    assert want[0] == units[0].bytes_on(0) + units[1].bytes_on(0) + big.bytes_on(0)
    assert units[0].bytes_on(0) != units[1].bytes_on(0) and units[2].bytes_on(2) != units[0].bytes_on(0)
    assert held_bytes([]) == {}


def test_data_edges_run_producer_to_reader_producer_to_freer_and_reader_to_freer() -> None:
    a, x, y = (EMU(uid=n, state=STATES["actor-train"], layout=Layout(1, 1), gpus=(g,), version=1)
               for n, g in (("a", 0), ("x", 1), ("y", 2)))
    nodes = [Extend(sources=(a,), target=x), Extend(sources=(x,), target=y), Destroy(unit=x), Destroy(unit=y)]
    # x: made by 0, read by 1, freed by 2; y: made by 1, freed by 3; a: read by 0, made and freed by none
    assert data_edges(nodes) == [(0, 1), (0, 2), (1, 2), (1, 3)]
    merge = [Extend(sources=(a,), target=x), Merge(parts=(a, x), unit=y)]  # reads and frees its parts
    assert data_edges(merge) == [(0, 1)]


def test_a_split_part_and_resource_edges_are_in_the_json_record() -> None:
    old = GlobalPlan(version=1, stages=(stage_plan("actor-train", Layout(1, 1), [0], 1),))
    new = GlobalPlan(version=2, stages=(stage_plan("actor-train", Layout(2, 1), [0, 1], 1),))
    dag = build_transition(STATES, CLUSTER, old, new, capacity_bytes=1 << 30, exact=True)
    out = dag.to_dict()  # an Extend makes the part on GPU 1, a Merge makes the TP2 unit of it
    assert [n["kind"] for n in out["nodes"]] == ["extend", "merge"]
    part = out["nodes"][0]["targets"][0]
    assert part not in out["old_units"] + out["new_units"]
    assert out["units"][part]["gpus"] == [1] and out["units"][part]["uid"] == part
    assert all(isinstance(v, dict) for v in out["units"].values())
    assert dag.with_order(dag.order, resource_edges=((0, 1),)).to_dict()["resource_edges"] == [[0, 1]]


def test_an_expanded_replica_plan_is_the_exact_paths_dag() -> None:
    cases = [symmetric_case(seed) for seed in range(20)]
    fast = exact = None
    for states, cluster, old, new in cases:
        fast = build_transition(states, cluster, old, new, capacity_bytes=1 << 50, exact=False,
                                cache=PlanningCache())
        if fast.replicas is not None and fast.num_nodes > 2:
            exact = build_transition(states, cluster, old, new, capacity_bytes=1 << 50, exact=True)
            break
    assert fast is not None and exact is not None, "no symmetric case of seeds 0-19 took the class path"
    assert not fast.expanded and fast.body is not None and fast.expanded  # the record expands on first use
    pos = {p: i for i, p in enumerate(exact.nodes)}
    assert sorted(fast.nodes, key=repr) == sorted(exact.nodes, key=repr)
    assert [exact.stage_order[pos[p]] for p in fast.nodes] == list(fast.stage_order)
    assert set(fast.data_edges) == set(data_edges(list(fast.nodes))) and fast.resource_edges == ()
    assert sorted(fast.order) == list(range(fast.num_nodes))
    assert set(fast.old_units) == set(exact.old_units) and set(fast.new_units) == set(exact.new_units)
    assert fast.lost_units == () and fast.stale_units == () and sorted(fast.renamed) == sorted(exact.renamed)
    assert set(fast.peak_bytes) >= set(fast.initial_bytes) and fast.peak_bytes
    for g, ids in fast.gpu_nodes.items():
        assert list(ids) == [i for i in fast.order if g in fast.footprints[i].gpus]
