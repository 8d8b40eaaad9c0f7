"""CURVE keys: the daemon's server keypair and the authorised client keys (agents per user, admins).

Layout under ``<state_dir>/keys``::

    server.key            daemon public key (z85)
    server.key_secret     daemon secret key (z85), mode 0600
    clients/NAME.json     an authorised client: name, user, role (agent | admin), public key

A client bundle (what ``nereusd keys create`` hands to a user or an admin) is a directory with
``client.key``, ``client.key_secret`` (0600) and a copy of ``server.key``. Files are written to a
temporary name and renamed, so a crash never leaves half a key behind.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import zmq

from planner.errors import SpecError

Role = Literal["agent", "admin"]
ROLES: tuple[Role, ...] = ("agent", "admin")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True, kw_only=True, slots=True)
class ClientKey:
    name: str
    user: str  # the Unix/Slurm user this key acts for
    role: Role
    public_key: str  # z85
    created_at: float

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise SpecError("keys.name", f"{self.name!r} is not a valid key name",
                            "letters, digits, '_', '.', '-', up to 64 characters")
        if not _NAME.match(self.user):
            raise SpecError("keys.user", f"{self.user!r} is not a valid user name",
                            "letters, digits, '_', '.', '-', up to 64 characters")
        if self.role not in ROLES:
            raise SpecError("keys.role", f"unknown role {self.role!r}", ", ".join(ROLES))
        if len(self.public_key) != 40:
            raise SpecError("keys.public_key", "must be a 40-character z85 CURVE key")


@dataclass(frozen=True, kw_only=True, slots=True)
class ClientBundle:
    """What a client needs to connect: its keypair and the daemon's public key (all z85 bytes)."""

    public_key: bytes
    secret_key: bytes
    server_public_key: bytes


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, mode)  # umask may have narrowed or (for O_CREAT of an existing file) kept old bits
    os.replace(tmp, path)


class KeyStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.clients_dir = self.root / "clients"
        self._cache: dict[bytes, ClientKey] = {}
        self._cache_mtime_ns = -1

    # --- server keypair ---------------------------------------------------------------------------
    def init(self) -> bool:
        """Create the server keypair if missing; True when it was created."""
        self.clients_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        if (self.root / "server.key_secret").exists():
            return False
        public, secret = zmq.curve_keypair()
        _write_atomic(self.root / "server.key_secret", secret + b"\n", 0o600)
        _write_atomic(self.root / "server.key", public + b"\n", 0o644)
        return True

    def server_keys(self) -> tuple[bytes, bytes]:
        try:
            public = (self.root / "server.key").read_bytes().strip()
            secret = (self.root / "server.key_secret").read_bytes().strip()
        except FileNotFoundError:
            raise SpecError("keys", f"no server keypair under {self.root}",
                            "run `nereusd keys init --state-dir DIR` first") from None
        return public, secret

    # --- clients ----------------------------------------------------------------------------------
    def create_client(self, *, name: str, user: str, role: Role, out_dir: Path) -> ClientKey:
        """Make a client keypair, authorise it, and write its bundle to ``out_dir``."""
        server_public, _ = self.server_keys()
        if (self.clients_dir / f"{name}.json").exists():
            raise SpecError("keys.name", f"a key named {name!r} exists",
                            "another name, or `nereusd keys revoke NAME` first")
        public, secret = zmq.curve_keypair()
        key = ClientKey(name=name, user=user, role=role, public_key=public.decode(), created_at=time.time())
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(out_dir, 0o700)
        _write_atomic(out_dir / "client.key_secret", secret + b"\n", 0o600)
        _write_atomic(out_dir / "client.key", public + b"\n", 0o644)
        _write_atomic(out_dir / "server.key", server_public + b"\n", 0o644)
        record = {f: getattr(key, f) for f in ClientKey.__slots__}
        _write_atomic(self.clients_dir / f"{name}.json", json.dumps(record).encode(), 0o644)
        return key

    def revoke(self, name: str) -> None:
        try:
            (self.clients_dir / f"{name}.json").unlink()
        except FileNotFoundError:
            raise SpecError("keys.name", f"no key named {name!r}",
                            ", ".join(k.name for k in self.clients()) or "none") from None

    def clients(self) -> list[ClientKey]:
        out = []
        for path in sorted(self.clients_dir.glob("*.json")):
            out.append(ClientKey(**json.loads(path.read_text())))
        return out

    def authorised(self) -> dict[bytes, ClientKey]:
        """Public key (z85 bytes) -> client; re-read only when the clients directory changed."""
        try:
            mtime = self.clients_dir.stat().st_mtime_ns
        except FileNotFoundError:
            return {}
        if mtime != self._cache_mtime_ns:
            self._cache = {k.public_key.encode(): k for k in self.clients()}
            self._cache_mtime_ns = mtime
        return self._cache


def load_bundle(directory: Path) -> ClientBundle:
    d = Path(directory)
    try:
        return ClientBundle(public_key=(d / "client.key").read_bytes().strip(),
                            secret_key=(d / "client.key_secret").read_bytes().strip(),
                            server_public_key=(d / "server.key").read_bytes().strip())
    except FileNotFoundError as exc:
        raise SpecError("keys", f"incomplete key bundle in {d}: {Path(exc.filename).name} is missing",
                        "a directory made by `nereusd keys create`") from None
