"""The versioned wire protocol between nereusd, its node agents and nereusctl.

Every message is one ZeroMQ frame holding a JSON object or a msgpack map (the first byte tells
which) with a protocol version ``v`` and a ``type`` that selects one of the pydantic models below.
``decode`` checks size, encoding, version and schema in that order and raises ``ProtocolError``
with a stable ``code`` (the receiver turns it into an ``ErrorReply``; it never crashes).

This module is the one validation boundary for everything that comes from outside: every number is
finite and bounded (no NaN/inf, integers that fit SQLite's 64 bits, sizes and counts in range), every
name is a ``Name`` (1-64 characters of letters, digits, ``_ . -``, starting with a letter or digit:
no ``/``, so ``job/node`` keys cannot collide), every string and collection has a maximum length, and
admin requests carry per-op argument models (``ADMIN_ARGS``; the bounded field types are
nereusd.wire.fields, a job's spec nereusd.wire.job_models). A refused message gets an ErrorReply whose
message names the field; nothing reaches the store before it passed.

Imported by the daemon and by every agent, so it stays cheap: pydantic and msgpack only, no torch.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgpack
from pydantic import BaseModel, ConfigDict, Field, Strict, TypeAdapter, ValidationError, model_validator

from nereusd.wire.fields import (
    MAX_ITEMS,
    NAME_PATTERN,
    NAME_RULE,
    Args,
    Bytes,
    Count,
    Id,
    Key,
    Name,
    Seconds,
    SlurmJobId,
    Text,
    Tokens,
)
from nereusd.wire.job_models import JobSpecModel

PROTOCOL_VERSION = 1
Encoding = Literal["json", "msgpack"]


class ProtocolError(Exception):
    """A message that cannot be accepted; ``code`` is one of ERROR_CODES."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        super().__init__(f"{code}: {message}")


# Stable error codes sent in ErrorReply.code (agents and nereusctl branch on them).
ERROR_CODES = (
    "oversized",  # frame larger than control.max_message_bytes
    "malformed",  # not JSON/msgpack, or not an object
    "wrong-version",  # v != PROTOCOL_VERSION
    "invalid",  # schema validation failed
    "forbidden",  # the sender's user may not act on this job
    "unknown-job",  # no such job in the store
    "unknown-session",  # the daemon does not know this agent (restarted): register again
    "not-found",  # admin: no such record
    "internal",  # a bug in the daemon; the message is dropped, the daemon keeps serving
)


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    v: int = PROTOCOL_VERSION


# --- agent -> daemon ------------------------------------------------------------------------------


class Device(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    index: int = Field(ge=0, le=1023, strict=True)
    kind: Literal["gpu", "cpu"]
    name: str = Field(max_length=128, strict=True)
    memory_bytes: Bytes


class Register(_Msg):
    type: Literal["register"] = "register"
    job_id: Name
    node: Name
    slurm_job_id: SlurmJobId | None = None  # the Slurm job (anchor or member) this agent runs in
    host: str = Field(default="", max_length=253, strict=True)
    pid: int = Field(default=0, ge=0, le=2**31 - 1, strict=True)
    incarnation: str = Field(default="", max_length=64, strict=True)  # random per agent process
    devices: tuple[Device, ...] = Field(default=(), max_length=MAX_ITEMS)


class WorkerState(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    device: int = Field(ge=0, le=1023, strict=True)
    pid: int = Field(ge=0, le=2**31 - 1, strict=True)
    state: Literal["starting", "running", "exited", "failed"]
    exit_code: int | None = Field(default=None, ge=-255, le=255, strict=True)  # negative: killed by a signal
    restarts: int = Field(default=0, ge=0, le=1_000_000, strict=True)


class Heartbeat(_Msg):
    type: Literal["heartbeat"] = "heartbeat"
    job_id: Name
    node: Name
    seq: Count
    workers: tuple[WorkerState, ...] = Field(default=(), max_length=MAX_ITEMS)


Real = Annotated[float, Strict(), Field(ge=-1e12, le=1e12, allow_inf_nan=False)]  # a reward: any sign
Fraction = Annotated[float, Strict(), Field(ge=0, le=1, allow_inf_nan=False)]
Nats = Annotated[float, Strict(), Field(ge=0, le=1e6, allow_inf_nan=False)]  # entropy, KL (per token)


class RLMetrics(BaseModel):
    """The RL figures of one step (agent.metrics): what the daemon exports as per-job gauges. A loss
    that no rank computed (no critic in GRPO) is None."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    reward_mean: Real
    reward_std: Annotated[float, Strict(), Field(ge=0, le=1e12, allow_inf_nan=False)]
    kl_ref: Nats | None = None
    entropy: Nats | None = None
    clip_fraction: Fraction | None = None
    value_clip_fraction: Fraction | None = None
    response_len_mean: Tokens
    response_len_p95: Tokens
    response_len_max: Tokens
    tokens_per_s: Annotated[float, Strict(), Field(ge=0, le=1e12, allow_inf_nan=False)]
    pool_gpus: Annotated[int, Strict(), Field(ge=0, le=1 << 20)]


class Measurement(_Msg):
    """What the job driver measured over one RL step (relayed by the agent of node 0)."""

    type: Literal["measurement"] = "measurement"
    job_id: Name
    node: Name
    step: Count
    plan_version: Count
    step_latency_s: Seconds
    stage_times_s: dict[Key, Seconds] = Field(default_factory=dict, max_length=MAX_ITEMS)  # model-stage -> s
    peak_memory_bytes: dict[Key, Bytes] = Field(default_factory=dict, max_length=MAX_ITEMS)  # device -> bytes
    response_tokens: Tokens | None = None  # mean generated length this step
    rl: RLMetrics | None = None  # reward, KL, entropy, lengths, clip fractions, throughput, pool


class TransitionReport(_Msg):
    type: Literal["transition-report"] = "transition-report"
    job_id: Name
    node: Name
    transition_id: Id
    ok: Annotated[bool, Strict()]
    measured_s: Seconds
    bytes_moved: Bytes = 0
    error: Text = ""


LeaveReason = Literal["preempt", "time-limit", "shutdown"]
MAX_GRACE_S = 3600.0  # Slurm's GraceTime/KillWait are seconds to minutes


class Leaving(_Msg):
    """The node is about to go (a preemption notice, a time limit ahead: Slurm's SIGTERM before SIGKILL).
    The agent sends it every beat until the daemon answers ``Release`` (its state moved off the node) or
    ``grace_s`` runs out; the daemon answers ``Ack(ref="leaving")`` while the drain is under way."""

    type: Literal["leaving"] = "leaving"
    job_id: Name
    node: Name
    reason: LeaveReason
    grace_s: Annotated[float, Strict(), Field(ge=0, le=MAX_GRACE_S, allow_inf_nan=False)]  # left when sent


# --- daemon -> agent ------------------------------------------------------------------------------


class Welcome(_Msg):
    type: Literal["welcome"] = "welcome"
    job_id: str
    node: str
    heartbeat_interval_s: float
    plan_version: int
    reconnected: bool  # the daemon already knew this node (its own restart, or the agent's)


class Ack(_Msg):
    type: Literal["ack"] = "ack"
    ref: str  # type of the acknowledged message
    seq: int = 0


class TransitionOrder(_Msg):
    """This node's part of a transition DAG (primitives, transfers), to run at the next safe point."""

    type: Literal["transition-order"] = "transition-order"
    job_id: str
    transition_id: int
    from_version: int
    to_version: int
    part: dict[str, Any] = Field(default_factory=dict)


class Release(_Msg):
    """A leaving node may go: no plan uses it any more (its state moved away), or none ever did."""

    type: Literal["release"] = "release"
    job_id: str
    node: str
    reason: str


class ErrorReply(_Msg):
    type: Literal["error"] = "error"
    code: str
    message: str


# --- nereusctl <-> admin endpoint -----------------------------------------------------------------


class AdminRequest(_Msg):
    type: Literal["admin"] = "admin"
    op: str = Field(min_length=1, max_length=64)
    args: dict[str, Any] = Field(default_factory=dict, max_length=32)  # checked against ADMIN_ARGS[op]


class NoArgs(Args):
    pass


class JobArgs(Args):
    job: Name


class IdArgs(Args):
    id: Id


class EventsArgs(Args):
    job: Name | None = None
    limit: int = Field(default=200, ge=1, le=10_000, strict=True)


class MeasurementsArgs(Args):
    job: Name
    limit: int = Field(default=5000, ge=1, le=100_000, strict=True)  # the latest, oldest first


MAX_NODES_PER_REQUEST = 1024


class AllocArgs(Args):
    job: Name | None = None
    action: Literal["show", "grow", "shrink"] = "show"
    nodes: int | None = Field(default=None, ge=1, le=MAX_NODES_PER_REQUEST, strict=True)  # grow: how many
    names: tuple[Name, ...] | None = Field(default=None, min_length=1, max_length=MAX_NODES_PER_REQUEST)  # shrink

    @model_validator(mode="after")
    def _fits_action(self) -> AllocArgs:
        if self.action != "show" and self.job is None:
            raise ValueError(f"{self.action} needs 'job'")
        if self.action == "grow" and (self.nodes is None or self.names is not None):
            raise ValueError("grow takes 'nodes' (a count, 1..1024) and no 'names'")
        if self.action == "shrink" and (self.names is None or self.nodes is not None):
            raise ValueError("shrink takes 'names' (1..1024 node names) and no 'nodes'")
        if self.action == "show" and (self.nodes is not None or self.names is not None):
            raise ValueError("show takes neither 'nodes' nor 'names'")
        return self


class JobAddArgs(Args):
    job: Name
    user: Name
    spec: JobSpecModel = JobSpecModel()
    slurm_job_id: SlurmJobId | None = None


ADMIN_ARGS: dict[str, type[Args]] = {
    "status": NoArgs, "jobs": NoArgs, "keys": NoArgs, "job": JobArgs, "job-plan": JobArgs, "decisions": JobArgs,
    "transitions": JobArgs, "transition": IdArgs, "explain": IdArgs, "events": EventsArgs, "alloc": AllocArgs,
    "job-add": JobAddArgs, "measurements": MeasurementsArgs,
}


def admin_args(op: str, args: dict[str, Any]) -> Args:
    """The op's argument model, or ProtocolError('invalid') naming the op, the field and what is allowed."""
    model = ADMIN_ARGS.get(op)
    if model is None:
        raise ProtocolError("invalid", f"unknown op {op[:64]!r} (known: {', '.join(sorted(ADMIN_ARGS))})")
    try:
        return model.model_validate(args)
    except ValidationError as exc:
        raise ProtocolError("invalid", f"{op}: {describe(exc)}") from None


class AdminReply(_Msg):
    type: Literal["admin-reply"] = "admin-reply"
    ok: bool
    data: Any = None
    code: str = ""
    error: str = ""


Message = Annotated[
    Register | Heartbeat | Measurement | TransitionReport | Leaving | Welcome | Ack | TransitionOrder | Release
    | ErrorReply | AdminRequest | AdminReply,
    Field(discriminator="type"),
]
_ADAPTER: TypeAdapter[Any] = TypeAdapter(Message)


def encode(msg: BaseModel, encoding: Encoding = "msgpack") -> bytes:
    data = msg.model_dump(mode="json")
    if encoding == "json":
        return json.dumps(data, separators=(",", ":")).encode()
    return msgpack.packb(data, use_bin_type=True)


def decode(frame: bytes, max_bytes: int) -> Any:
    """Parse one frame into a message model, or raise ProtocolError naming what is wrong."""
    if len(frame) > max_bytes:
        raise ProtocolError("oversized", f"{len(frame)} bytes > limit {max_bytes}")
    if not frame:
        raise ProtocolError("malformed", "empty frame")
    try:
        # JSON objects start with '{' (possibly after whitespace); anything else is tried as msgpack.
        raw = json.loads(frame) if frame.lstrip()[:1] == b"{" else msgpack.unpackb(frame, raw=False)
    except Exception as exc:  # untrusted bytes: any parser failure is the sender's fault, never ours
        raise ProtocolError("malformed", f"neither JSON nor msgpack: {type(exc).__name__}") from None
    if not isinstance(raw, dict):
        raise ProtocolError("malformed", f"expected an object, got {type(raw).__name__}")
    version = raw.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError("wrong-version", f"protocol version {version!r}, this side speaks {PROTOCOL_VERSION}")
    try:
        return _ADAPTER.validate_python(raw)
    except ValidationError as exc:
        raise ProtocolError("invalid", describe(exc)) from None


def describe(exc: ValidationError) -> str:
    """One line: the first failing field (dotted path), what is wrong, and (shortened) what was sent."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "message"
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "string_pattern_mismatch":
        pattern = str(first.get("ctx", {}).get("pattern", ""))
        msg = f"must be {NAME_RULE}" if pattern == NAME_PATTERN else f"must match {pattern}"
    shown = repr(first.get("input"))
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return f"{where}: {msg}, got {shown}{more}"


def encoding_of(frame: bytes) -> Encoding:
    """Reply in the encoding the peer used."""
    return "json" if frame.lstrip()[:1] == b"{" else "msgpack"
