"""The node agent's local ipc sockets: their endpoints (checked against the length a Unix socket's
path can hold) and the stale socket files of agents that died without closing them. The agent's
relay (agent/node.py) binds them; workers and the driver dial them (agent/link.py)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from planner.errors import SpecError


def _pid_running(pid: int) -> bool:
    """A process that exists and is not a zombie (PID 1 may reap late: kill -0 says alive then)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


# a Unix socket's path (sun_path) holds 108 bytes with its terminating NUL on Linux
_SUN_PATH_MAX = 107


def ipc_endpoint(ipc_dir: Path, name: str) -> str:
    """``ipc://DIR/NAME``; a path Unix sockets cannot hold is one clear error naming the folder, not
    ZeroMQ's 'File name too long' from deep inside the agent's start-up."""
    path = f"{ipc_dir}/{name}"
    if len(os.fsencode(path)) > _SUN_PATH_MAX:
        raise SpecError("agent ipc folder", f"{path!r} is {len(os.fsencode(path))} bytes, a Unix socket's path "
                        f"holds at most {_SUN_PATH_MAX}", "point TMPDIR at a shorter folder (the agent uses "
                        "tempfile.gettempdir())")
    return f"ipc://{path}"


def clean_stale_ipc(ipc_dir: Path) -> list[Path]:
    """Remove the ipc socket files of agents that died without closing (SIGKILL): their pid is in the name."""
    removed = []
    for path in Path(ipc_dir).glob("nereus-agent-*-*.*"):
        pid = path.name.removeprefix("nereus-agent-").split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_running(int(pid)):
            with contextlib.suppress(OSError):
                path.unlink()
                removed.append(path)
    return removed
