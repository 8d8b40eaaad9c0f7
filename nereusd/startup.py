"""What ``nereusd serve`` checks and sets up before it serves: the store opened behind the checks that
turn a damaged or vanished store into a one-line refusal (exit 3), systemd's readiness datagram, the
open-files limit, atomic JSON files in the state dir. Never imports torch."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import sqlite3
import time
from pathlib import Path
from typing import Any

from nereusd.store import Store
from planner.errors import NereusError

STORE_MARKER = "store.json"  # written next to the db when it is created: a missing db is then noticed


class StartupError(NereusError):
    """The environment refuses start-up (state dir, store, keys, ports): one line; ``nereusd`` exits 3."""


def _open_store(state_dir: Path, *, new_store: bool, log: Any) -> Store:
    """The store, after the checks that turn a damaged or vanished store into a one-line refusal."""
    db = state_dir / "nereusd.db"
    marker = state_dir / STORE_MARKER
    if db.is_dir():
        raise StartupError(f"the store path {db} is a directory: move it away (daemon.state_dir holds the db)")
    try:  # read-only or full: better one line now than a failed first write later
        probe = state_dir / f".probe-{os.getpid()}"
        with open(probe, "wb") as f:
            f.write(b"\0" * 65536)
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as exc:
        with contextlib.suppress(OSError):
            probe.unlink(missing_ok=True)
        raise StartupError(f"daemon.state_dir {state_dir} is not writable: {exc.strerror}") from None
    empty = not db.exists() or db.stat().st_size == 0
    # a daemon served from here before (its marker, or the endpoints.json of a daemon older than the marker)
    evidence = next((p for p in (marker, state_dir / "endpoints.json") if p.exists()), None)
    if empty and evidence is not None and not new_store:
        what = "missing" if not db.exists() else "empty (0 bytes)"
        raise StartupError(f"the store {db} is {what}, but {state_dir} held one ({evidence.name} says so): restore "
                           "it from a backup, or start with `nereusd serve --new-store` to begin with no jobs")
    if empty and evidence is not None:
        log.warning("new-store", path=str(db), reason="--new-store: the previous store is gone; starting empty")
    try:
        store = Store(db)
        check = store.db.execute("PRAGMA integrity_check").fetchall()
        verdict = "; ".join(" ".join(str(next(iter(r.values()))).split()) for r in check[:3])  # one line
        if verdict != "ok":
            store.close()
            raise StartupError(f"the store {db} fails integrity_check ({verdict[:200]}): restore it from a "
                               "backup, or move it aside and start with --new-store")
    except sqlite3.DatabaseError as exc:
        raise StartupError(f"the store {db} cannot be opened ({exc}): restore it from a backup, or move it "
                           "aside and start with --new-store") from None
    except sqlite3.Error as exc:
        raise StartupError(f"the store {db} cannot be opened: {exc}") from None
    except OSError as exc:
        raise StartupError(f"the store {db} cannot be opened: {exc.strerror or exc}") from None
    if not marker.exists() or empty:
        _write_atomic_json(marker, {"db": db.name, "created_at": time.time()})
    return store


def sd_notify(state: str) -> bool:
    """systemd readiness protocol without a dependency: one datagram to $NOTIFY_SOCKET."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]  # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            s.sendall(state.encode())
    except OSError:  # the supervisor went away (or never listened): no reason to fail or to stop serving
        return False
    return True


def raise_fd_limit(want: int = 65536) -> int:
    """Every agent is a TCP connection: lift the soft open-files limit toward the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return target
    return soft


def _write_atomic_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
