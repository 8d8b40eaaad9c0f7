#!/usr/bin/env python3
"""Submit an elastic job to Slurm and register it with nereusd (run on a login node).

    python3 etc/submit_elastic.py live --job-file etc/jobs/live.toml

takes the job file `nereusctl job-add --job-file` takes (model, algorithm, workload and [placement]'s
elastic bounds) and finds the rest from the documented defaults:
  --endpoint     where agents reach nereusd: $NEREUS_ENDPOINT, else "control" in endpoints.json of
                 --state-dir ($NEREUS_STATE_DIR, default /var/lib/nereus)
  --keys         the agents' key bundle: $NEREUS_KEYS, else ~/.config/nereus/agent
  --ctl-keys     the admin key bundle for job-add: $NEREUS_CTL_KEYS, else ~/.config/nereus/admin
  --ctl-endpoint the admin endpoint: $NEREUS_CTL_ENDPOINT, else "admin" in that endpoints.json
  --folder       the job's shared folder (scripts, logs, the driver's endpoint): ~/nereus-jobs/JOB
More: [--partition P] [--members N] [--time-limit-min M] [--min-gpus/--max-gpus/--gpus-per-node]
[--driver-args '...'] [--agent-args '...'] [--exclusive] [--no-register] (agents only; then
--min-gpus/--max-gpus without a job file are enough).

The anchor job is submitted held, registered (nereusctl job-add), then released; each of its nodes
runs `python -m agent.node` through srun, with workers, and the anchor's first node runs the driver
(`python -m agent.driver --job-file FILE`). nereusd grows the job toward max_gpus by itself with
one-node member jobs. Prints the job record as JSON; any error is one line naming what to pass.

Interpreter: any python works. The checkout's root goes first on sys.path; if this interpreter lacks
the project's dependencies, the script re-executes itself with $NEREUS_PYTHON or the checkout's
.venv/bin/python (`make venv`), which is then also the interpreter on the nodes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REEXEC = "NEREUS_SUBMIT_REEXEC"


def _bootstrap() -> None:
    """Make ``import nereusd`` work here: the checkout on sys.path, or the project's venv re-exec'd."""
    sys.path.insert(0, str(ROOT))
    try:
        import submitit  # noqa: F401  (what submitting needs besides the checkout)

        import nereusd.launch  # noqa: F401
        import nereusd.wire.keys  # noqa: F401  (zmq)
    except ImportError as exc:
        here = os.path.realpath(sys.executable)
        for cand in (os.environ.get("NEREUS_PYTHON"), str(ROOT / ".venv" / "bin" / "python")):
            if cand and os.access(cand, os.X_OK) and os.path.realpath(cand) != here and not os.environ.get(REEXEC):
                os.execve(cand, [cand, str(Path(__file__).resolve()), *sys.argv[1:]], {**os.environ, REEXEC: "1"})
        print(f"submit_elastic.py: error: {sys.executable} cannot import Nereus ({exc}); run `make venv` in "
              f"{ROOT} (then any python finds .venv), or set NEREUS_PYTHON=/path/to/venv/bin/python", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    from nereusd.launch import submit_main

    return submit_main(sys.argv[1:] if argv is None else argv, doc=__doc__ or "")


if __name__ == "__main__":
    _bootstrap()
    sys.exit(main())
