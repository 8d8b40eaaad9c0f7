"""One srun task of a live elastic job on Slurm: find (or publish) the job driver's endpoint, then exec the agent.

    python -m agent.slurm_task --driver-file DIR/driver-JOB.json [--anchor-job ID] [--driver-cmd CMD] \
        -- python -m agent.node --endpoint ... --job JOB ...

Every node's agent needs ``--driver tcp://HOST:PORT``, the endpoint its workers dial; the driver runs on
the anchor job's first node (task 0, the batch host), started by that node's agent (``--driver-cmd``).
Member jobs are submitted later, by nereusd, when nobody knows that endpoint but the anchor, so the
anchor publishes it in the job's shared folder:

- the anchor's task 0 (no ``--anchor-job``: this Slurm job is the anchor) picks the address of the
  interface that reaches nereusd (the agent's ``--endpoint``; the other nodes reach that network too)
  and a free port, writes ``{"anchor_job_id", "endpoint", "node"}`` to the driver file (temporary name,
  then rename), and execs the agent with ``--driver ENDPOINT --driver-cmd CMD``;
- every other task (the anchor's other nodes; members, whose ``--anchor-job`` names the anchor) waits,
  up to ``--wait-s``, for a driver file written by that anchor (a file of an earlier job is ignored),
  then execs the agent with ``--driver ENDPOINT``.

Every agent gets NEREUS_DRIVER_FILE (the driver file) in its environment, and its workers with it: when
the anchor is requeued, its task 0 publishes a new driver there, and the workers of the surviving nodes
dial that one with the state they hold (``agent.hub.WorkerLink``; the driver adopts them).

Only the standard library: this runs before anything heavy is imported, and is replaced by the agent.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

EXIT_NO_DRIVER = 4


def reachable_address(endpoint: str) -> str:
    """This host's address on the interface that routes to ``endpoint`` (tcp://HOST:PORT; no packet is sent);
    for another kind of endpoint (ipc://), the address this host's name resolves to."""
    host, _, port = endpoint.split("://", 1)[-1].rpartition(":")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host.strip("[]"), int(port)))
            return str(s.getsockname()[0])
    except (ValueError, OSError):
        return socket.gethostbyname(socket.gethostname())


def free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


def publish(path: Path, anchor_job_id: str, endpoint: str, node: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"anchor_job_id": anchor_job_id, "endpoint": endpoint, "node": node,
                               "written_at": time.time()}))
    tmp.replace(path)


def read_published(path: Path, anchor_job_id: str) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and str(data.get("anchor_job_id")) == anchor_job_id else None


def _agent_endpoint(agent: list[str]) -> str:
    if "--endpoint" in agent and agent.index("--endpoint") + 1 < len(agent):
        return agent[agent.index("--endpoint") + 1]
    return os.environ.get("NEREUS_ENDPOINT", "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agent.slurm_task", description=__doc__.split("\n\n")[0])
    p.add_argument("--driver-file", type=Path, required=True, help="where the anchor publishes the driver endpoint")
    p.add_argument("--anchor-job", help="the anchor's Slurm job id (members); absent: this job is the anchor")
    p.add_argument("--driver-cmd", default="", help="the driver command (the anchor's task 0 hands it to its agent)")
    p.add_argument("--wait-s", type=float, default=900.0, help="how long a task waits for the driver file")
    p.add_argument("agent", nargs=argparse.REMAINDER, help="-- then the agent command")
    args = p.parse_args(argv)
    agent = args.agent[1:] if args.agent[:1] == ["--"] else args.agent
    if not agent:
        print("slurm_task: no agent command after --", file=sys.stderr)
        return 2
    env = os.environ
    own_job = env.get("SLURM_JOB_ID", "")
    anchor = args.anchor_job or own_job
    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    if not anchor:
        print("slurm_task: not in a Slurm job (no SLURM_JOB_ID) and no --anchor-job", file=sys.stderr)
        return 2
    if args.anchor_job is None and env.get("SLURM_PROCID", "0") == "0":
        address = reachable_address(_agent_endpoint(agent))
        endpoint = f"tcp://{address}:{free_port(address)}"
        args.driver_file.parent.mkdir(parents=True, exist_ok=True)
        publish(args.driver_file, anchor, endpoint, node)
        extra = ["--driver", endpoint] + (["--driver-cmd", args.driver_cmd] if args.driver_cmd else [])
    else:
        deadline = time.monotonic() + args.wait_s
        while (published := read_published(args.driver_file, anchor)) is None:
            if time.monotonic() > deadline:
                print(f"slurm_task: no driver endpoint from anchor job {anchor} in {args.driver_file} within "
                      f"{args.wait_s:g} s", file=sys.stderr)
                return EXIT_NO_DRIVER
            time.sleep(0.5)  # the anchor's first task writes the file once, at its start
        extra = ["--driver", str(published["endpoint"])]
    print(f"slurm_task: job {own_job} node {node}: driver {extra[1]}" + (" (here)" if len(extra) > 2 else ""),
          flush=True)
    # the agent's workers watch the file: a requeued anchor publishes its new driver there, and they dial it
    os.environ["NEREUS_DRIVER_FILE"] = str(args.driver_file.resolve())
    os.execvp(agent[0], [*agent, *extra])
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
