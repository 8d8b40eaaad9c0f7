"""A worker: one process per device (a GPU, or a CPU slot locally) holding the EMU shards placed on it.

It keeps, per model-stage, one ``RankState`` (bf16 parameters, fp32 master weights, Adam m and v,
the unit's counters) across world generations, and obeys the coordinator's commands one at a time:
join a generation, initialise state, prepare/commit/abort a transition, dump, checkpoint save/load.
A failure in a command is answered as an error reply; the worker itself keeps running (its data
channel is marked broken until the next generation is joined).

Started by ``LocalCoordinator`` (spawn) or by the node agent: ``worker_main(worker_id, link, device)``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import time
import traceback
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

from agent.coordinator import (
    Call,
    Dump,
    Exit,
    InitState,
    InitUnits,
    Join,
    LoadCheckpoint,
    Reply,
    RunDag,
    SaveCheckpoint,
)
from transitions.channel import DataChannel
from transitions.dag_pieces import DagMemo
from transitions.executor import RankState, run_dag
from transitions.layout import COUNTERS, StagePlacement, unit_placement


@dataclass(slots=True)
class WorkerContext:
    """What a worker holds: its id, device, data channel, live state and a pending transition."""

    worker_id: int
    device: torch.device
    channel: DataChannel
    states: dict[str, RankState] = field(default_factory=dict)  # per model-stage (geometry plans)
    units: dict[str, RankState] = field(default_factory=dict)  # per EMU uid (DAG runs)
    memo: DagMemo = field(default_factory=DagMemo)  # what this worker derived from the DAGs it runs


def logical_seed(seed: int, model_stage: str, tensor: str, kind: str) -> int:
    return zlib.crc32(f"{seed}/{model_stage}/{tensor}/{kind}".encode())


def random_state(placement: StagePlacement, replica: int, rank: int, seed: int,
                 device: torch.device) -> RankState:
    """A rank's shards of a deterministic random logical state: every replica/rank slices the same
    full tensors, so replicas agree exactly and the logical state is a function of ``seed`` alone."""
    state = RankState.allocate(placement, replica, rank, device)
    for slot, view in state.shards():
        if slot.tensor == COUNTERS:
            # version, optimizer step, minibatch position, spare: distinct, seed-dependent values
            view.copy_(torch.tensor([seed + 1, 3 * seed + 7, 5 * seed + 11, 0], dtype=torch.int64))
            continue
        gen = torch.Generator().manual_seed(logical_seed(seed, placement.model_stage, slot.tensor, slot.kind))
        full = torch.randn(slot.global_shape, generator=gen, dtype=torch.float32)
        box = tuple(slice(o, o + k) for o, k in zip(slot.offsets, slot.lengths))
        view.copy_(full[box].to(view.dtype))
    return state


def _dump(ctx: WorkerContext, stages: tuple[str, ...] | None) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for state in (*ctx.states.values(), *ctx.units.values()):
        name = state.placement.model_stage
        if stages is not None and name not in stages:
            continue
        out.setdefault(name, []).extend([
            {"tensor": slot.tensor, "kind": slot.kind, "offsets": slot.offsets, "lengths": slot.lengths,
             "global_shape": slot.global_shape, "replica": state.replica, "rank": state.rank,
             "data": view.detach().to("cpu").clone()}
            for slot, view in state.shards()
        ])
    return out


def held_units(ctx: WorkerContext) -> list[str]:
    """Uids of the EMU shares this worker holds (what survives a failed DAG run)."""
    return sorted(ctx.units)


def handle(ctx: WorkerContext, cmd: Any) -> Any:
    """Execute one command; its return value is the reply's value."""
    if isinstance(cmd, Join):
        ctx.channel.join(cmd.spec)
        return {"generation": cmd.spec.generation, "rank": cmd.spec.rank_of(ctx.worker_id)}
    if isinstance(cmd, InitState):
        ctx.states.clear()
        ctx.units.clear()
        for placement in cmd.placements:
            pos = placement.position(ctx.worker_id)
            if pos is not None:
                ctx.states[placement.model_stage] = random_state(placement, pos[0], pos[1], cmd.seed,
                                                                 ctx.device)
        return sorted(ctx.states)
    if isinstance(cmd, InitUnits):
        ctx.units.clear()
        ctx.states.clear()
        for unit in cmd.units:
            if unit.holds(ctx.worker_id):
                placement = unit_placement(unit)
                rank = placement.gpu_sets[0].index(ctx.worker_id)
                ctx.units[unit.uid] = random_state(placement, 0, rank, cmd.seed, ctx.device)
        return sorted(ctx.units)
    if isinstance(cmd, RunDag):
        def on_round_dag(model_stage: str, rnd: int) -> None:
            if cmd.kill_at == (model_stage, rnd):
                os.kill(os.getpid(), signal.SIGKILL)

        return run_dag(cmd.dag, ctx.worker_id, ctx.units, ctx.channel, predicted_s=cmd.predicted_s,
                       max_bucket_bytes=cmd.max_bucket_bytes, on_round=on_round_dag, in_place=cmd.in_place,
                       fan_out=cmd.fan_out, memo=ctx.memo)
    if isinstance(cmd, Dump):
        return _dump(ctx, cmd.stages)
    if isinstance(cmd, SaveCheckpoint):
        from transitions.checkpoint import save_states

        return save_states(ctx.states, cmd.url, cmd.tag, ctx.channel)
    if isinstance(cmd, LoadCheckpoint):
        from transitions.checkpoint import load_states

        ctx.states = load_states(cmd.placements, ctx.worker_id, cmd.url, cmd.tag, ctx.channel)
        return sorted(ctx.states)
    if isinstance(cmd, Call):
        return cmd.fn(ctx, **cmd.kwargs)
    raise TypeError(f"unknown command {type(cmd).__name__}")


def worker_main(worker_id: int, link: Any, device: str = "cpu", threads: int = 1) -> None:
    """The worker's loop: one command in, one reply out, until Exit or the link closes."""
    torch.set_num_threads(threads)
    dev = torch.device(device if device != "cuda" else f"cuda:{worker_id % max(1, torch.cuda.device_count())}")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    ctx = WorkerContext(worker_id=worker_id, device=dev, channel=DataChannel(worker_id=worker_id, device=dev))
    # the ~170k objects of torch and the imports live as long as the process: move them out of the
    # collector's reach, or the first full collection (0.22 s here) lands in the first transition
    gc.collect()
    gc.freeze()
    link.send(Reply(worker=worker_id, seq=0, ok=True, value="ready"))  # hello: imports are done
    while True:
        try:
            seq, cmd = link.recv()
        except (EOFError, OSError):
            break  # the coordinator is gone
        if isinstance(cmd, Exit):
            break
        start = time.perf_counter()
        try:
            value = handle(ctx, cmd)
            reply = Reply(worker=worker_id, seq=seq, ok=True, value=value, seconds=time.perf_counter() - start)
        except Exception as exc:  # noqa: BLE001 - reported to the coordinator, the worker lives on
            reply = Reply(worker=worker_id, seq=seq, ok=False, seconds=time.perf_counter() - start,
                          error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}")
        try:
            link.send(reply)
        except (BrokenPipeError, OSError):
            break
    with contextlib.suppress(Exception):  # exiting anyway: a broken group may fail to tear down
        ctx.channel.leave()
