"""A worker: one process per device (a GPU, or a CPU slot locally) holding the EMU shares placed on it.

It keeps one map, EMU uid -> ``RankState`` (bf16 parameters, fp32 master weights, Adam m and v, the
unit's counters), across world generations, and obeys the commands of ``agent.commands`` one at a
time, dispatched through ``HANDLERS`` (command type -> handler). Its ``WorkerState`` is reported in
every reply: a failure in a command is answered as an error reply and the worker keeps running; a
failed data channel leaves it BROKEN (RunDag and checkpoints refused) until the next Join.

Started by ``LocalCoordinator`` (spawn, over a pipe), or by the node agent as

    python -m agent.worker --device N        # NEREUS_DRIVER, NEREUS_NODE (and NEREUS_KEYS) from the agent

which dials the job's driver (``agent.hub.WorkerLink``), is given its worker id (the global GPU id of
its device in the daemon's plan) and then obeys the driver's commands exactly as over a pipe.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import time
import traceback
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from agent.commands import (
    NEEDS_GENERATION,
    TRANSITIONS,
    Call,
    Dump,
    Exit,
    InitUnits,
    Join,
    Reply,
    RunDag,
    SaveCheckpoint,
    WorkerState,
    WorkerStateError,
)
from transitions.channel import DataChannel
from transitions.dag_pieces import DagMemo
from transitions.emu import EMU
from transitions.executor import RankState, allocate_unit, background, run_dag, warm_pool
from transitions.layout import COUNTERS


@dataclass(slots=True)
class WorkerContext:
    """What a worker holds: its id, device, data channel, state, and the units (EMU uid -> state)."""

    worker_id: int
    device: torch.device
    channel: DataChannel
    units: dict[str, RankState] = field(default_factory=dict)
    state: WorkerState = WorkerState.INIT
    memo: DagMemo = field(default_factory=DagMemo)  # what it derived from the DAGs it runs (their lifetime)
    engine: Any = None  # the RL engine bound to the units (agent.engine.live), once a driver binds one
    received_at: float = 0.0  # when the command being run arrived (time.perf_counter, the host's clock)

    def enter(self, state: WorkerState) -> None:
        """Change state along an edge of ``TRANSITIONS`` (any other change is a bug here)."""
        assert state is self.state or (self.state, state) in TRANSITIONS, (self.state, state)
        self.state = state

    def settled(self) -> WorkerState:
        """The state after a command: what the data channel says."""
        if self.channel.ready:
            return WorkerState.READY
        return WorkerState.BROKEN if self.channel.broken_reason is not None else WorkerState.INIT


def logical_seed(seed: int, model_stage: str, tensor: str, kind: str) -> int:
    return zlib.crc32(f"{seed}/{model_stage}/{tensor}/{kind}".encode())


def random_unit(unit: EMU, worker: int, seed: int, device: torch.device) -> RankState:
    """``worker``'s share of a deterministic random logical state: every replica/rank slices the same
    full tensors, so replicas agree exactly and the logical state is a function of ``seed`` (and the
    model-stage) alone."""
    state = allocate_unit(unit, worker, device)
    for slot, view in state.shards():
        if slot.tensor == COUNTERS:
            # version, optimizer step, minibatch position, spare: distinct, seed-dependent values
            view.copy_(torch.tensor([seed + 1, 3 * seed + 7, 5 * seed + 11, 0], dtype=torch.int64))
            continue
        gen = torch.Generator().manual_seed(logical_seed(seed, unit.model_stage, slot.tensor, slot.kind))
        full = torch.randn(slot.global_shape, generator=gen, dtype=torch.float32)
        box = tuple(slice(o, o + k) for o, k in zip(slot.offsets, slot.lengths))
        view.copy_(full[box].to(view.dtype))
    return state


def held_units(ctx: WorkerContext) -> list[str]:
    """Uids of the EMU shares this worker holds (what survives a failed DAG run)."""
    return sorted(ctx.units)


def stage_unit(ctx: WorkerContext, model_stage: str) -> RankState:
    """The one unit share of ``model_stage`` this worker holds (tests and engine hooks read it)."""
    (state,) = (s for s in ctx.units.values() if s.placement.model_stage == model_stage)
    return state


# --- handlers: one per command type; each returns the reply's value ---------------------------------


def _join(ctx: WorkerContext, cmd: Join) -> dict[str, int]:
    ctx.channel.join(cmd.spec)
    return {"generation": cmd.spec.generation, "rank": cmd.spec.rank_of(ctx.worker_id)}


def _init_units(ctx: WorkerContext, cmd: InitUnits) -> list[str]:
    ctx.units.clear()
    for unit in cmd.units:
        if unit.holds(ctx.worker_id):
            ctx.units[unit.uid] = random_unit(unit, ctx.worker_id, cmd.seed, ctx.device)
    return held_units(ctx)


# the last RunDag command here: when it arrived and how long its ``before`` took (seconds, the host's
# time.perf_counter clock); with ``runner.LAST_RUN`` what bench/live_transition.py splits a transition into
LAST_RUN_DAG: dict[str, float] = {}


def _run_dag(ctx: WorkerContext, cmd: RunDag) -> Any:
    def on_round(model_stage: str, rnd: int) -> None:
        if cmd.kill_at == (model_stage, rnd):
            os.kill(os.getpid(), signal.SIGKILL)

    start = time.perf_counter()
    LAST_RUN_DAG.clear()
    LAST_RUN_DAG.update(received_at=ctx.received_at, before_s=0.0)
    if cmd.before is not None:
        try:
            cmd.before(ctx)
        except Exception as exc:  # the peers are on their way to the run's opening barrier: fail them now
            ctx.channel.break_(f"{getattr(cmd.before, '__name__', 'before')} failed: {type(exc).__name__}: {exc}")
            raise
        LAST_RUN_DAG["before_s"] = time.perf_counter() - start
    if cmd.drop_held:
        ctx.units.clear()  # a restore: the checkpoint's state replaces what was held
    return run_dag(cmd.dag, ctx.worker_id, ctx.units, ctx.channel, predicted_s=cmd.predicted_s,
                   max_bucket_bytes=cmd.max_bucket_bytes, on_round=on_round, in_place=cmd.in_place,
                   fan_out=cmd.fan_out, memo=ctx.memo, derived=cmd.derived)


def _dump(ctx: WorkerContext, cmd: Dump) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for state in ctx.units.values():
        name = state.placement.model_stage
        if cmd.stages is not None and name not in cmd.stages:
            continue
        out.setdefault(name, []).extend([
            {"tensor": slot.tensor, "kind": slot.kind, "offsets": slot.offsets, "lengths": slot.lengths,
             "global_shape": slot.global_shape, "replica": state.replica, "rank": state.rank,
             "data": view.detach().to("cpu").clone()}
            for slot, view in state.shards()
        ])
    return out


def _save(ctx: WorkerContext, cmd: SaveCheckpoint) -> dict[str, Any]:
    from transitions.checkpoint import save_units

    return save_units(ctx.units, cmd.url, cmd.tag, ctx.channel)


def _call(ctx: WorkerContext, cmd: Call) -> Any:
    try:
        return cmd.fn(ctx, **cmd.kwargs)
    except Exception as exc:
        if cmd.collective and ctx.channel.spec is not None and len(ctx.channel.spec.members) > 1:
            ctx.channel.break_(f"{getattr(cmd.fn, '__name__', 'call')} failed: {type(exc).__name__}: {exc}")
        raise


HANDLERS: dict[type, Callable[[WorkerContext, Any], Any]] = {
    Join: _join, InitUnits: _init_units, RunDag: _run_dag, Dump: _dump, SaveCheckpoint: _save, Call: _call,
}


def handle(ctx: WorkerContext, cmd: Any) -> Any:
    """Execute one command from ``ctx.state`` (READY, INIT or BROKEN); its return value is the reply's
    value. Leaves ``ctx.state`` where the data channel says, whether the command succeeded or not."""
    handler = HANDLERS.get(type(cmd))
    why = getattr(cmd, "why", None)
    if handler is None and why is not None:
        raise TypeError(f"the command could not be decoded here: {why}")
    if handler is None:
        raise TypeError(f"unknown command {type(cmd).__name__}")
    if isinstance(cmd, NEEDS_GENERATION) and ctx.state is not WorkerState.READY:
        why = f": {ctx.channel.broken_reason}" if ctx.state is WorkerState.BROKEN else ""
        raise WorkerStateError(f"worker {ctx.worker_id} is {ctx.state.value}{why}; "
                               f"{type(cmd).__name__} needs a working generation (Join one first)")
    ctx.enter(WorkerState.RUNNING)
    try:
        return handler(ctx, cmd)
    finally:
        ctx.enter(ctx.settled())


def _status(ctx: WorkerContext, start: float) -> dict[str, Any]:
    """What every reply reports besides its value: state, held units, duration."""
    return {"state": ctx.state, "units": tuple(held_units(ctx)), "seconds": time.perf_counter() - start}


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
    background.start_all()  # their threads' starts (ms at load) paid now, not in a transition
    link.send(Reply(worker=worker_id, seq=0, ok=True, state=ctx.state, value="ready"))  # imports are done
    while True:
        try:
            seq, cmd = link.recv()
        except (EOFError, OSError):
            break  # the coordinator is gone
        if isinstance(cmd, Exit):
            break
        ctx.received_at = time.perf_counter()
        # the refill its last run asked for: every peer's run is over once the driver sends again
        warm_pool.POOL.start_pending()
        start = time.perf_counter()
        try:
            value = handle(ctx, cmd)
            reply = Reply(worker=worker_id, seq=seq, ok=True, value=value, **_status(ctx, start))
        except Exception as exc:  # noqa: BLE001 - reported to the coordinator, the worker lives on
            reply = Reply(worker=worker_id, seq=seq, ok=False, **_status(ctx, start),
                          error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=12)}")
        try:
            link.send(reply)
        except (BrokenPipeError, OSError):
            break
    ctx.enter(WorkerState.STOPPED)
    with contextlib.suppress(Exception):  # exiting anyway: a broken group may fail to tear down
        ctx.channel.leave()


def main(argv: list[str] | None = None) -> int:
    """Entry point of a worker the node agent starts: dial the driver, take the worker id, serve."""
    import argparse
    import sys
    from pathlib import Path

    from agent.hub import WorkerLink
    from nereusd.wire.keys import load_bundle

    env = os.environ
    p = argparse.ArgumentParser(prog="python -m agent.worker", description="Nereus worker (one per device)")
    p.add_argument("--device", type=int, default=int(env.get("NEREUS_DEVICE", "0")))
    p.add_argument("--driver", default=env.get("NEREUS_DRIVER"), help="the job driver's endpoint")
    p.add_argument("--keys", default=env.get("NEREUS_KEYS"), help="the job's agent key bundle directory")
    p.add_argument("--node", default=env.get("NEREUS_NODE"))
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    missing = [n for n in ("driver", "node") if not getattr(args, n)]
    if missing:
        print(f"worker: missing {', '.join('--' + m for m in missing)} (NEREUS_DRIVER/NEREUS_NODE are set by "
              "the node agent; a worker is not started by hand)", file=sys.stderr)
        return 2
    if "NEREUS_AGENT_IPC" in env:
        # under a node agent: Slurm's SIGTERM (preemption, time limit) reaches every process of the step,
        # but the node's state must first move away; the agent stops its workers (SIGINT) when the daemon
        # lets the node go, and a worker whose agent is gone ends by itself (WorkerLink sees the orphan)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    bundle = load_bundle(Path(args.keys)) if args.keys else None
    link = WorkerLink(args.driver, bundle, node=args.node, device=args.device)
    try:
        worker_id = link.wait_assignment()
    except EOFError as exc:
        print(f"worker: {exc}", file=sys.stderr)
        link.close()
        return 0
    device = "cuda" if env.get("CUDA_VISIBLE_DEVICES") and torch.cuda.is_available() else "cpu"
    try:
        worker_main(worker_id, link, device, threads=args.threads)
    finally:
        link.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
