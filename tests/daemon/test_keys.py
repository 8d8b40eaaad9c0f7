"""The key store on its own: bad client files are skipped, names are never paths, loose permissions
are refused with the chmod that fixes them, and a garbage bundle is one clear error."""

from __future__ import annotations

from pathlib import Path

import pytest

from nereusd.wire.keys import KeyStore, load_bundle
from planner.errors import SpecError


def _store(tmp_path: Path) -> KeyStore:
    ks = KeyStore(tmp_path / "keys")
    ks.init()
    ks.create_client(name="alice-agent", user="alice", role="agent", out_dir=tmp_path / "alice")
    return ks


def test_a_bad_client_file_is_skipped_and_reported(tmp_path: Path) -> None:
    ks = _store(tmp_path)
    good = {k.public_key for k in ks.clients()}
    bad = {"truncated.json": '{"name": "truncated", "us', "list.json": "[1]",
           "extra.json": '{"name": "extra", "user": "u", "role": "agent", "public_key": "' + "a" * 40
           + '", "created_at": 1, "evil": 1}',
           "role.json": '{"name": "role", "user": "u", "role": "root", "public_key": "' + "a" * 40
           + '", "created_at": 1}',
           "renamed.json": '{"name": "alice-agent", "user": "u", "role": "admin", "public_key": "' + "b" * 40
           + '", "created_at": 1}'}
    for name, text in bad.items():
        (ks.clients_dir / name).write_text(text)
    assert {k.public_key.encode() for k in ks.clients()} == {g.encode() for g in good}
    assert {ks.authorised()[g.encode()].name for g in good} == {"alice-agent"}
    assert sorted(Path(p.split(":")[0]).name for p in ks.problems) == sorted(bad)


@pytest.mark.parametrize("name", ["../../../victim", "a/b", "", ".hidden", "x" * 65, "/etc/passwd"])
def test_key_names_are_never_paths(tmp_path: Path, name: str) -> None:
    ks = _store(tmp_path)
    victim = tmp_path / "victim.json"
    victim.write_text("{}")
    with pytest.raises(SpecError, match="not a valid name"):
        ks.revoke(name)
    with pytest.raises(SpecError, match="not a valid name"):
        ks.create_client(name=name, user="alice", role="agent", out_dir=tmp_path / "out")
    assert victim.exists()


def test_loose_permissions_are_refused_with_the_fix(tmp_path: Path) -> None:
    ks = _store(tmp_path)
    ks.check_permissions()
    ks.root.chmod(0o777)
    with pytest.raises(SpecError, match=f"chmod 700 {ks.root}"):
        ks.check_permissions()
    ks.root.chmod(0o700)
    secret = ks.root / "server.key_secret"
    secret.chmod(0o640)
    with pytest.raises(SpecError, match=f"chmod 600 {secret}"):
        ks.check_permissions()
    secret.chmod(0o600)
    (ks.clients_dir / "alice-agent.json").chmod(0o666)  # anyone could rewrite who this key acts for
    assert ks.clients() == [] and "writable by group or others" in ks.problems[0]
    bundle_secret = tmp_path / "alice" / "client.key_secret"
    bundle_secret.chmod(0o644)
    with pytest.raises(SpecError, match=f"chmod 600 {bundle_secret}"):
        load_bundle(tmp_path / "alice")
    bundle_secret.chmod(0o600)
    assert load_bundle(tmp_path / "alice").public_key


def test_a_garbage_bundle_is_one_clear_error(tmp_path: Path) -> None:
    _store(tmp_path)
    (tmp_path / "alice" / "server.key").write_text("short\n")
    with pytest.raises(SpecError, match="server.key is not a CURVE key"):
        load_bundle(tmp_path / "alice")


def test_a_dead_authenticator_stops_the_daemon_loudly(tmp_path: Path) -> None:
    """Deaf to new connections is worse than down: the next tick sets ``fatal`` and stops serving
    (``nereusd serve`` then exits 1 with that line, and systemd restarts it)."""
    from nereusd.daemon import Daemon
    from nereusd.settings import load_settings

    settings = load_settings(None, daemon={"state_dir": str(tmp_path / "state")},
                             control={"port": 0, "admin_port": 0}, metrics={"enabled": False})
    d = Daemon(settings)
    try:
        d._tick()
        assert d.fatal is None and not d.stopping.is_set()
        d.auth.stop()  # what an exception in the ZAP thread used to do, silently
        d._tick()
        assert d.stopping.is_set() and d.fatal is not None and "authenticator" in d.fatal
    finally:
        d.close()
