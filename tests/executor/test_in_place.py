"""Building a unit inside the buffer it is cut from (CPU): the plan is safe and the result exact.

In-process (no workers): for random layout changes, every node the executor would run in place is
compacted inside a random donor buffer and compared byte for byte with a copy into fresh memory.
(tests/executor/test_dag_execution.py runs the same on real workers, in the DAG's order.)
"""

from __future__ import annotations

import pytest
import torch
from executor_helpers import MICRO
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.hardware import cluster_preset
from planner.plan import GlobalPlan, Layout, StagePlan
from planner.workflow import ACTOR_TRAIN
from transitions.dag_pieces import DagMemo
from transitions.executor import allocate_unit
from transitions.executor.buffers import piece_view
from transitions.executor.in_place import build_in_place
from transitions.executor.pages import release_tail
from transitions.global_dag import TransitionDAG, build_transition
from transitions.in_place_plan import InPlace, _forward_order, in_place_plan
from transitions.layout import unit_slots
from transitions.node_steps import node_step
from transitions.scenarios import stage_states
from transitions.transfer_plan import Piece

STATES = stage_states(MICRO, (ACTOR_TRAIN,))
WORLD = 8
CLUSTER = cluster_preset("cpu", WORLD)
LAYOUTS = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (1, 4), (2, 4), (4, 2)]  # MICRO: 4 heads, 4 layers


def _plan(version: int, tp: int, pp: int, dp: int, gpus: list[int]) -> GlobalPlan:
    size = tp * pp
    sets = tuple(tuple(gpus[r * size:(r + 1) * size]) for r in range(dp))
    return GlobalPlan(version=version, stages=(StagePlan(model_stage="actor-train", layout=Layout(tp, pp),
                                                         gpu_sets=sets, micro_batch_size=1),))


@st.composite
def changes(draw: st.DrawFn) -> tuple[GlobalPlan, GlobalPlan]:
    plans = []
    for version in (1, 2):
        tp, pp = draw(st.sampled_from(LAYOUTS))
        dp = draw(st.integers(1, WORLD // (tp * pp)))
        gpus = draw(st.permutations(range(WORLD)))
        plans.append(_plan(version, tp, pp, dp, list(gpus)))
    return plans[0], plans[1]


def _donor(plan: InPlace, dag: TransitionDAG, worker: int, seed: int) -> torch.Tensor:
    unit = next(u for u in dag.nodes[plan.node].sources if u.uid == plan.donor)
    state = allocate_unit(unit, worker, torch.device("cpu"))
    state.flat.copy_(torch.randint(0, 256, state.flat.shape, generator=torch.Generator().manual_seed(seed),
                                   dtype=torch.uint8))
    return state


def _check_node(dag: TransitionDAG, plan: InPlace, worker: int) -> None:
    donor = _donor(plan, dag, worker, seed=plan.node * 31 + worker)
    original = donor.flat.clone()
    # the reference: the same pieces copied out of an untouched copy into fresh memory
    reference = allocate_unit(plan.target, worker, torch.device("cpu"))
    pristine = allocate_unit(next(u for u in dag.nodes[plan.node].sources if u.uid == plan.donor), worker,
                             torch.device("cpu"))
    pristine.flat.copy_(original)
    for p in plan.pieces:
        piece_view(reference, p.dst_slot, p.box).copy_(piece_view(pristine, p.src_slot, p.box))
    units = {plan.donor: donor}
    copied, _ = build_in_place(plan, worker, units)
    assert plan.donor not in units and set(units) == {plan.target.uid}
    built = units[plan.target.uid]
    assert built.flat.data_ptr() == donor.flat.data_ptr()  # no new memory: the donor's own buffer
    assert copied == sum(p.num_bytes for p in plan.pieces)
    covered = 0
    for key, slot in unit_slots(plan.target, worker).items():
        got, want = built.view(*key), reference.view(*key)
        # bitwise (random bytes include NaNs); a row-parallel slot's logical view is not contiguous
        assert torch.equal(got.contiguous().view(torch.uint8) if got.dim() else got,
                           want.contiguous().view(torch.uint8) if want.dim() else want), key
        covered += slot.num_bytes
    assert covered == sum(p.num_bytes for p in plan.pieces)  # the pieces fill every slot of the target


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(changes())
def test_in_place_nodes_build_exactly_what_a_fresh_copy_builds(change: tuple[GlobalPlan, GlobalPlan]) -> None:
    old, new = change
    dag = build_transition(STATES, CLUSTER, old, new)
    for worker in range(WORLD):
        for plan in _worker_plans(dag, worker):
            _check_node(dag, plan, worker)


def _worker_plans(dag: TransitionDAG, worker: int) -> list[InPlace]:
    order = list(dag.nodes_on(worker))
    steps = {n: node_step(dag, n, worker, DagMemo()) for n in order}
    return [p for n in order if (p := in_place_plan(dag, n, steps[n], worker, order, steps)) is not None]


def _all_plans(old: GlobalPlan, new: GlobalPlan) -> list[tuple[TransitionDAG, InPlace, int]]:
    dag = build_transition(STATES, CLUSTER, old, new)
    return [(dag, plan, worker) for worker in range(WORLD) for plan in _worker_plans(dag, worker)]


@pytest.mark.parametrize("old, new", [
    ((1, 1, 2), (2, 1, 2)),  # TP1 x DP2 -> TP2 x DP2: GPUs 0 and 1 keep half of their replica
    ((1, 1, 2), (2, 1, 1)),  # two replicas -> one TP2 unit on the same GPUs
    ((1, 1, 4), (4, 1, 1)),  # four replicas -> one TP4 unit on the same GPUs
    ((1, 1, 4), (2, 1, 2)),  # four replicas -> two TP2 units
    ((2, 1, 1), (4, 1, 1)),  # TP 2 -> 4 on the same GPUs: compacted once the other quarter is sent
    ((1, 2, 1), (1, 4, 1)),  # PP 2 -> 4: each GPU keeps a run of its layers, the Destroy comes later
])
def test_common_layout_changes_are_built_in_place(old: tuple[int, int, int], new: tuple[int, int, int]) -> None:
    """Merges that cut a smaller shard out of the replica a GPU already holds run in place (so the
    random test above is not vacuous), exactly; so do Splits whose old unit a later Destroy frees."""
    gpus = list(range(WORLD))
    found = _all_plans(_plan(1, *old, gpus), _plan(2, *new, gpus))
    assert found, f"{old} -> {new}: no node built in place"
    for dag, plan, worker in found:
        _check_node(dag, plan, worker)


def test_released_tail_is_given_back_and_the_kept_bytes_survive() -> None:
    flat = torch.empty(64 << 20, dtype=torch.uint8)
    flat.fill_(7)
    keep = (20 << 20) + 123
    released = release_tail(flat, keep)
    assert released >= (64 << 20) - keep - 2 * 4096
    assert bool((flat[:keep] == 7).all())


def _piece(src_offset: int, dst_offset: int, rows: int, cols: int, src_cols: int) -> Piece:
    """A rows x cols box at the start of a rows x src_cols donor slot, into a rows x cols target slot."""
    from transitions.layout import Slot

    src = Slot(tensor="w", kind="param", dtype="float32", global_shape=(rows, src_cols), offsets=(0, 0),
               lengths=(rows, src_cols), byte_offset=src_offset)
    dst = Slot(tensor="w", kind="param", dtype="float32", global_shape=(rows, src_cols), offsets=(0, 0),
               lengths=(rows, cols), byte_offset=dst_offset)
    return Piece(src_worker=0, dst_worker=0, src_slot=src, dst_slot=dst, box=((0, 0), (rows, cols)),
                 src_unit="a", dst_unit="b")


def test_unsafe_orders_are_refused() -> None:
    # safe: the destination trails the source and rows shrink (a column split)
    assert _forward_order([_piece(1024, 0, 8, 4, 8)]) is not None
    # a destination ahead of its source would overwrite bytes before they are read
    assert _forward_order([_piece(0, 1024, 8, 4, 8)]) is None
    # a destination running past a later piece's source
    first, second = _piece(0, 0, 8, 8, 8), _piece(128, 256, 8, 4, 8)
    assert _forward_order([second, first]) is None
