#!/usr/bin/env python3
"""Submit an elastic job to Slurm and register it with nereusd (example; run on a login node).

    python etc/submit_elastic.py grpo-8b --min-gpus 16 --max-gpus 64 --gpus-per-node 8 \
        --endpoint tcp://head:7501 --folder /shared/nereus/grpo-8b --keys ~/.config/nereus/agent \
        --ctl-keys ~/.config/nereus/admin --ctl-endpoint tcp://head:7502 [--partition gpu] [--members 2]

The anchor job is submitted held, registered (nereusctl job-add), then released; each of its nodes
runs `python -m agent.node` through srun. nereusd grows the job later with one-node member jobs.
Prints the job record as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys

from nereusd.launch import nereusctl_job_add, submit_elastic_job


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("job_id")
    p.add_argument("--min-gpus", type=int, required=True)
    p.add_argument("--max-gpus", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--endpoint", required=True, help="where agents reach nereusd, tcp://HOST:PORT")
    p.add_argument("--folder", required=True, help="shared folder for scripts and logs")
    p.add_argument("--keys", help="agent key bundle directory (nereusd keys create --role agent)")
    p.add_argument("--partition")
    p.add_argument("--members", type=int, default=0, help="member jobs to submit at once")
    p.add_argument("--time-limit-min", type=int)
    p.add_argument("--ctl-endpoint", help="nereusd admin endpoint for job-add")
    p.add_argument("--ctl-keys", help="admin key bundle for job-add")
    p.add_argument("--no-register", action="store_true", help="do not call nereusctl job-add")
    args = p.parse_args(argv)
    ctl_args = [*(["--endpoint", args.ctl_endpoint] if args.ctl_endpoint else []),
                *(["--keys", args.ctl_keys] if args.ctl_keys else [])]
    job = submit_elastic_job(
        job_id=args.job_id, min_gpus=args.min_gpus, max_gpus=args.max_gpus, gpus_per_node=args.gpus_per_node,
        endpoint=args.endpoint, folder=args.folder, keys_dir=args.keys, partition=args.partition,
        members=args.members, time_limit_min=args.time_limit_min,
        register=None if args.no_register else nereusctl_job_add(ctl_args=ctl_args))
    print(json.dumps(job.to_dict(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
