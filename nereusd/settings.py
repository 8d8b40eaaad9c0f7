"""Daemon settings: a TOML file (default /etc/nereus/nereusd.toml) overlaid by NEREUS_* environment.

Environment variables name nested keys with a double underscore: NEREUS_CONTROL__PORT=7501.
Unknown keys and bad values are errors that name the key and what is allowed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from planner.errors import SpecError

DEFAULT_CONFIG_PATH = Path("/etc/nereus/nereusd.toml")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DaemonSection(_Section):
    state_dir: Path = Path("/var/lib/nereus")  # SQLite store, keys, checkpoints
    log_format: Literal["auto", "json", "console"] = "auto"  # auto: console on a TTY, JSON otherwise
    log_level: Literal["debug", "info", "warning", "error"] = "info"


class ControlSection(_Section):
    bind_host: str = "127.0.0.1"
    port: int = Field(7501, ge=0, le=65535)  # agents (ZeroMQ ROUTER, CURVE); 0: a free port
    admin_port: int = Field(7502, ge=0, le=65535)  # nereusctl; 0: a free port (see endpoints.json)
    max_message_bytes: int = Field(1 << 20, ge=1024)
    heartbeat_interval_s: float = Field(1.0, gt=0)
    heartbeat_timeout_s: float = Field(10.0, gt=0)


class MetricsSection(_Section):
    enabled: bool = True
    port: int = Field(9464, ge=0, le=65535)  # 0: pick a free port


class SlurmSection(_Section):
    enabled: bool = True
    poll_interval_s: float = Field(5.0, gt=0)
    poll_backoff_max_s: float = Field(60.0, gt=0)
    command_timeout_s: float = Field(20.0, gt=0)
    max_member_submissions_per_minute: int = Field(30, ge=1)


class PlannerSection(_Section):
    gamma: float = Field(0.5, gt=0)  # payback: admit iff L_tran / dL <= gamma * H_x
    seq_len_drift_threshold: float = Field(0.30, gt=0)
    memory_headroom: float = Field(0.10, ge=0, lt=1)
    # replan only once the GPU pool has not changed for this long (member jobs start in bursts)
    pool_settle_s: float = Field(2.0, ge=0)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="NEREUS_", env_nested_delimiter="__", extra="forbid",
                                      frozen=True)
    _toml_path: ClassVar[Path | None] = None

    daemon: DaemonSection = DaemonSection()
    control: ControlSection = ControlSection()
    metrics: MetricsSection = MetricsSection()
    slurm: SlurmSection = SlurmSection()
    planner: PlannerSection = PlannerSection()

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
    return Settings.model_validate(bound.model_dump())


def _describe(exc: ValidationError, path: object) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown key {key!r}")
        else:
            lines.append(f"{key}: {err['msg']} (got {err.get('input')!r})")
    src = f" in {path}" if path else ""
    return f"invalid settings{src}: " + "; ".join(lines)
