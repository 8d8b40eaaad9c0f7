"""The versioned wire protocol between nereusd, its node agents and nereusctl.

Every message is one ZeroMQ frame holding a JSON object or a msgpack map (the first byte tells
which) with a protocol version ``v`` and a ``type`` that selects one of the pydantic models below.
``decode`` checks size, encoding, version and schema in that order and raises ``ProtocolError``
with a stable ``code`` (the receiver turns it into an ``ErrorReply``; it never crashes).

Imported by the daemon and by every agent, so it stays cheap: pydantic and msgpack only, no torch.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgpack
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

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
    index: int = Field(ge=0)
    kind: Literal["gpu", "cpu"]
    name: str
    memory_bytes: int = Field(ge=0)


class Register(_Msg):
    type: Literal["register"] = "register"
    job_id: str = Field(min_length=1, max_length=128)
    node: str = Field(min_length=1, max_length=256)
    slurm_job_id: str | None = None  # the Slurm job (anchor or member) this agent runs in
    host: str = ""
    pid: int = 0
    incarnation: str = ""  # random per agent process: tells a reconnect from a restarted agent
    devices: tuple[Device, ...] = ()


class WorkerState(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    device: int
    pid: int
    state: Literal["starting", "running", "exited", "failed"]
    exit_code: int | None = None
    restarts: int = 0


class Heartbeat(_Msg):
    type: Literal["heartbeat"] = "heartbeat"
    job_id: str
    node: str
    seq: int = Field(ge=0)
    workers: tuple[WorkerState, ...] = ()


class Measurement(_Msg):
    """What the job driver measured over one RL step (relayed by the agent of node 0)."""

    type: Literal["measurement"] = "measurement"
    job_id: str
    node: str
    step: int = Field(ge=0)
    plan_version: int = Field(ge=0)
    step_latency_s: float = Field(ge=0)
    stage_times_s: dict[str, float] = Field(default_factory=dict)  # model-stage -> seconds
    peak_memory_bytes: dict[str, int] = Field(default_factory=dict)  # device -> bytes
    response_tokens: float | None = Field(default=None, ge=0)  # mean generated length this step


class TransitionReport(_Msg):
    type: Literal["transition-report"] = "transition-report"
    job_id: str
    node: str
    transition_id: int
    ok: bool
    measured_s: float = Field(ge=0)
    bytes_moved: int = Field(default=0, ge=0)
    error: str = ""


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


class ErrorReply(_Msg):
    type: Literal["error"] = "error"
    code: str
    message: str


# --- nereusctl <-> admin endpoint -----------------------------------------------------------------


class AdminRequest(_Msg):
    type: Literal["admin"] = "admin"
    op: str = Field(min_length=1, max_length=64)
    args: dict[str, Any] = Field(default_factory=dict)


class AdminReply(_Msg):
    type: Literal["admin-reply"] = "admin-reply"
    ok: bool
    data: Any = None
    code: str = ""
    error: str = ""


Message = Annotated[
    Register | Heartbeat | Measurement | TransitionReport | Welcome | Ack | TransitionOrder | ErrorReply
    | AdminRequest | AdminReply,
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
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ProtocolError("invalid", f"{where}: {first['msg']}") from None


def encoding_of(frame: bytes) -> Encoding:
    """Reply in the encoding the peer used."""
    return "json" if frame.lstrip()[:1] == b"{" else "msgpack"
