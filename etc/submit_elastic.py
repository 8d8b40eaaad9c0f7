#!/usr/bin/env python3
"""Submit an elastic job to Slurm and register it with nereusd (example; run on a login node).

    python etc/submit_elastic.py grpo-8b --min-gpus 16 --max-gpus 64 --gpus-per-node 8 \
        --endpoint tcp://head:7501 --folder /shared/nereus/grpo-8b --keys ~/.config/nereus/agent \
        --ctl-keys ~/.config/nereus/admin --ctl-endpoint tcp://head:7502 [--partition gpu] [--members 2]

    python etc/submit_elastic.py live --job-file /shared/jobs/live.toml --endpoint tcp://head:7501 \
        --folder /shared/nereus/live --keys ~/.config/nereus/agent --ctl-keys ~/.config/nereus/admin \
        [--driver-args '--events /shared/nereus/live/events.jsonl'] [--agent-args '--cpu-slots 2'] [--exclusive]

The anchor job is submitted held, registered (nereusctl job-add), then released; each of its nodes
runs `python -m agent.node` through srun. nereusd grows the job later with one-node member jobs.
With --job-file the job is the live one: the job file (shared with the nodes) gives model, algorithm,
workload and the elastic bounds (its [placement]; --min-gpus/--max-gpus/--gpus-per-node override
them), the job is registered with that spec, every agent runs workers, and the anchor's first node
runs the driver (`python -m agent.driver --job-file FILE`, plus --driver-args).
Prints the job record as JSON.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from typing import Any

from nereusd.launch import nereusctl_job_add, submit_elastic_job


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("job_id")
    p.add_argument("--job-file", help="the live job's engine job file (etc/jobs/*.toml), readable on the nodes")
    p.add_argument("--min-gpus", type=int)
    p.add_argument("--max-gpus", type=int)
    p.add_argument("--gpus-per-node", type=int)
    p.add_argument("--endpoint", required=True, help="where agents reach nereusd, tcp://HOST:PORT")
    p.add_argument("--folder", required=True, help="shared folder for scripts and logs")
    p.add_argument("--keys", help="agent key bundle directory (nereusd keys create --role agent)")
    p.add_argument("--partition")
    p.add_argument("--members", type=int, default=0, help="member jobs to submit at once")
    p.add_argument("--time-limit-min", type=int)
    p.add_argument("--python", help="the interpreter on the nodes (default: this one)")
    p.add_argument("--agent-args", default="", help="more agent.node arguments, e.g. '--cpu-slots 2'")
    p.add_argument("--driver-args", default="", help="more agent.driver arguments (with --job-file)")
    p.add_argument("--worker-cmd", help="the worker command (with --job-file; default: python -m agent.worker)")
    p.add_argument("--exclusive", action="store_true", help="whole nodes for every Slurm job of the job")
    p.add_argument("--ctl-endpoint", help="nereusd admin endpoint for job-add")
    p.add_argument("--ctl-keys", help="admin key bundle for job-add")
    p.add_argument("--ctl-args", default="", help="more nereusctl arguments for job-add (e.g. '--state-dir DIR')")
    p.add_argument("--no-register", action="store_true", help="do not call nereusctl job-add")
    args = p.parse_args(argv)
    spec: dict[str, Any] = {}
    bounds = {"min_gpus": args.min_gpus, "max_gpus": args.max_gpus, "gpus_per_node": args.gpus_per_node}
    if args.job_file:
        from nereusd.jobfile import job_spec

        spec = job_spec(args.job_file, anchor_job_id="(submitted)")  # the anchor's id is known after sbatch
        elastic = spec.pop("elastic")
        spec.pop("gpus_per_node")
        bounds = {k: elastic[k] if v is None else v for k, v in bounds.items()}
    missing = [f"--{k.replace('_', '-')}" for k, v in bounds.items() if v is None and k != "gpus_per_node"]
    if missing:
        p.error(f"{', '.join(missing)} needed (or --job-file with [placement])")
    ctl_args = [*(["--endpoint", args.ctl_endpoint] if args.ctl_endpoint else []),
                *(["--keys", args.ctl_keys] if args.ctl_keys else []), *shlex.split(args.ctl_args)]
    job = submit_elastic_job(
        job_id=args.job_id, min_gpus=bounds["min_gpus"], max_gpus=bounds["max_gpus"],
        gpus_per_node=bounds["gpus_per_node"] or 8, endpoint=args.endpoint, folder=args.folder, keys_dir=args.keys,
        partition=args.partition, members=args.members, time_limit_min=args.time_limit_min, python=args.python,
        agent_args=shlex.split(args.agent_args), job_file=args.job_file, worker_cmd=args.worker_cmd,
        driver_args=shlex.split(args.driver_args), exclusive=args.exclusive,
        register=None if args.no_register else nereusctl_job_add(ctl_args=ctl_args, spec=spec))
    print(json.dumps(job.to_dict(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
