"""node_step and dag_messages on a TP1 x DP2 -> TP2 x DP2 change, where each old replica's GPU builds
its new shard early (transitions.early_builds): pure, no processes."""

from __future__ import annotations

import re

from planner.hardware import cluster_preset
from planner.models import ModelSpec
from planner.plan import GlobalPlan, Layout, StagePlan
from planner.workflow import ACTOR_TRAIN
from transitions.dag_pieces import DagMemo
from transitions.early_builds import early_builds
from transitions.global_dag import TransitionDAG, build_transition
from transitions.layout import unit_buffer_bytes
from transitions.node_steps import dag_messages, node_step
from transitions.scenarios import stage_states
from transitions.transfer_plan import Message

PAGED = ModelSpec(name="paged", num_layers=2, hidden_size=128, num_attention_heads=4, num_kv_heads=2,
                  head_dim=32, ffn_hidden_size=512, vocab_size=256, rope_theta=10_000.0)
STATES = stage_states(PAGED, (ACTOR_TRAIN,))


def _plan(version: int, tp: int, sets: list[list[int]]) -> GlobalPlan:
    return GlobalPlan(version=version, stages=(StagePlan(model_stage="actor-train", layout=Layout(tp, 1),
                                                         gpu_sets=tuple(map(tuple, sets)), micro_batch_size=1),))


DAG: TransitionDAG = build_transition(STATES, cluster_preset("cpu", 4), _plan(1, 1, [[0], [1]]),
                                      _plan(2, 2, [[0, 1], [2, 3]]))


def _received(memo: DagMemo, **kw: object) -> list[Message]:
    """Every message as its receivers derive them (the other end from dag_messages)."""
    out: list[Message] = []
    for worker in sorted(DAG.gpu_nodes):
        for node in DAG.nodes_on(worker):
            out += [m for m in node_step(DAG, node, worker, memo, **kw).messages  # type: ignore[arg-type]
                    if m.dst_worker == worker]
    return out


def _key(m: Message) -> tuple[int, int, int, int]:
    return (m.src_worker, m.dst_worker, m.round, m.tag)


def test_an_early_read_is_one_direct_message_and_the_build_leaves_no_local_copy() -> None:
    memo = DagMemo()
    (build,) = early_builds(DAG, 0, memo).values()
    (reader,) = build.readers
    (message,) = node_step(DAG, reader, 0, memo, early=True).messages
    assert message.direct and message.length == unit_buffer_bytes(build.target, 0)
    assert node_step(DAG, reader, 2, memo, early=True).messages == (message,)
    assert len(node_step(DAG, reader, 0, memo).messages) > 1  # early builds are off unless asked for
    assert node_step(DAG, build.node, 0, memo).local  # without them the building node copies
    assert not node_step(DAG, build.node, 0, memo, early=True).local


def test_a_step_names_its_stage_and_node() -> None:
    memo = DagMemo()
    for node in DAG.nodes_on(0):
        step = node_step(DAG, node, 0, memo)
        assert step.model_stage == "actor-train"
        assert re.fullmatch(rf"[a-z_]+#{node}", step.primitive)


def test_the_warm_step_is_the_memoized_one_and_carries_the_callers_prediction() -> None:
    memo = DagMemo()
    node = DAG.nodes_on(0)[0]
    first = node_step(DAG, node, 0, memo)
    assert first.predicted_s == 0.0
    assert node_step(DAG, node, 0, memo) is first  # no copy on the warm path
    timed = node_step(DAG, node, 0, memo, predicted_s=2.5)
    assert timed.predicted_s == 2.5 and timed.messages == first.messages and timed.local == first.local
    assert node_step(DAG, node, 0, memo) is first


def test_a_small_bucket_splits_a_nodes_packed_messages() -> None:
    memo = DagMemo()
    (build,) = early_builds(DAG, 0, memo).values()
    (reader,) = build.readers
    big = node_step(DAG, reader, 0, memo).messages
    small = node_step(DAG, reader, 0, memo, max_bucket_bytes=4096).messages
    assert len(small) > len(big)
    assert all(m.length <= 4096 for m in small if not m.direct)


def test_dag_messages_are_what_the_receivers_derive() -> None:
    memo = DagMemo()
    for kw in ({}, {"early": True}, {"max_bucket_bytes": 4096}):
        sent = dag_messages(DAG, memo, **kw)  # type: ignore[arg-type]
        received = _received(memo, **kw)
        assert sent and all(m.src_worker != m.dst_worker for m in sent)
        assert sorted(sent, key=_key) == sorted(received, key=_key)
        assert len({_key(m) for m in sent}) == len(sent)
    plain, early = dag_messages(DAG, memo), dag_messages(DAG, memo, early=True)
    assert len(early) < len(plain)  # early builds are off unless asked for: two strided sends become runs
    assert len(dag_messages(DAG, memo, 4096)) > len(plain)


def test_dag_messages_come_sender_by_sender() -> None:
    # GPU 0 sends to 3 and GPU 1 to 2: by receiver the order would be the other way round
    crossed = build_transition(STATES, cluster_preset("cpu", 4), _plan(1, 1, [[0], [1]]),
                               _plan(2, 2, [[0, 3], [1, 2]]))
    pairs = [(m.src_worker, m.dst_worker) for m in dag_messages(crossed, DagMemo())]
    assert set(pairs) == {(0, 3), (1, 2)}
    assert pairs == sorted(pairs)
