"""Host dispatch on eager devices: the launch counts of the cost model's launch classes.

Where the device runs operators eagerly from the host (the CPU preset: one gloo worker per core, no
kernel queue to hide behind), every operator also costs a fixed dispatch time that no FLOP or byte
count sees. Its work is a number of launches at the device's launch rate (LAUNCH_OVERHEAD_S), in the
class of the path that issues them (planner.cost.OpClass.LAUNCH_FORWARD / _DECODE / _BACKWARD); GPU
presets queue kernels asynchronously (CUDA graphs in decode) and have none.

Distributed calls cost host time of their own on such a device, far more than one operator: a
tensor-parallel linear runs through DTensor's Python dispatch (input/output placement hooks, sharding
propagation), an in-place op on a DTensor parameter (the optimizer step) likewise, a gloo collective
waits on its peer's socket, and a pipeline schedule step builds its actions and posts its sends and
receives. They are counted here in units of one plain launch, measured side by side on this machine
by ``bench/cpu_call_costs.py`` (2 gloo ranks, medians of 200 calls; 2026-12-02, load 5.5 on 2 cores:
plain in-place op 5.2 us, DTensor in-place op 64 us, DTensor linear +294 us over a plain one, a
small gloo all-reduce 253 us (100 us of it the link's two hops, planner.hardware.LOOPBACK; 2.6x that
as the mean of a chain of them, COLLECTIVE_LAUNCHES), a 2-stage
GPipe step of one micro-batch 795 us over its modules' time). In launch units they scale with what
the calibration learns of the launch classes on any plan (a loaded machine slows all host work
alike), so a fit on one layout prices the host work of TP and PP layouts it has not run.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from planner.hardware import ClusterSpec
from planner.memory import stage_layer_counts
from planner.models import ModelSpec
from planner.plan import Layout

# Host time per operator launch that the device's own work does not hide, by device preset name:
# eager PyTorch on a CPU core: ~2 us per dispatched op at best (the prior efficiency, 0.2, makes it 10 us).
LAUNCH_OVERHEAD_S: Mapping[str, float] = MappingProxyType({"cpu": 2e-6})
# Operator launches of the engine's decoder (agent/engine/model.py), counted once from its forward:
# per layer (2 RMSNorms, q/k/v/o, RoPE on q and k, GQA repeat, attention, SwiGLU, residuals), per
# forward pass outside the layers (embedding, positions, RoPE tables, mask, final norm, head, the
# stage's output function), per decode step's sampling (softmax, top-p sort/cumsum/search, masks), and
# per parameter tensor of an optimizer step (non-foreach AdamW, grad-norm clipping, zeroing, the DP
# bucket's copies). Backward launches about twice the forward's, like its FLOPs.
LAUNCHES_PER_LAYER = 48
LAUNCHES_PER_PASS = 30
LAUNCHES_PER_SAMPLE = 15
LAUNCHES_PER_PARAM_TENSOR = 16

# Distributed calls in plain-launch units (bench/cpu_call_costs.py, see above):
TP_LINEAR_LAUNCHES = 57.0  # a DTensor (column/row parallel) linear's extra host time, 294 / 5.2 us
DTENSOR_OP_LAUNCHES = 12.0  # an in-place op on a DTensor parameter, 64 / 5.2 us
# a small gloo collective beyond its link latency, priced at its mean in a chain (what a pass's 2 per layer
# add up to), not at its median between barriers: under load a collective waits for its peer to be
# scheduled, a heavy tail the barrier hides. Chained mean / barrier median, 6 runs of 300 (2 ranks, one
# plain op between, load 4.4-8.5 on 2 cores; 2026-12-03): 1.6-3.5x, median 2.6; 2.6 x 253 us = 658 us,
# (658 - 100) / 5.2 us = 107 (the median alone, (253 - 100) / 5.2 = 29, left TP2 plans 20-35% fast).
COLLECTIVE_LAUNCHES = 107.0
PIPELINE_HOP_LAUNCHES = 76.0  # one stage's share of a schedule step per micro-batch, 795 / 2 / 5.2 us
# the engine's tensor-parallel linears (agent/engine/parallel.tp_plan): q, k, v, o, gate, up, down per
# layer, and the vocab-parallel embedding and head at the ends of the model
TP_LINEARS_PER_LAYER = 7
TP_LINEARS_AT_ENDS = 2


def launch_overhead_s(cluster: ClusterSpec) -> float:
    return LAUNCH_OVERHEAD_S.get(cluster.device.name, 0.0)


def pass_launches(layers: int) -> float:
    """Plain operator launches of one forward pass over ``layers`` layers."""
    return float(layers * LAUNCHES_PER_LAYER + LAUNCHES_PER_PASS)


def distributed_pass_launches(layout: Layout, layers: int) -> float:
    """Host work of one forward pass's distributed calls on one rank, in launch units: TP's DTensor
    linears and its collectives (two per layer, plus the vocab-parallel ends, shared among the PP
    stages), and PP's schedule step for this micro-batch (its sends and receives)."""
    out = 0.0
    if layout.tp > 1:
        ends = TP_LINEARS_AT_ENDS / layout.pp
        out += (TP_LINEARS_PER_LAYER * layers + ends) * TP_LINEAR_LAUNCHES
        out += (2 * layers + ends) * COLLECTIVE_LAUNCHES
    if layout.pp > 1:
        out += PIPELINE_HOP_LAUNCHES
    return out


def decode_step_collectives(layout: Layout) -> float:
    """Collectives per decode step beyond the passes': the last PP stage broadcasts its logits over the
    replica (once per token, shared among the pp stages' terms)."""
    return 1.0 / layout.pp if layout.pp > 1 else 0.0


def param_tensors(model: ModelSpec, layout: Layout) -> int:
    """Parameter tensors on the most loaded PP rank: its layers' plus embedding, final norm and head."""
    per_layer = sum(1 for t in model.tensors() if t.layer == 0)
    return stage_layer_counts(model.num_layers, layout.pp)[0] * per_layer + 3


def optimizer_launches(model: ModelSpec, layout: Layout) -> tuple[float, float]:
    """(plain, distributed) launches of one optimizer step on the most loaded rank: LAUNCHES_PER_PARAM_TENSOR
    per tensor; on a TP-sharded parameter each of them a DTensor op (DTENSOR_OP_LAUNCHES), and grad-norm
    clipping's collectives over the TP and PP groups."""
    plain = float(param_tensors(model, layout) * LAUNCHES_PER_PARAM_TENSOR)
    dist = 0.0
    if layout.tp > 1:
        layers = stage_layer_counts(model.num_layers, layout.pp)[0]
        sharded = TP_LINEARS_PER_LAYER * layers + TP_LINEARS_AT_ENDS / layout.pp
        dist += sharded * LAUNCHES_PER_PARAM_TENSOR * (DTENSOR_OP_LAUNCHES - 1)
    collectives = (layout.tp > 1) + (layout.pp > 1)
    return plain, dist + collectives * COLLECTIVE_LAUNCHES
