"""The executor's transfer plan, pure: contiguity, zero-copy Extend, no copies for kept or local
shards, balanced sources, bucket limits. Every plan is a TransitionDAG's, as each worker derives it
(``transitions.node_steps``). No processes, no I/O."""

from __future__ import annotations

import pytest
from executor_helpers import placement
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.errors import SpecError
from planner.models import TINY_3M
from transitions.dag_pieces import DagMemo
from transitions.layout import Slot, StagePlacement, contiguous_range, rank_slots
from transitions.node_steps import node_step
from transitions.placement_dag import placement_dag
from transitions.transfer_plan import DEFAULT_BUCKET_BYTES, Message, Piece


def _plan(old: list[StagePlacement], new: list[StagePlacement], max_bucket_bytes: int = DEFAULT_BUCKET_BYTES
          ) -> tuple[list[Message], list[Piece], set[str]]:
    """Every message of the DAG old -> new (as its sender derives it), every local piece, and the
    kinds of node that run."""
    dag = placement_dag(old, new)
    memo = DagMemo()
    messages: list[Message] = []
    local: list[Piece] = []
    for worker in sorted(dag.gpu_nodes):
        for node in dag.nodes_on(worker):
            step = node_step(dag, node, worker, memo, max_bucket_bytes)
            messages += [m for m in step.messages if m.src_worker == worker]
            local += [p for p in step.local if p.dst_worker == worker]
    return messages, local, {p.kind.value for p in dag.nodes}


def _slot(lengths: tuple[int, ...], byte_offset: int = 64) -> Slot:
    return Slot(tensor="t", kind="master", dtype="float32", global_shape=lengths,
                offsets=(0,) * len(lengths), lengths=lengths, byte_offset=byte_offset)


def test_contiguous_ranges_of_boxes() -> None:
    s = _slot((6, 8, 4))
    assert contiguous_range(s, ((0, 0, 0), (6, 8, 4))) == (64, 64 + 6 * 8 * 4 * 4)  # whole shard
    assert contiguous_range(s, ((2, 0, 0), (3, 8, 4))) == (64 + 2 * 32 * 4, 64 + 5 * 32 * 4)  # whole rows
    assert contiguous_range(s, ((1, 2, 0), (1, 3, 4))) == (64 + (32 + 8) * 4, 64 + (32 + 20) * 4)  # in a row
    assert contiguous_range(s, ((0, 0, 0), (6, 4, 4))) is None  # half of every row
    assert contiguous_range(s, ((0, 0, 1), (1, 1, 2))) == (64 + 4, 64 + 12)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=3).flatmap(
    lambda shape: st.tuples(st.just(tuple(shape)),
                            st.tuples(*[st.integers(0, n - 1) for n in shape]),
                            st.tuples(*[st.integers(1, n) for n in shape]))))
def test_contiguous_range_agrees_with_torch(case: tuple) -> None:
    import torch

    shape, offs, lens = case
    lens = tuple(min(k, n - o) for k, n, o in zip(lens, shape, offs))
    s = _slot(shape, byte_offset=0)
    full = torch.arange(_numel(shape), dtype=torch.float32).view(shape)
    sub = full[tuple(slice(o, o + k) for o, k in zip(offs, lens))]
    got = contiguous_range(s, (offs, lens))
    if sub.is_contiguous():
        assert got is not None
        flat = full.view(-1)[got[0] // 4: got[1] // 4]
        assert torch.equal(flat, sub.reshape(-1))
    else:
        assert got is None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for k in shape:
        n *= k
    return n


def test_extend_is_one_zero_copy_message_per_new_rank_and_sources_alternate() -> None:
    old = [placement("a", 1, 1, [[0], [1]], model=TINY_3M)]
    new = [placement("a", 1, 1, [[0], [1], [2], [3]], model=TINY_3M)]
    messages, local, kinds = _plan(old, new)
    _, size = rank_slots(new[0], 0)
    assert kinds == {"extend"} and not local  # replicas 0 and 1 stay: nothing copied
    assert sorted((m.src_worker, m.dst_worker) for m in messages) == [(0, 2), (1, 3)]
    for m in messages:  # the whole flat buffer (but its final padding) in one message, no copy
        assert m.direct and m.src_start == m.dst_start == 0
        assert size - 16 < m.length <= size


def test_merge_copies_local_shards_locally_and_balances_remote_sources() -> None:
    old = [placement("a", 1, 1, [[0], [1]])]
    new = [placement("a", 2, 1, [[0, 1], [2, 3]])]
    messages, local, _ = _plan(old, new)
    assert {m.dst_worker for m in messages} == {2, 3}  # workers 0 and 1 already hold everything
    assert {p.dst_worker for p in local} == {0, 1}
    sent = {w: sum(m.num_bytes for m in messages if m.src_worker == w) for w in (0, 1)}
    assert sent[0] > 0 and sent[1] > 0 and abs(sent[0] - sent[1]) <= 0.05 * max(sent.values())


def test_bucket_limit_bounds_every_packed_message() -> None:
    old, new = [placement("a", 1, 2, [[0, 1]])], [placement("a", 4, 1, [[0, 1, 2, 3]])]
    every, _, _ = _plan(old, new, max_bucket_bytes=4096)
    packed = [m for m in every if not m.direct]
    assert packed and max(m.num_bytes for m in packed) <= 4096
    volume: dict[tuple[int, int, int], int] = {}
    for m in packed:
        key = (m.src_worker, m.dst_worker, m.round)
        volume[key] = volume.get(key, 0) + m.num_bytes
    assert max(volume.values()) <= 4096  # at most one bucket's worth per pair per round
    # each pair's rounds are consecutive from 0 (two in flight bound the transient memory)
    for pair in {(m.src_worker, m.dst_worker) for m in every}:
        rounds = sorted({m.round for m in every if (m.src_worker, m.dst_worker) == pair})
        assert rounds == list(range(len(rounds)))


def test_unchanged_stage_moves_nothing_and_stage_sets_must_match() -> None:
    same = [placement("a", 2, 2, [[0, 1, 2, 3]])]
    messages, local, kinds = _plan(same, same)
    assert not kinds and not local and not messages
    with pytest.raises(SpecError, match="a transition keeps"):
        _plan(same, [placement("a", 2, 2, [[0, 1, 2, 3]], training=False)])


def test_split_buckets_land_directly_in_the_destination_buffer() -> None:
    """TP1 -> TP2: the halves a new rank needs are scattered in the source (packed there once) but
    back to back in the destination, so the receiver reads the bucket in place (no unpacking)."""
    old, new = [placement("a", 1, 1, [[0]])], [placement("a", 2, 1, [[0, 1]])]
    messages, _, _ = _plan(old, new, max_bucket_bytes=64 << 10)
    assert messages and all(m.dst_start is not None for m in messages)
    assert any(m.src_start is None for m in messages)  # row halves: packed once, at the source
    # and the reverse (TP2 -> TP1) mostly sends from the source buffer in place (buckets that skip
    # replicated norms, which the destination already holds, have gaps and are packed)
    back, _, _ = _plan(new, [placement("a", 1, 1, [[0]])], max_bucket_bytes=64 << 10)
    in_place = [m.src_start is not None for m in back]
    assert in_place and sum(in_place) > len(in_place) / 2


def test_huge_page_buffers_hold_what_is_written() -> None:
    import torch

    from transitions.executor.buffers import HUGE_MIN_BYTES, alloc_bytes

    buf = alloc_bytes(HUGE_MIN_BYTES + 48, torch.device("cpu"), huge_pages=True)
    assert buf.dtype == torch.uint8 and buf.numel() == HUGE_MIN_BYTES + 48
    view = buf[16: 16 + 4 * 1000].view(torch.float32)
    view.copy_(torch.arange(1000, dtype=torch.float32))
    assert torch.equal(buf[16: 16 + 4 * 1000].view(torch.float32), torch.arange(1000, dtype=torch.float32))
