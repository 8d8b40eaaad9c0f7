"""CURVE keys: the daemon's server keypair and the authorised client keys (agents per user, admins).

Layout under ``<state_dir>/keys``::

    server.key            daemon public key (z85)
    server.key_secret     daemon secret key (z85), mode 0600
    clients/NAME.json     an authorised client: name, user, role (agent | admin), public key

A client bundle (what ``nereusd keys create`` hands to a user or an admin) is a directory with
``client.key``, ``client.key_secret`` (0600) and a copy of ``server.key``. Files are written to a
temporary name and renamed, so a crash never leaves half a key behind.

Loading is defensive: a client file that cannot be read (truncated JSON, bad fields) is skipped and
listed in ``KeyStore.problems`` (the daemon logs it) and never stops authentication; key names are
``NAME_RULE`` (no path separators: ``revoke ../x`` is refused); secrets readable by group or others and
key directories writable by them are refused with the chmod that fixes them.
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import zmq

from planner.errors import SpecError

Role = Literal["agent", "admin"]
ROLES: tuple[Role, ...] = ("agent", "admin")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
NAME_RULE = "letters, digits, '_', '.', '-', up to 64 characters, starting with a letter or digit"


def check_name(name: str, what: str = "keys.name") -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise SpecError(what, f"{name!r} is not a valid name", NAME_RULE)
    return name


def check_private(path: Path, *, secret: bool) -> None:
    """Refuse a secret readable by group/others, or a key file/directory writable by them."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return
    if secret and mode & 0o077:
        raise SpecError("keys.permissions", f"{path} is mode {stat.S_IMODE(mode):04o}: a secret key must be "
                        "readable by its owner only", f"chmod 600 {path}")
    if mode & 0o022:
        fix = "chmod 700" if path.is_dir() else "chmod 644"
        raise SpecError("keys.permissions", f"{path} is mode {stat.S_IMODE(mode):04o}: writable by group or "
                        "others, who could add or replace keys", f"{fix} {path}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ClientKey:
    name: str
    user: str  # the Unix/Slurm user this key acts for
    role: Role
    public_key: str  # z85
    created_at: float

    def __post_init__(self) -> None:
        check_name(self.name, "keys.name")
        check_name(self.user, "keys.user")
        if self.role not in ROLES:
            raise SpecError("keys.role", f"unknown role {self.role!r}", ", ".join(ROLES))
        if not isinstance(self.public_key, str) or len(self.public_key) != 40:
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
        self.problems: list[str] = []  # client files skipped on the last load, one line each

    # --- server keypair ---------------------------------------------------------------------------
    def init(self) -> bool:
        """Create the server keypair if missing; True when it was created."""
        for d in (self.root, self.clients_dir):  # new directories are private; existing ones are checked
            if not d.exists():
                d.mkdir(parents=True, exist_ok=True)
                os.chmod(d, 0o700)
        if (self.root / "server.key_secret").exists():
            return False
        public, secret = zmq.curve_keypair()
        _write_atomic(self.root / "server.key_secret", secret + b"\n", 0o600)
        _write_atomic(self.root / "server.key", public + b"\n", 0o644)
        return True

    def check_permissions(self) -> None:
        """The daemon's start-up check: raises SpecError naming the file and the chmod that fixes it."""
        for d in (self.root, self.clients_dir):
            check_private(d, secret=False)
        check_private(self.root / "server.key_secret", secret=True)

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
        check_name(name, "keys.name")
        check_name(user, "keys.user")
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
        check_name(name, "keys.name")
        try:
            (self.clients_dir / f"{name}.json").unlink()
        except FileNotFoundError:
            raise SpecError("keys.name", f"no key named {name!r}",
                            ", ".join(k.name for k in self.clients()) or "none") from None

    def clients(self) -> list[ClientKey]:
        """Every readable client file; the others are skipped and described in ``problems``."""
        out, problems = [], []
        try:
            paths = sorted(self.clients_dir.glob("*.json"))
        except OSError as exc:
            paths = []
            problems.append(f"{self.clients_dir}: {exc}")
        for path in paths:
            try:
                raw = json.loads(path.read_text())
                if not isinstance(raw, dict):
                    raise ValueError("not a JSON object")
                if set(raw) != set(ClientKey.__slots__):
                    raise ValueError(f"fields {sorted(raw)}, expected {sorted(ClientKey.__slots__)}")
                if path.stem != raw["name"]:
                    raise ValueError(f"names key {raw['name']!r}")
                check_private(path, secret=False)
                out.append(ClientKey(**raw))
            except (OSError, ValueError, TypeError, SpecError) as exc:
                problems.append(f"{path}: skipped ({exc})")
        self.problems = problems
        return out

    def authorised(self) -> dict[bytes, ClientKey]:
        """Public key (z85 bytes) -> client; re-read only when the clients directory changed."""
        try:
            mtime = self.clients_dir.stat().st_mtime_ns
        except OSError as exc:
            self.problems = [f"{self.clients_dir}: {exc.strerror}"]
            return {}
        if mtime != self._cache_mtime_ns:
            self._cache = {k.public_key.encode(): k for k in self.clients()}
            self._cache_mtime_ns = mtime
        return self._cache


def load_bundle(directory: Path) -> ClientBundle:
    d = Path(directory)
    check_private(d / "client.key_secret", secret=True)
    try:
        bundle = ClientBundle(public_key=(d / "client.key").read_bytes().strip(),
                            secret_key=(d / "client.key_secret").read_bytes().strip(),
                            server_public_key=(d / "server.key").read_bytes().strip())
    except FileNotFoundError as exc:
        raise SpecError("keys", f"incomplete key bundle in {d}: {Path(exc.filename).name} is missing",
                        "a directory made by `nereusd keys create`") from None
    except OSError as exc:
        raise SpecError("keys", f"cannot read the key bundle in {d}: {exc.strerror}") from None
    for name, value in (("client.key", bundle.public_key), ("client.key_secret", bundle.secret_key),
                        ("server.key", bundle.server_public_key)):
        if len(value) != 40:
            raise SpecError("keys", f"{d / name} is not a CURVE key (40 z85 characters, got {len(value)} bytes)",
                            "a directory made by `nereusd keys create`")
    try:
        import zmq.utils.z85 as z85

        for value in (bundle.public_key, bundle.secret_key, bundle.server_public_key):
            z85.decode(value)
    except (ValueError, KeyError, TypeError):
        raise SpecError("keys", f"the key bundle in {d} holds characters that are not z85",
                        "a directory made by `nereusd keys create`") from None
    return bundle
