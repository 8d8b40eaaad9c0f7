"""Python API to submit an elastic job to Slurm through submitit: an anchor job plus optional members,
each running the node agent (``python -m agent.node``) once per node via srun.

    from nereusd.launch import submit_elastic_job, nereusctl_job_add
    job = submit_elastic_job(job_id="grpo-8b", min_gpus=16, max_gpus=64, gpus_per_node=8,
                             endpoint="tcp://head:7501", folder="/shared/nereus/grpo-8b",
                             keys_dir="~/.config/nereus/agent", register=nereusctl_job_add(user="alice"))

The anchor is submitted held, registered with nereusd (``register``), then released, so its agents
never reach the daemon before the job exists there. Growth later is the daemon's business: it submits
member jobs through the same launcher (nereusd.slurm.submit) when its planner wants more GPUs.
``submit_main`` is etc/submit_elastic.py's command line: defaults (keys, endpoints, folder) are resolved
and checked here, before anything is submitted, and every error is one line naming what to pass.

A live job (``job_file``: the engine's job file, on a filesystem the nodes share) runs its workers and
driver too: every agent gets ``--worker-cmd`` and ``--driver tcp://HOST:PORT``, the anchor's first task
``--driver-cmd '<python> -m agent.driver --job-file FILE <driver_args>'``; the anchor publishes the
driver's endpoint in the job folder, where members find it (nereusd.slurm.submit says how). What the
daemon needs to launch members the same way (job file, worker command, driver arguments, exclusive)
is kept in the record's ``extra``.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import shlex
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from nereusd.allocation import ElasticJob
from nereusd.slurm.submit import LaunchSpec, SubmitError, SubmititLauncher, job_comment
from planner.errors import NereusError, SpecError

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
        except BaseException:  # not registered: its agents would be refused; it must not stay held either
            subprocess.run(["scancel", anchor.slurm_job_id], capture_output=True, env=environment, timeout=30)
            raise
        _release(anchor.slurm_job_id, environment)
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


# --- the command line (etc/submit_elastic.py) ---------------------------------------------------------
class UsageError(NereusError):
    """What the user must pass (one line)."""


def default_state_dir(given: str | None = None, env: Mapping[str, str] = os.environ) -> Path:
    return Path(given or env.get("NEREUS_STATE_DIR") or "/var/lib/nereus")


def daemon_endpoint(which: str, *, state_dir: Path, flag: str) -> str:
    """``which`` ("control": agents, "admin": nereusctl) from the running daemon's endpoints.json; a
    wildcard bind host is replaced by this host's name (the nodes dial it)."""
    try:
        endpoint = str(json.loads((state_dir / "endpoints.json").read_text())[which])
    except (OSError, ValueError, KeyError, TypeError):
        raise UsageError(f"cannot find nereusd's {which} endpoint: no endpoints.json in {state_dir}; pass {flag} "
                         "tcp://HOST:PORT or --state-dir DIR (is nereusd running?)") from None
    host = endpoint.removeprefix("tcp://").rpartition(":")[0]
    return endpoint.replace(host, socket.getfqdn(), 1) if host in ("0.0.0.0", "*", "[::]") else endpoint


def key_bundle(given: str | None, env_var: str, default: str, flag: str, role: str) -> str:
    """The key bundle directory to use, checked loadable now (not on the nodes, minutes later)."""
    from nereusd.wire.keys import load_bundle

    path = Path(os.path.expanduser(given or os.environ.get(env_var) or default)).absolute()
    try:
        load_bundle(path)
    except SpecError as exc:
        raise UsageError(f"{exc}: pass {flag} DIR (made by `nereusd keys create NAME --role {role} --user "
                         f"{getpass.getuser()} --out DIR`) or set ${env_var}") from None
    return str(path)


def _parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="submit_elastic.py", description=doc.split("\n\n")[0],
                                epilog="defaults: see the top of etc/submit_elastic.py")
    p.add_argument("job_id")
    p.add_argument("--job-file", help="the job file nereusctl job-add --job-file takes (etc/jobs/*.toml)")
    p.add_argument("--min-gpus", type=int)
    p.add_argument("--max-gpus", type=int)
    p.add_argument("--gpus-per-node", type=int)
    p.add_argument("--endpoint", help="where agents reach nereusd, tcp://HOST:PORT (default: endpoints.json)")
    p.add_argument("--state-dir", help="the daemon's state dir holding endpoints.json (default /var/lib/nereus)")
    p.add_argument("--folder", help="shared folder for scripts and logs (default ~/nereus-jobs/JOB)")
    p.add_argument("--keys", help="agent key bundle directory (default ~/.config/nereus/agent)")
    p.add_argument("--partition")
    p.add_argument("--members", type=int, default=0, help="member jobs to submit at once")
    p.add_argument("--time-limit-min", type=int)
    p.add_argument("--python", help="the interpreter on the nodes (default: this one)")
    p.add_argument("--agent-args", default="", help="more agent.node arguments, e.g. '--log-format json'")
    p.add_argument("--driver-args", default="", help="more agent.driver arguments (with --job-file)")
    p.add_argument("--worker-cmd", help="the worker command (with --job-file; default: python -m agent.worker)")
    p.add_argument("--exclusive", action="store_true", help="whole nodes for every Slurm job of the job")
    p.add_argument("--ctl-endpoint", help="nereusd admin endpoint for job-add (default: endpoints.json)")
    p.add_argument("--ctl-keys", help="admin key bundle for job-add (default ~/.config/nereus/admin)")
    p.add_argument("--ctl-args", default="", help="more nereusctl arguments for job-add")
    p.add_argument("--no-register", action="store_true", help="do not call nereusctl job-add (agents only)")
    return p


def submit_main(argv: Sequence[str], doc: str = "") -> int:
    """etc/submit_elastic.py: 0 submitted (the record on stdout), 2 bad input, 1 Slurm or nereusd refused."""
    args = _parser(doc).parse_args(list(argv))
    try:
        job = _submit_from_args(args)
    except UsageError as exc:
        print(f"submit_elastic.py: error: {exc}", file=sys.stderr)
        return 2
    except SpecError as exc:
        print(f"submit_elastic.py: error: {exc}", file=sys.stderr)
        return 2
    except (NereusError, OSError) as exc:
        print(f"submit_elastic.py: failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
              file=sys.stderr)
        return 1
    print(json.dumps(job.to_dict(), indent=1))
    return 0


def _submit_from_args(args: argparse.Namespace) -> ElasticJob:
    spec: dict[str, Any] = {}
    bounds = {"min_gpus": args.min_gpus, "max_gpus": args.max_gpus, "gpus_per_node": args.gpus_per_node}
    if args.job_file:
        from nereusd.jobfile import job_spec as read_job_file

        spec = read_job_file(args.job_file, anchor_job_id="(submitted)")  # the anchor's id is known after sbatch
        elastic = spec.pop("elastic")
        spec.pop("gpus_per_node")
        bounds = {k: elastic[k] if v is None else v for k, v in bounds.items()}
    elif not args.no_register:
        raise UsageError("pass --job-file FILE (the job file nereusctl job-add --job-file takes, e.g. "
                         "etc/jobs/live.toml: model, algorithm, workload and [placement]), or --no-register")
    missing = [f"--{k.replace('_', '-')}" for k, v in bounds.items() if v is None and k != "gpus_per_node"]
    if missing:
        raise UsageError(f"pass {', '.join(missing)} (or --job-file with [placement])")
    state_dir = default_state_dir(args.state_dir)
    endpoint = args.endpoint or os.environ.get("NEREUS_ENDPOINT") or \
        daemon_endpoint("control", state_dir=state_dir, flag="--endpoint")
    keys: str | None = None
    if not args.no_register or args.keys or os.environ.get("NEREUS_KEYS") or \
            Path("~/.config/nereus/agent").expanduser().exists():  # agents only: a test may run without keys
        keys = key_bundle(args.keys, "NEREUS_KEYS", "~/.config/nereus/agent", "--keys", "agent")
    register = None
    if not args.no_register:
        ctl_keys = key_bundle(args.ctl_keys, "NEREUS_CTL_KEYS", "~/.config/nereus/admin", "--ctl-keys", "admin")
        ctl_endpoint = args.ctl_endpoint or os.environ.get("NEREUS_CTL_ENDPOINT") or \
            daemon_endpoint("admin", state_dir=state_dir, flag="--ctl-endpoint")
        register = nereusctl_job_add(ctl_args=["--endpoint", ctl_endpoint, "--keys", ctl_keys,
                                               *shlex.split(args.ctl_args)], spec=spec)
    return submit_elastic_job(
        job_id=args.job_id, min_gpus=bounds["min_gpus"], max_gpus=bounds["max_gpus"],
        gpus_per_node=bounds["gpus_per_node"] or 8, endpoint=endpoint,
        folder=args.folder or f"~/nereus-jobs/{args.job_id}", keys_dir=keys, partition=args.partition,
        members=args.members, time_limit_min=args.time_limit_min, python=args.python,
        agent_args=shlex.split(args.agent_args), job_file=args.job_file, worker_cmd=args.worker_cmd,
        driver_args=shlex.split(args.driver_args), exclusive=args.exclusive, register=register)
