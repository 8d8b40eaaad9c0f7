"""The ``nereusd`` console script.

    nereusd serve [--config /etc/nereus/nereusd.toml] [--new-store]
    nereusd keys init    [--config PATH | --state-dir DIR]
    nereusd keys create NAME --user USER [--role agent|admin] --out DIR [--config PATH | --state-dir DIR]
    nereusd keys list    [--config PATH | --state-dir DIR]
    nereusd keys revoke NAME [--config PATH | --state-dir DIR]

Every error is one line on stderr (no traceback). Exit codes (etc/nereusd.service keeps systemd from
restarting on 2 and 3, which need a person):
  0  stopped on SIGTERM/SIGINT
  1  runtime failure (the authenticator stopped, an unexpected error)
  2  bad configuration or arguments (the settings key and what is allowed are named)
  3  the environment refused start-up: state_dir not writable or full, the store missing where one was
     (``--new-store`` starts empty on purpose), damaged or failing integrity_check, key files with loose
     permissions, a port in use or a bind host that is not this host's
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from planner.errors import NereusError, SpecError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_STARTUP = 0, 1, 2, 3


def _settings(args: argparse.Namespace) -> Any:
    from nereusd.settings import load_settings

    overrides: dict[str, Any] = {}
    if getattr(args, "state_dir", None):
        overrides["daemon"] = {"state_dir": str(Path(args.state_dir).absolute())}  # explicit: relative to here
    return load_settings(args.config, **overrides)


def make_source(settings: Any, log: Any) -> Any:
    """The allocation source the settings ask for; None (logged) where none is available."""
    try:
        from nereusd import sources  # type: ignore[attr-defined]
    except ImportError:
        log.warning("no-allocation-source", reason="nereusd.sources is not installed; jobs are driven by agents")
        return None
    return sources.make_source(settings, log)


def make_planner(log: Any) -> tuple[Any, str]:
    try:
        from nereusd.planning import PlannerBinding
    except ImportError as exc:
        log.warning("no-planner", reason=f"the planner cannot be imported ({exc}); decisions are recorded as "
                    "infeasible")
        return None, "none"
    return PlannerBinding(), "planner.search"


def stop_handler(daemon: Any) -> Callable[[int, Any], None]:
    """SIGTERM/SIGINT's handler: only a plain assignment. It runs on the main thread between any two
    bytecodes, maybe inside the logger's write with its lock held (a handler that logged deadlocked a
    daemon on SIGTERM, for good) or inside an Event's lock; the serve loop sees ``signalled`` within a
    tick, logs it and stops."""
    def stop(signum: int, _frame: Any) -> None:
        daemon.signalled = signum
    return stop


def serve(args: argparse.Namespace) -> int:
    from nereusd.daemon import Daemon
    from nereusd.wire.logs import configure_logging, get_logger

    settings = _settings(args)
    configure_logging(settings.daemon.log_format, settings.daemon.log_level)
    log = get_logger("daemon")
    planner, planner_name = make_planner(log)
    daemon = Daemon(settings, source=make_source(settings, log), planner=planner, planner_name=planner_name,
                    new_store=args.new_store)

    stop = stop_handler(daemon)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        daemon.serve()
    finally:
        daemon.close()
    if daemon.fatal:
        print(f"nereusd: failed: {daemon.fatal}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def keys(args: argparse.Namespace) -> int:
    from nereusd.wire.keys import KeyStore

    store = KeyStore(Path(_settings(args).daemon.state_dir) / "keys")
    if args.keys_command == "init":
        created = store.init()
        print(f"{'created' if created else 'kept existing'} server keypair in {store.root}")
    elif args.keys_command == "create":
        store.server_keys()  # the daemon's keypair must be there: never invent a state dir with a new one
        key = store.create_client(name=args.name, user=args.user, role=args.role, out_dir=Path(args.out))
        print(f"created {key.role} key {key.name!r} for user {key.user!r}; bundle in {args.out} "
              f"(client.key_secret is mode 0600: hand it to {key.user} only)")
    elif args.keys_command == "list":
        rows = [{"name": k.name, "user": k.user, "role": k.role, "public_key": k.public_key} for k in store.clients()]
        if args.json:
            print(json.dumps(rows))
        else:
            for r in rows:
                print(f"{r['name']:<20} {r['user']:<16} {r['role']:<6} {r['public_key']}")
    elif args.keys_command == "revoke":
        store.revoke(args.name)
        print(f"revoked {args.name!r}; connected clients using it are refused from their next connection")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nereusd", description="The Nereus daemon")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("serve", help="run the daemon (systemd: Type=notify)")
    p.add_argument("--config", help="settings TOML (default: $NEREUS_CONFIG or /etc/nereus/nereusd.toml)")
    p.add_argument("--new-store", action="store_true",
                   help="start with an empty store although state_dir held one (it was lost or moved aside)")
    p.set_defaults(handler=serve)
    k = sub.add_parser("keys", help="CURVE keys: server keypair and client (agent/admin) keys")
    ksub = k.add_subparsers(dest="keys_command", required=True, metavar="KEYS_COMMAND")
    for name, help_ in (("init", "create the server keypair"), ("create", "create and authorise a client key"),
                        ("list", "list authorised client keys"), ("revoke", "revoke a client key")):
        kp = ksub.add_parser(name, help=help_)
        kp.add_argument("--config", help="settings TOML (its daemon.state_dir holds the keys)")
        kp.add_argument("--state-dir", help="daemon state directory (overrides the config)")
        kp.set_defaults(handler=keys)
        if name in ("create", "revoke"):
            kp.add_argument("name", help="key name (letters, digits, _ . -)")
        if name == "create":
            kp.add_argument("--user", required=True, help="the Unix/Slurm user the key acts for")
            kp.add_argument("--role", choices=("agent", "admin"), default="agent")
            kp.add_argument("--out", required=True, help="directory for the client bundle")
        if name == "list":
            kp.add_argument("--json", action="store_true")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from nereusd.daemon import StartupError

    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except StartupError as exc:
        print(f"nereusd: cannot start: {exc}", file=sys.stderr)
        return EXIT_STARTUP
    except SpecError as exc:
        print(f"nereusd: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except NereusError as exc:
        print(f"nereusd: failed: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except OSError as exc:
        print(f"nereusd: failed: {exc}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
