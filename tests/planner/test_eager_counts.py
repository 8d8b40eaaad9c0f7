"""Host dispatch counts of the eager (CPU) device (planner/eager.py), worked out by hand from the
engine's decoder: a Llama layer is 9 parameter tensors (q, k, v, o, gate, up, down, two norms); a TP
layer runs 7 DTensor linears and 2 collectives; the vocab-parallel embedding and head sit at the ends.
Found by mutation testing (tests/mutate.py --module planner/eager.py: 19 of 84 mutants survived the
calibration tests, which see these counts only through fitted step times)."""

from __future__ import annotations

import pytest

from planner.eager import (
    decode_step_collectives,
    distributed_pass_launches,
    launch_overhead_s,
    optimizer_launches,
    param_tensors,
    pass_launches,
)
from planner.hardware import cluster_preset
from planner.models import model_preset
from planner.plan import Layout

TINY = model_preset("tiny-3m")  # 4 layers


def test_only_eager_devices_pay_a_launch() -> None:
    assert launch_overhead_s(cluster_preset("cpu", 2)) == 2e-6
    assert launch_overhead_s(cluster_preset("h100", 8)) == 0.0


def test_a_forward_pass_launches_per_layer_and_once_outside() -> None:
    assert [pass_launches(n) for n in (0, 1, 4)] == [30.0, 78.0, 222.0]


@pytest.mark.parametrize(("layout", "layers", "expected"), [
    (Layout(1, 1), 4, 0.0),
    (Layout(1, 2), 2, 76.0),  # the schedule step only
    (Layout(2, 1), 4, (7 * 4 + 2) * 57 + (2 * 4 + 2) * 107),  # 1710 + 1070: both ends on the one stage
    (Layout(2, 2), 2, (7 * 2 + 1) * 57 + (2 * 2 + 1) * 107 + 76),  # the ends shared by two stages
    (Layout(4, 4), 1, (7 + 0.5) * 57 + (2 + 0.5) * 107 + 76),
])
def test_distributed_calls_of_a_pass(layout: Layout, layers: int, expected: float) -> None:
    assert distributed_pass_launches(layout, layers) == pytest.approx(expected)


def test_decode_broadcasts_logits_only_under_pp() -> None:
    assert [decode_step_collectives(Layout(tp, pp)) for tp, pp in ((1, 1), (4, 1), (1, 2), (2, 4))] == [
        0.0, 0.0, 0.5, 0.25]


def test_parameter_tensors_and_optimizer_launches_on_the_most_loaded_rank() -> None:
    assert [param_tensors(TINY, Layout(1, pp)) for pp in (1, 2, 4)] == [4 * 9 + 3, 2 * 9 + 3, 9 + 3]
    assert param_tensors(TINY, Layout(2, 1)) == 39  # TP splits tensors, it does not add any
    assert optimizer_launches(TINY, Layout(1, 1)) == (39 * 16.0, 0.0)
    assert optimizer_launches(TINY, Layout(1, 2)) == (21 * 16.0, 107.0)  # grad-norm over the PP group
    # TP2 x PP2: 2 layers' 14 sharded linears + half the 2 ends, each of 16 launches a DTensor op (12 units,
    # 11 beyond the plain one), and grad-norm collectives over both groups
    assert optimizer_launches(TINY, Layout(2, 2)) == pytest.approx((21 * 16.0, 15 * 16 * 11 + 2 * 107))
