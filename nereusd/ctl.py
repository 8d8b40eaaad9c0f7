"""nereusctl: the Nereus admin CLI.

    nereusctl plan --model llama-3.1-8b --algo ppo --device h200 --gpus 1024 \
        --prompt-tokens 1024 --response-tokens 4096 [--json]

Each subcommand lives in its own module and registers itself here through ``add_parser`` and
``run``; tables for people, ``--json`` for scripts. Exit codes: 0 ok, 1 failure reported by the
daemon or planner (e.g. infeasible), 2 bad input, 3 daemon unreachable, 141 the output's reader
closed the pipe (as a shell reports SIGPIPE).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

from planner.errors import InfeasibleError, SpecError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3
EXIT_PIPE = 141


def _subcommands() -> list[ModuleType]:
    mods: list[ModuleType] = []
    try:  # the what-if planner (`nereusctl plan`), present once the planner lands
        from nereusd import whatif  # type: ignore[attr-defined,unused-ignore]
    except ImportError:
        pass
    else:
        mods.append(whatif)
    try:  # admin subcommands that talk to the daemon (present once the daemon lands)
        from nereusd import admin_cli
    except ImportError:
        pass
    else:
        mods.append(admin_cli)
    from nereusd.sim import cli as simulate_cli  # `nereusctl simulate` (no daemon needed)

    mods.append(simulate_cli)
    return mods


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nereusctl", description="Nereus admin CLI")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for mod in _subcommands():
        mod.add_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except BrokenPipeError:  # `nereusctl ... | head`: the reader left; no traceback, and none at exit's flush
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PIPE
    except SpecError as exc:
        print(f"nereusctl: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except InfeasibleError as exc:
        print(f"nereusctl: infeasible: {exc}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
