"""Python API to submit an elastic job to Slurm through submitit: an anchor job plus optional members,
each running the node agent (``python -m agent.node``) once per node via srun.

    from nereusd.launch import submit_elastic_job, nereusctl_job_add
    job = submit_elastic_job(job_id="grpo-8b", min_gpus=16, max_gpus=64, gpus_per_node=8,
                             endpoint="tcp://head:7501", folder="/shared/nereus/grpo-8b",
                             keys_dir="~/.config/nereus/agent", register=nereusctl_job_add(user="alice"))

The anchor is submitted held, registered with nereusd (``register``), then released, so its agents
never reach the daemon before the job exists there. Growth later is the daemon's business: it submits
member jobs through the same launcher (nereusd.slurm.submit) when its planner wants more GPUs.
See etc/submit_elastic.py for a command-line example.

A live job (``job_file``: the engine's job file, on a filesystem the nodes share) runs its workers and
driver too: every agent gets ``--worker-cmd`` and ``--driver tcp://HOST:PORT``, the anchor's first task
``--driver-cmd '<python> -m agent.driver --job-file FILE <driver_args>'``; the anchor publishes the
driver's endpoint in the job folder, where members find it (nereusd.slurm.submit says how). What the
daemon needs to launch members the same way (job file, worker command, driver arguments, exclusive)
is kept in the record's ``extra``.
"""

from __future__ import annotations

import getpass
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from nereusd.allocation import ElasticJob
from nereusd.slurm.submit import LaunchSpec, SubmitError, SubmititLauncher, job_comment
from planner.errors import SpecError

Register = Callable[[ElasticJob], None]


def submit_elastic_job(*, job_id: str, min_gpus: int, max_gpus: int, gpus_per_node: int, endpoint: str,
                       folder: str, keys_dir: str | None = None, partition: str | None = None,
                       anchor_nodes: int | None = None, members: int = 0, time_limit_min: int | None = None,
                       python: str | None = None, agent_args: Sequence[str] = (),
                       agent_argv: Sequence[str] | None = None, register: Register | None = None,
                       env: Mapping[str, str] | None = None, user: str | None = None, job_file: str | None = None,
                       worker_cmd: str | None = None, driver_args: Sequence[str] = (),
                       exclusive: bool = False) -> ElasticJob:
    """Submit the anchor (``anchor_nodes``, default enough nodes for ``min_gpus``) and ``members``
    one-node member jobs; returns the ElasticJob record the daemon tracks."""
    if gpus_per_node < 1:
        raise SpecError("gpus_per_node", f"must be >= 1, got {gpus_per_node}")
    nodes = anchor_nodes if anchor_nodes is not None else -(-min_gpus // gpus_per_node)
    if nodes < 1 or (nodes + members) * gpus_per_node > max_gpus:
        raise SpecError("anchor_nodes/members", f"{nodes} anchor nodes + {members} members of {gpus_per_node} "
                        f"GPUs exceed max_gpus={max_gpus} (or anchor_nodes < 1)")
    environment = dict(os.environ if env is None else env)
    spec = LaunchSpec(job_id=job_id, folder=os.path.expanduser(folder), gpus_per_node=gpus_per_node,
                      endpoint=endpoint, keys_dir=os.path.expanduser(keys_dir) if keys_dir else None,
                      partition=partition, time_limit_min=time_limit_min, python=python,
                      agent_args=tuple(agent_args), agent_argv=tuple(agent_argv) if agent_argv else None,
                      job_file=os.path.abspath(os.path.expanduser(job_file)) if job_file else None,
                      worker_cmd=worker_cmd, driver_args=tuple(driver_args), exclusive=exclusive)
    held = replace(spec, extra_sbatch={"hold": True}) if register is not None else spec
    anchor = SubmititLauncher(held, env=environment).submit("anchor", nodes)
    job = ElasticJob(job_id=job_id, anchor_job_id=anchor.slurm_job_id, min_gpus=min_gpus, max_gpus=max_gpus,
                     gpus_per_node=gpus_per_node, slurm_user=user or getpass.getuser(), partition=partition,
                     extra={k: v for k, v in {"folder": spec.folder, "endpoint": endpoint, "keys_dir": spec.keys_dir,
                                              "python": python, "agent_args": shlex.join(agent_args),
                                              "comment": job_comment(job_id), "job_file": spec.job_file,
                                              "worker_cmd": worker_cmd, "driver_args": shlex.join(driver_args),
                                              "exclusive": "1" if exclusive else ""}.items() if v})
    if register is not None:
        try:
            register(job)
        finally:  # registered or not, the anchor must not stay held forever; a failed register
            _release(anchor.slurm_job_id, environment)  # leaves its agents to fail fast instead
    launcher = SubmititLauncher(replace(spec, anchor_job_id=anchor.slurm_job_id), env=environment)
    for _ in range(members):
        job = job.with_member(launcher.submit("member", 1).slurm_job_id)
    return job


def _release(slurm_job_id: str, env: Mapping[str, str]) -> None:
    proc = subprocess.run(["scontrol", "release", slurm_job_id], capture_output=True, text=True, env=dict(env),
                          timeout=30)
    if proc.returncode != 0:
        raise SubmitError(f"scontrol release {slurm_job_id} failed: {proc.stderr.strip()}")


def job_spec(job: ElasticJob, **more: object) -> dict[str, object]:
    """The spec ``nereusctl job-add --spec`` takes for this job (``more``: model, algo, workload ...)."""
    return {**more, "gpus_per_node": job.gpus_per_node, "elastic": job.to_dict()}


def nereusctl_job_add(*, user: str | None = None, nereusctl: Sequence[str] = (sys.executable, "-m", "nereusd.ctl"),
                      ctl_args: Sequence[str] = (), spec: Mapping[str, object] | None = None,
                      env: Mapping[str, str] | None = None) -> Register:
    """A ``register`` callback that runs ``nereusctl job-add`` (admin keys and endpoint via ``ctl_args``)."""

    def register(job: ElasticJob) -> None:
        argv = [*nereusctl, "job-add", job.job_id, "--user", user or job.slurm_user,
                "--spec", json.dumps(job_spec(job, **dict(spec or {}))), "--slurm-job-id", job.anchor_job_id,
                *ctl_args]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                              env=None if env is None else dict(env))
        if proc.returncode != 0:
            raise SubmitError(f"nereusctl job-add {job.job_id} failed ({proc.returncode}): "
                              f"{proc.stderr.strip() or proc.stdout.strip()}")

    return register
