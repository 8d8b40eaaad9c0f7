"""The interface between whoever drives the workers and the workers, and a local driver.

Workers obey the commands of ``agent.commands`` (join a generation, initialise units, run a
TransitionDAG, dump, checkpoint save/load, call, exit) and answer each with one ``Reply``.
``Coordinator`` is the small interface a driver offers; the daemon's ZeroMQ plane (through the node
agents) implements the same one later, so the executor never knows who drives it. ``LocalCoordinator``
runs the workers as spawned processes on this machine, talks to them over pipes and hosts the
generations' TCPStore: it is what tests, benchmarks and the local allocation source use.

Every move of state is a DAG run (``run_dag``; ``load_checkpoint`` runs a restore DAG,
``transitions.restore_dag``): each worker runs its nodes; if any fails, the
survivors re-form a generation without the dead and report the units they still hold, and the
model-stages no held unit covers any more are reported as needing the checkpoint
(``transitions.survival.uncovered_state``).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.connection as mpc
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from agent.commands import (
    Call,
    Command,
    Dump,
    Exit,
    InitUnits,
    Join,
    Reply,
    RunDag,
    SaveCheckpoint,
    WorkerState,
)
from agent.worker import worker_main  # the spawned processes' entry point; the worker imports no driver
from planner.errors import NereusError, SpecError
from planner.hardware import ClusterSpec
from transitions.channel import GenerationSpec
from transitions.cost import DEFAULT_COMMUNICATOR_SETUP_S, primitive_seconds
from transitions.dag_pieces import DagMemo
from transitions.emu import EMU
from transitions.executor import StepReport, shipped
from transitions.global_dag import TransitionDAG
from transitions.restore_dag import restore_dag
from transitions.survival import uncovered_state
from transitions.transfer_plan import DEFAULT_BUCKET_BYTES


class WorkerDied(NereusError):
    pass


# --- the interface a driver offers -----------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class TransitionOutcome:
    """How a DAG run ended. ``committed``: every worker ran all its nodes (there is no separate commit:
    sources are freed where the DAG frees them); otherwise ``lost`` says what no survivor covers."""

    committed: bool
    generation: int  # the generation the survivors are in afterwards
    dead_workers: tuple[int, ...]
    errors: dict[int, str]
    reports: dict[int, list[StepReport]]  # per worker: measured and predicted time per step
    lost: dict[str, list[str]]  # model-stage -> tensors whose last copy died (checkpoint needed)
    seconds: float

    @property
    def needs_checkpoint(self) -> bool:
        return bool(self.lost)


class Coordinator(Protocol):
    """What drives the workers of one job: local pipes here, the daemon's ZeroMQ plane in production."""

    @property
    def alive(self) -> tuple[int, ...]: ...

    def form_generation(self, members: Iterable[int] | None = None) -> GenerationSpec: ...

    def init_units(self, units: Iterable[EMU], seed: int) -> None: ...

    def run_dag(self, dag: TransitionDAG, cluster: ClusterSpec, *,
                max_bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> TransitionOutcome: ...

    def dump(self) -> dict[int, Any]: ...

    def close(self) -> None: ...


# --- what every driver shares: generations, DAG runs, checkpoints over ``request`` ----------------


class CommandDriver:
    """The Coordinator methods over one primitive, ``request`` (send each worker its command, wait for
    every reply, a lost worker answering ok=False): generations, DAG runs with survivor re-forming,
    dumps, checkpoints, calls. ``LocalCoordinator`` (pipes) and ``agent.hub.HubCoordinator`` (ZeroMQ,
    workers started by node agents) supply ``request``, ``alive``, ``is_dead`` and the store address."""

    timeout_s: float
    generation: int
    spec: GenerationSpec | None
    store_host: str
    store_port: int
    state: dict[int, WorkerState]
    held: dict[int, tuple[str, ...]]

    @property
    def alive(self) -> tuple[int, ...]:
        raise NotImplementedError

    def is_dead(self, worker: int) -> bool:
        raise NotImplementedError

    def request(self, commands: dict[int, Command], timeout_s: float | None = None) -> dict[int, Reply]:
        raise NotImplementedError

    def request_all(self, cmd: Command, workers: Iterable[int] | None = None,
                    timeout_s: float | None = None) -> dict[int, Reply]:
        targets = tuple(workers) if workers is not None else self.alive
        return self.request({w: cmd for w in targets}, timeout_s)

    def _check(self, replies: dict[int, Reply], what: str) -> dict[int, Reply]:
        bad = {w: r.error for w, r in replies.items() if not r.ok}
        if bad:
            raise WorkerDied(f"{what} failed on workers {sorted(bad)}: {bad}")
        return replies

    def form_generation(self, members: Iterable[int] | None = None) -> GenerationSpec:
        members_t = tuple(members) if members is not None else self.alive
        self.generation += 1
        spec = GenerationSpec(generation=self.generation, members=members_t, store_host=self.store_host,
                              store_port=self.store_port, timeout_s=self.timeout_s)
        self._check(self.request_all(Join(spec=spec), members_t), f"join generation {self.generation}")
        self.spec = spec
        return spec

    def init_units(self, units: Iterable[EMU], seed: int) -> None:
        self._check(self.request_all(InitUnits(units=tuple(units), seed=seed)), "init units")

    def run_dag(self, dag: TransitionDAG, cluster: ClusterSpec, *, max_bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                kill_at: dict[int, tuple[str, int]] | None = None,
                setup_s: float = DEFAULT_COMMUNICATOR_SETUP_S, in_place: bool | None = None,
                fan_out: bool | None = None, before: Callable[..., Any] | None = None,
                derived: DagMemo | None = None) -> TransitionOutcome:
        """Every worker runs its nodes of ``dag``; on a failure the survivors re-form a generation and
        the model-stages whose state no surviving unit still covers are reported (checkpoint needed).
        ``before``: ``fn(ctx)`` run on every worker first, in the same command (e.g. the engine's
        ``release``: one round trip instead of two). ``derived``: a memo in which the caller derived
        the DAG's steps already (``dag_messages``): each worker is sent its share of it
        (``transitions.executor.shipped``) instead of deriving it again."""
        start = time.perf_counter()
        predicted = tuple(primitive_seconds(fp, cluster, setup_s) for fp in dag.footprints)
        members = self.spec.members if self.spec is not None else self.alive
        cmds: dict[int, Command] = {
            w: RunDag(dag=dag, predicted_s=predicted, max_bucket_bytes=max_bucket_bytes,
                      kill_at=(kill_at or {}).get(w), in_place=in_place, fan_out=fan_out, before=before,
                      derived=shipped.pack(dag, derived, w) if derived is not None else None)
            for w in members
        }
        replies = self.request(cmds)
        if all(r.ok for r in replies.values()):
            return TransitionOutcome(committed=True, generation=self.generation, dead_workers=(), errors={},
                                     reports={w: r.value for w, r in replies.items()}, lost={},
                                     seconds=time.perf_counter() - start)
        errors = {w: r.error or "" for w, r in replies.items() if not r.ok}
        dead = tuple(sorted(w for w in members if self.is_dead(w)))
        survivors = tuple(w for w in members if w not in dead)
        self.form_generation(survivors)  # every Join reply says which units its worker still holds
        held = {w: set(self.held[w]) for w in survivors}
        return TransitionOutcome(committed=False, generation=self.generation, dead_workers=dead, errors=errors,
                                 reports={}, lost=uncovered_state(dag, held),
                                 seconds=time.perf_counter() - start)

    def dump(self, workers: Iterable[int] | None = None) -> dict[int, Any]:
        replies = self._check(self.request_all(Dump(), workers), "dump")
        return {w: r.value for w, r in replies.items()}

    def save_checkpoint(self, url: str, tag: str, workers: Iterable[int] | None = None) -> dict[int, Reply]:
        return self._check(self.request_all(SaveCheckpoint(url=url, tag=tag), workers), "checkpoint save")

    def load_checkpoint(self, url: str, tag: str, units: Iterable[EMU],
                        workers: Iterable[int] | None = None) -> dict[int, Reply]:
        """Every worker replaces what it holds by its shares of ``units`` (any plan's), read from the
        checkpoint: a restore DAG (one restore node per unit) run by each worker's runner; a reply's
        value is its StepReports, one per restore node it ran."""
        dag = restore_dag(tuple(units), url, tag)
        cmd = RunDag(dag=dag, predicted_s=(0.0,) * dag.num_nodes, drop_held=True)
        return self._check(self.request_all(cmd, workers), "checkpoint load")

    def call(self, fn: Callable[..., Any], workers: Iterable[int] | None = None,
             timeout_s: float | None = None, collective: bool = False, **kwargs: Any) -> dict[int, Any]:
        """``fn(ctx, **kwargs)`` on ``workers``; ``collective``: it runs collectives, and a failure on one
        worker breaks the generation on it (see ``agent.commands.Call``)."""
        cmd = Call(fn=fn, kwargs=kwargs, collective=collective)
        replies = self._check(self.request_all(cmd, workers, timeout_s), f"call {fn.__name__}")
        return {w: r.value for w, r in replies.items()}


# --- the local coordinator -------------------------------------------------------------------------


@dataclass(slots=True)
class _Proc:
    process: Any  # multiprocessing SpawnProcess
    conn: mpc.Connection


class LocalCoordinator(CommandDriver):
    """Spawns ``num_workers`` worker processes on this machine and drives them over pipes."""

    def __init__(self, num_workers: int, *, timeout_s: float = 30.0, device: str = "cpu",
                 threads_per_worker: int = 1, worker_ids: Iterable[int] | None = None,
                 start_timeout_s: float = 180.0) -> None:
        import torch.distributed as dist  # the store lives here; workers only connect to it

        if num_workers < 1:
            raise SpecError("num_workers", f"must be >= 1, got {num_workers}")
        self.timeout_s = timeout_s
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    timeout=_td(timeout_s))
        self.store_host, self.store_port = "127.0.0.1", self._store.port
        self.generation = -1
        self._seq = 0
        self.spec: GenerationSpec | None = None
        # per worker, from its latest reply: its state and the uids of the units it holds
        self.state: dict[int, WorkerState] = {}
        self.held: dict[int, tuple[str, ...]] = {}
        ctx = mp.get_context("spawn")
        ids = list(worker_ids) if worker_ids is not None else list(range(num_workers))
        self._procs: dict[int, _Proc] = {}
        for wid in ids:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(wid, child, device, threads_per_worker),
                               name=f"nereus-worker-{wid}", daemon=True)
            proc.start()
            child.close()
            self._procs[wid] = _Proc(process=proc, conn=parent)
        self._wait_ready(start_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        """Wait for every worker's hello (import torch takes seconds, more on a loaded machine), so
        that no rendezvous later waits on a worker that is still starting."""
        deadline = time.monotonic() + timeout_s
        pending = dict(self._procs)
        while pending:
            left = deadline - time.monotonic()
            ready = mpc.wait([p.conn for p in pending.values()] + [p.process.sentinel for p in pending.values()],
                             timeout=max(0.0, left))
            if not ready:
                self.close()
                raise WorkerDied(f"workers {sorted(pending)} did not start within {timeout_s} s")
            for wid, proc in list(pending.items()):
                if proc.conn in ready:
                    self.state[wid] = proc.conn.recv().state  # INIT: imports done, in no generation
                    del pending[wid]
                elif proc.process.sentinel in ready:
                    self.close()
                    raise WorkerDied(f"worker {wid} exited while starting (code {proc.process.exitcode})")

    # --- plumbing ---
    @property
    def alive(self) -> tuple[int, ...]:
        return tuple(w for w, p in self._procs.items() if p.process.is_alive())

    def is_dead(self, worker: int) -> bool:
        return not self._procs[worker].process.is_alive()

    def pid(self, worker: int) -> int:
        return int(self._procs[worker].process.pid)

    def request(self, commands: dict[int, Command], timeout_s: float | None = None) -> dict[int, Reply]:
        """Send each worker its command and wait for every reply; a dead worker yields ok=False."""
        # workers bound their own waits by timeout_s; give their (error) replies time to arrive
        deadline = time.monotonic() + (timeout_s or 2 * self.timeout_s + 5.0)
        self._seq += 1
        seq = self._seq
        replies: dict[int, Reply] = {}
        waiting: dict[int, _Proc] = {}
        for wid, cmd in commands.items():
            proc = self._procs[wid]
            try:
                proc.conn.send((seq, cmd))
                waiting[wid] = proc
            except (BrokenPipeError, OSError) as exc:
                replies[wid] = self._lost_reply(wid, seq, f"worker died: {exc}")
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                for wid in waiting:
                    replies[wid] = self._lost_reply(wid, seq, "no reply before the timeout")
                break
            handles: list[Any] = [p.conn for p in waiting.values()]
            handles += [p.process.sentinel for p in waiting.values()]
            ready = mpc.wait(handles, timeout=left)
            for wid, proc in list(waiting.items()):
                if proc.conn in ready:
                    try:
                        reply = proc.conn.recv()
                    except (EOFError, OSError):
                        # the pipe closes while the process is still exiting: wait for the exit, so
                        # that is_alive() agrees with what the reply says
                        proc.process.join(5.0)
                        reply = self._lost_reply(wid, seq, "worker died (pipe closed)")
                    if reply.seq != seq:
                        continue  # a late answer to an earlier request that was given up on
                    replies[wid] = reply
                    del waiting[wid]
                elif proc.process.sentinel in ready and not proc.conn.poll():
                    proc.process.join(1.0)
                    replies[wid] = self._lost_reply(wid, seq, f"worker died (exit code {proc.process.exitcode})")
                    del waiting[wid]
        for wid, reply in replies.items():
            self.state[wid] = reply.state
            self.held[wid] = reply.units
        return replies

    def _lost_reply(self, worker: int, seq: int, error: str) -> Reply:
        """The reply a worker could not give: gone (STOPPED, holding nothing) or still in its command."""
        alive = self._procs[worker].process.is_alive()
        return Reply(worker=worker, seq=seq, ok=False, error=error,
                     state=WorkerState.RUNNING if alive else WorkerState.STOPPED,
                     units=self.held.get(worker, ()) if alive else ())

    def close(self) -> None:
        """Ask every live worker to exit; terminate (then kill) any that does not within the timeout."""
        for proc in self._procs.values():
            if proc.process.is_alive():
                with contextlib.suppress(BrokenPipeError, OSError):
                    proc.conn.send((0, Exit()))
        deadline = time.monotonic() + min(self.timeout_s, 10.0)
        for proc in self._procs.values():
            proc.process.join(max(0.0, deadline - time.monotonic()))
            if proc.process.is_alive():
                proc.process.terminate()
                proc.process.join(2.0)
            if proc.process.is_alive():
                proc.process.kill()
                proc.process.join(2.0)
            proc.conn.close()

    def __enter__(self) -> LocalCoordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _td(seconds: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=seconds)


def _implements(c: LocalCoordinator) -> Coordinator:  # checked by mypy: the local driver is a Coordinator
    return c
