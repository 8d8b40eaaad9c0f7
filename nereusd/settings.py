"""Daemon settings: a TOML file (default /etc/nereus/nereusd.toml) overlaid by NEREUS_* environment.

Environment variables name nested keys with a double underscore: NEREUS_CONTROL__PORT=7501.
Unknown keys, bad values and unreadable TOML are one-line errors (``SpecError``) that name the key
and what is allowed. Every number is finite and bounded (``inf``, ``nan`` and absurd values refused),
and the relations between keys are checked (a heartbeat time-out must exceed the interval).
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from planner.errors import SpecError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 (pydantic-settings brings tomli there)
    import tomli as tomllib

DEFAULT_CONFIG_PATH = Path("/etc/nereus/nereusd.toml")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _seconds(default: float, *, gt: float = 0, le: float = 86400.0) -> Any:
    return Field(default, gt=gt, le=le, allow_inf_nan=False)


class DaemonSection(_Section):
    state_dir: Path = Path("/var/lib/nereus")  # SQLite store, keys, checkpoints; an absolute path

    @field_validator("state_dir", mode="before")
    @classmethod
    def _absolute(cls, v: Any) -> Any:
        if str(v).strip() == "" or not Path(str(v)).is_absolute():
            raise ValueError("must be an absolute directory path (an empty or relative one would put the store "
                             "in whatever directory the daemon was started from)")
        return v

    log_format: Literal["auto", "json", "console"] = "auto"  # auto: console on a TTY, JSON otherwise
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # an ordered transition that not every node reported within this bound fails, and the job replans
    order_timeout_s: float = _seconds(120.0)


class ControlSection(_Section):
    bind_host: str = Field("127.0.0.1", min_length=1, max_length=253)
    port: int = Field(7501, ge=0, le=65535)  # agents (ZeroMQ ROUTER, CURVE); 0: a free port
    admin_port: int = Field(7502, ge=0, le=65535)  # nereusctl; 0: a free port (see endpoints.json)
    max_message_bytes: int = Field(1 << 20, ge=1024, le=64 << 20)
    heartbeat_interval_s: float = _seconds(1.0, le=600.0)
    heartbeat_timeout_s: float = _seconds(10.0, le=3600.0)
    # nodes one job may register when its spec has no elastic section (with one: max_gpus / gpus_per_node)
    max_nodes_per_job: int = Field(1024, ge=1, le=65536)
    # connections one agent key may hold: the node limits of its user's live jobs plus this many spare
    # (a reconnect while the dead connection lingers, an agent started before its job); past it, refused
    spare_connections_per_key: int = Field(8, ge=1, le=65536)
    # an agent connection that sends nothing this long after its handshake is closed
    silent_connection_s: float = _seconds(30.0, le=3600.0)

    @model_validator(mode="after")
    def _timeout_after_interval(self) -> ControlSection:
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(f"heartbeat_timeout_s ({self.heartbeat_timeout_s:g}) must exceed heartbeat_interval_s "
                             f"({self.heartbeat_interval_s:g}), or every node is marked lost between two beats")
        if self.port and self.port == self.admin_port:
            raise ValueError(f"port and admin_port are both {self.port}: give them different ports")
        return self


class MetricsSection(_Section):
    enabled: bool = True
    port: int = Field(9464, ge=0, le=65535)  # 0: pick a free port


class SlurmSection(_Section):
    enabled: bool = True
    poll_interval_s: float = _seconds(5.0, le=3600.0)
    poll_backoff_max_s: float = _seconds(60.0)
    command_timeout_s: float = _seconds(20.0, le=3600.0)
    max_member_submissions_per_minute: int = Field(30, ge=1, le=100_000)
    # the growth policy (nereusd/growth.py): a job grows toward its max_gpus by itself, one member at a time
    grow: bool = True  # false: members are asked for only by `nereusctl alloc JOB --grow N`
    grow_interval_s: float = _seconds(5.0, le=3600.0)  # per job, between two growth verdicts
    grow_horizon_steps: float = Field(50.0, gt=0, le=1e7, allow_inf_nan=False)  # steps a grown pool serves, where the job file gives no `steps`
    time_limit_lead_s: float = Field(120.0, ge=0, le=86400.0, allow_inf_nan=False)  # a member this close to its Slurm end time is drained first


class PlannerSection(_Section):
    gamma: float = Field(0.5, gt=0, le=100, allow_inf_nan=False)  # payback: admit iff L_tran / dL <= gamma * H_x
    seq_len_drift_threshold: float = Field(0.30, gt=0, le=100, allow_inf_nan=False)
    memory_headroom: float = Field(0.10, ge=0, lt=1, allow_inf_nan=False)
    # replan only once the GPU pool has not changed for this long (member jobs start in bursts)
    pool_settle_s: float = Field(2.0, ge=0, le=3600.0, allow_inf_nan=False)


class LocalSection(_Section):
    """The local allocation source (Slurm disabled or absent): virtual nodes of CPU slots on this machine."""

    num_nodes: int = Field(4, ge=1, le=4096)
    slots_per_node: int = Field(8, ge=1, le=1024)
    schedule_path: Path | None = None  # a schedule file of allocation changes (nereusd/local_source.py)
    # start one `python -m agent.node` process group per granted node of a job that names its job file
    # or agent keys (elastic.extra job_file / keys_dir); false: jobs are only tracked, agents started by hand
    start_agents: bool = True
    worker_cmd: str = Field("{python} -m agent.worker", max_length=4096)  # per slot; "" starts no workers
    agent_args: str = Field("", max_length=4096)  # more `agent.node` arguments, e.g. "--ack-orders"
    driver_cmd: str = Field("{python} -m agent.driver", min_length=1, max_length=4096)  # on the anchor node

    @field_validator("schedule_path", mode="before")
    @classmethod
    def _schedule_file(cls, v: Any) -> Any:
        if v is None:
            return v
        if str(v).strip() == "" or not Path(str(v)).is_absolute():
            raise ValueError("must be an absolute file path")
        if not Path(str(v)).is_file():
            raise ValueError("no such file")
        return v

    @field_validator("worker_cmd", "agent_args", "driver_cmd")
    @classmethod
    def _shell_words(cls, v: str) -> str:
        try:
            shlex.split(v)
        except ValueError as exc:  # an unclosed quote
            raise ValueError(f"is not a command line ({exc}); quote as in a shell") from None
        return v


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="NEREUS_", env_nested_delimiter="__", extra="forbid",
                                      frozen=True)
    _toml_path: ClassVar[Path | None] = None

    daemon: DaemonSection = DaemonSection()
    control: ControlSection = ControlSection()
    metrics: MetricsSection = MetricsSection()
    slurm: SlurmSection = SlurmSection()
    planner: PlannerSection = PlannerSection()
    local: LocalSection = LocalSection()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if cls._toml_path is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=cls._toml_path))
        return tuple(sources)


def load_settings(path: str | os.PathLike[str] | None = None, **overrides: Any) -> Settings:
    """Read settings from ``path`` (or $NEREUS_CONFIG, or the default path if it exists)."""
    if path is None:
        env = os.environ.get("NEREUS_CONFIG")
        path = Path(env) if env else (DEFAULT_CONFIG_PATH if DEFAULT_CONFIG_PATH.exists() else None)
    if path is not None and not Path(path).is_file():
        raise SpecError("config", f"settings file {path} does not exist")

    class _Bound(Settings):
        _toml_path: ClassVar[Path | None] = Path(path) if path is not None else None

    try:
        bound = _Bound(**overrides)
    except ValidationError as exc:
        raise SpecError("config", _describe(exc, path)) from None
    except tomllib.TOMLDecodeError as exc:
        raise SpecError("config", f"{path} is not valid TOML: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError("config", f"cannot read {path}: {exc}") from None
    return Settings.model_validate(bound.model_dump())


def _describe(exc: ValidationError, path: object) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown key {key!r}")
        elif err["type"] == "value_error" and isinstance(err.get("input"), dict):  # a relation between keys
            lines.append(f"{key}: {err['msg'].removeprefix('Value error, ')}")
        else:
            shown = repr(err.get("input"))
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            lines.append(f"{key}: {err['msg'].removeprefix('Value error, ')} (got {shown})")
    src = f" in {path}" if path else ""
    return f"invalid settings{src}: " + "; ".join(lines)
