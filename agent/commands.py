"""The command set between whoever drives the workers (agent.coordinator, later the daemon's plane)
and the workers (agent.worker), and the worker's state enum.

Commands and replies are plain frozen data: pickled on local pipes, msgpack on the daemon plane.
A worker obeys one command at a time and answers each with one ``Reply`` that carries the state it
is left in. Every move of state is a ``RunDag``, a restore from a checkpoint too (a DAG of restore
nodes, ``transitions.restore_dag``, with ``drop_held``); ``InitUnits`` moves none: it fills new units
with deterministic random state for tests and benchmarks.

Worker states (torchelastic's WorkerState is the model): INIT until the first Join, then READY
between commands and RUNNING during one; a command whose data channel fails leaves it BROKEN, where
RunDag and checkpoints are refused until a Join forms a new generation; Exit makes it STOPPED.
``TRANSITIONS`` lists every allowed change with the reason for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from planner.errors import NereusError
from transitions.channel import GenerationSpec
from transitions.emu import EMU
from transitions.global_dag import TransitionDAG
from transitions.transfer_plan import DEFAULT_BUCKET_BYTES


class WorkerState(str, Enum):
    """Where a worker stands; every reply reports it (after the command)."""

    INIT = "init"  # started and imported, in no generation yet: only commands without the data channel
    READY = "ready"  # in a generation whose data channel works; idle between commands
    RUNNING = "running"  # executing a command (a coordinator sees it only for a reply that never came)
    BROKEN = "broken"  # the data channel failed (a peer died, a timeout): RunDag and checkpoints are
    # refused until the next Join forms a new generation; the units held stay readable (Dump, Call)
    STOPPED = "stopped"  # Exit received, or the coordinator or the process is gone


# (from, to) -> why that edge exists; the worker loop checks every change against this table
TRANSITIONS: dict[tuple[WorkerState, WorkerState], str] = {
    (WorkerState.INIT, WorkerState.RUNNING): "a command arrived before any generation was joined",
    (WorkerState.READY, WorkerState.RUNNING): "a command arrived",
    (WorkerState.BROKEN, WorkerState.RUNNING): "a command arrived: Join to recover, or one that reads units",
    (WorkerState.RUNNING, WorkerState.INIT): "done; still in no generation (InitUnits, Dump or Call first)",
    (WorkerState.RUNNING, WorkerState.READY): "done, and the data channel works",
    (WorkerState.RUNNING, WorkerState.BROKEN): "the data channel failed during the command (or the Join)",
    (WorkerState.INIT, WorkerState.STOPPED): "Exit, or the coordinator went away",
    (WorkerState.READY, WorkerState.STOPPED): "Exit, or the coordinator went away",
    (WorkerState.BROKEN, WorkerState.STOPPED): "Exit, or the coordinator went away",
    (WorkerState.RUNNING, WorkerState.STOPPED): "the process was killed mid-command (seen by the coordinator)",
}


class WorkerStateError(NereusError):
    """A command that the worker's state does not allow (e.g. RunDag on a BROKEN data channel)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Join:
    """Join generation ``spec`` (collective over its members); leaves BROKEN behind."""

    spec: GenerationSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class InitUnits:
    """Random state (deterministic in ``seed`` per model-stage) for this worker's shares of ``units``;
    whatever the worker held before is dropped."""

    units: tuple[EMU, ...]
    seed: int


@dataclass(frozen=True, kw_only=True, slots=True)
class RunDag:
    """Run this worker's nodes of ``dag`` in order (no separate commit: frees follow the DAG)."""

    dag: TransitionDAG
    predicted_s: tuple[float, ...]
    max_bucket_bytes: int = DEFAULT_BUCKET_BYTES
    kill_at: tuple[str, int] | None = None  # fault injection: SIGKILL self before (model_stage, round)
    in_place: bool | None = None  # None: the executor's default (transitions.executor.IN_PLACE, CPU only)
    fan_out: bool | None = None  # Extend fan-outs as broadcasts; None: the executor's default (large ones)
    drop_held: bool = False  # drop every unit held first: a restore, whose DAG replaces them from a checkpoint
    # a function run first, in the same command, as ``Call`` runs one (``fn(ctx)``, not collective): the
    # engine's release, say, so that a transition costs one round trip to the workers, not two; if it
    # fails, nothing moves: the worker breaks the generation (its peers fail at the opening barrier)
    # and the reply is its error
    before: Callable[..., Any] | None = None
    derived: bytes | None = None  # what the driver derived for this worker (transitions.executor.shipped)


@dataclass(frozen=True, kw_only=True, slots=True)
class Dump:
    """Every shard this worker holds (tests reassemble logical state from them)."""

    stages: tuple[str, ...] | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class SaveCheckpoint:
    """Collective: save every unit this worker holds under ``url``/``tag`` (atomic commit)."""

    url: str
    tag: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Call:
    """Run ``fn(worker_context, **kwargs)`` in the worker (tests, benchmarks, engine hooks)."""

    fn: Callable[..., Any]
    kwargs: dict[str, Any] = field(default_factory=dict)
    # fn runs collectives over the generation (an engine step, a bind): if it fails here, the worker
    # breaks the generation at once, so that peers blocked on it fail now instead of at their timeout
    collective: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class Exit:
    pass


Command = Join | InitUnits | RunDag | Dump | SaveCheckpoint | Call | Exit

# commands that move data over the generation's channel: refused unless the worker is READY
NEEDS_GENERATION: tuple[type, ...] = (RunDag, SaveCheckpoint)


@dataclass(frozen=True, kw_only=True, slots=True)
class Reply:
    worker: int
    seq: int  # the request it answers: a late reply to an abandoned request is recognised and dropped
    ok: bool
    state: WorkerState  # the worker's state after the command
    units: tuple[str, ...] = ()  # uids of the units it holds after the command (what survives a failure)
    value: Any = None
    error: str | None = None
    seconds: float = 0.0
