"""Submit an elastic job's anchor and member jobs through submitit; each runs one node agent per node.

Every job runs ``python -m agent.node --endpoint ADDR --job JOB [--keys DIR]`` once per node through srun (submitit's
sbatch script + ``submitit.helpers.CommandFunction``). The anchor is started ``--no-kill`` so that it
survives losing a node; members are one node each, ``--no-requeue`` (the daemon decides whether to
grow again), and carry the comment ``nereus:JOB`` so a restarted daemon finds them again.

A live job (``job_file`` set) also runs its workers and its driver. Each srun task then runs
``python -m agent.slurm_task --driver-file F [--anchor-job ANCHOR] [--driver-cmd DRIVER] -- AGENT``
where AGENT is the agent command plus ``--worker-cmd '<python> -m agent.worker'``: the anchor's task 0
publishes the driver's endpoint (the address that reaches nereusd, a free port) in F =
``<folder>/driver-JOB.json`` and gives its agent ``--driver ENDPOINT --driver-cmd '<python> -m
agent.driver --job-file FILE <driver_args>'``; every other task (the anchor's other nodes, members
submitted any time later) reads F, written by that anchor, and gives its agent ``--driver ENDPOINT``.
So ``folder`` must be shared by the nodes (submitit needs that anyway). ``exclusive`` asks for whole
nodes: the daemon knows one agent per node and job, so two of the job's Slurm jobs must not share one.

sbatch runs through ``timeout`` (a hung slurmctld must not hang the daemon) and with the configured
SLURM_CONF. Growth never uses Slurm job expansion: it fails for jobs holding GRES in 22.05.

    launcher = SubmititLauncher(LaunchSpec(job_id="grpo-8b", folder="/shared/nereus/grpo-8b",
                                           gpus_per_node=8, endpoint="tcp://head:7501"))
    anchor = launcher.submit(role="anchor", nodes=2)
    member = launcher.submit(role="member", nodes=1)
"""

from __future__ import annotations

import shlex
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from planner.errors import NereusError, SpecError

Role = Literal["anchor", "member"]
ROLES = ("anchor", "member")


class SubmitError(NereusError):
    """sbatch refused or failed; the message carries Slurm's words."""


def job_comment(job_id: str) -> str:
    """The comment on every Slurm job of elastic job ``job_id`` (the poller's identity check uses it)."""
    return f"nereus:{job_id}"


def slurm_job_name(job_id: str, role: Role) -> str:
    return f"nereus-{job_id}-{role}"


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchSpec:
    job_id: str  # Nereus' name for the elastic job (agents register with it)
    folder: str  # shared folder for submitit's scripts, pickles and logs (%j is the Slurm job id)
    gpus_per_node: int
    endpoint: str  # where agents reach nereusd, e.g. tcp://head:7501
    keys_dir: str | None = None  # the agents' CURVE key bundle (nereusctl keys), readable on the nodes
    partition: str | None = None
    time_limit_min: int | None = None  # None: the partition's limit
    account: str | None = None
    qos: str | None = None
    python: str | None = None  # interpreter on the compute nodes (default: this one)
    agent_argv: tuple[str, ...] | None = None  # default: python -m agent.node --endpoint ADDR --job JOB
    agent_args: tuple[str, ...] = ()  # appended to the default agent command (e.g. --cpu-slots 2)
    setup: tuple[str, ...] = ()  # shell lines run in the batch script before srun
    job_file: str | None = None  # a live job's engine job file (readable on the nodes): workers and driver run
    worker_cmd: str | None = None  # a live job's worker command (default: python -m agent.worker)
    driver_args: tuple[str, ...] = ()  # appended to python -m agent.driver --job-file FILE
    anchor_job_id: str | None = None  # members of a live job: whose driver file to read
    exclusive: bool = False  # whole nodes for each Slurm job (--exclusive)
    sbatch_timeout_s: float = 20.0
    extra_sbatch: Mapping[str, Any] = field(default_factory=dict)  # more #SBATCH flags

    def __post_init__(self) -> None:
        if not self.job_id or any(c.isspace() for c in self.job_id) or ":" in self.job_id:
            raise SpecError("launch.job_id", f"got {self.job_id!r}", "a non-empty name without spaces or ':'")
        if self.gpus_per_node < 0:
            raise SpecError("launch.gpus_per_node", f"must be >= 0, got {self.gpus_per_node}")
        if self.time_limit_min is not None and self.time_limit_min < 1:
            raise SpecError("launch.time_limit_min", f"must be >= 1 or None, got {self.time_limit_min}")
        if not self.endpoint.startswith(("tcp://", "ipc://")):
            raise SpecError("launch.endpoint", f"got {self.endpoint!r}", "tcp://HOST:PORT where agents reach nereusd")
        if self.sbatch_timeout_s <= 0:
            raise SpecError("launch.sbatch_timeout_s", f"must be > 0, got {self.sbatch_timeout_s}")
        if self.job_file is not None and not self.job_file.startswith("/"):
            raise SpecError("launch.job_file", f"got {self.job_file!r}", "an absolute path the nodes can read")

    @property
    def interpreter(self) -> str:
        return self.python or sys.executable

    def agent_command(self) -> list[str]:
        if self.agent_argv is not None:
            return list(self.agent_argv)
        keys = ["--keys", self.keys_dir] if self.keys_dir else []
        return [self.interpreter, "-m", "agent.node", "--endpoint", self.endpoint, "--job", self.job_id, *keys,
                *self.agent_args]

    @property
    def driver_file(self) -> str:
        """Where a live job's anchor publishes its driver's endpoint: the job folder (above any %j part)."""
        parts = self.folder.split("/")
        base = "/".join(parts[:next((i for i, p in enumerate(parts) if "%" in p), len(parts))]) or "/"
        return f"{base.rstrip('/')}/driver-{self.job_id}.json"

    def task_command(self, role: Role) -> list[str]:
        """What each srun task of a ``role`` job runs: the agent, behind agent.slurm_task for a live job."""
        if self.job_file is None:
            return self.agent_command()
        py = self.interpreter
        agent = [*self.agent_command(), "--worker-cmd", self.worker_cmd or f"{shlex.quote(py)} -m agent.worker"]
        task = [py, "-m", "agent.slurm_task", "--driver-file", self.driver_file]
        if role == "anchor":
            driver = [py, "-m", "agent.driver", "--job-file", self.job_file, *self.driver_args]
            task += ["--driver-cmd", shlex.join(driver)]
        elif self.anchor_job_id is None:
            raise SpecError("launch.anchor_job_id", "a live job's member needs it (to find the anchor's driver)")
        else:
            task += ["--anchor-job", self.anchor_job_id]
        return [*task, "--", *agent]


@dataclass(frozen=True, kw_only=True, slots=True)
class SubmittedJob:
    slurm_job_id: str
    role: Role
    nodes: int
    submitted_at_s: float  # this side's clock; the poller pins Slurm's own submit time at first sight


class SubmititLauncher:
    """Builds submitit executors for one elastic job and submits its anchor and member jobs."""

    def __init__(self, spec: LaunchSpec, env: Mapping[str, str] | None = None) -> None:
        self.spec = spec
        self.env = dict(env or {})  # only SLURM_CONF is passed on (the rest is this process' own)

    def parameters(self, role: Role, nodes: int) -> dict[str, Any]:
        if role not in ROLES:
            raise SpecError("launch.role", f"got {role!r}", ", ".join(ROLES))
        if nodes < 1 or (role == "member" and nodes != 1):
            raise SpecError("launch.nodes", f"got {nodes} for a {role}", "anchor: >= 1; member: exactly 1")
        spec = self.spec
        extra: dict[str, Any] = {"time": "UNLIMITED"} if spec.time_limit_min is None else {}
        # anchor: survive losing a node; member: one node, never requeued behind the daemon's back
        extra.update({"no-kill": True} if role == "anchor" else {"no-requeue": True})
        if spec.exclusive:
            extra["exclusive"] = True
        extra.update(spec.extra_sbatch)
        params: dict[str, Any] = {
            "job_name": slurm_job_name(spec.job_id, role), "comment": job_comment(spec.job_id),
            "nodes": nodes, "ntasks_per_node": 1, "signal_delay_s": 30, "stderr_to_stdout": True,
            "srun_args": ["--no-kill", "--kill-on-bad-exit=0"] if role == "anchor" else [],
            "additional_parameters": extra,
        }
        if spec.setup:
            params["setup"] = list(spec.setup)
        if spec.gpus_per_node:
            params["gres"] = f"gpu:{spec.gpus_per_node}"
        if spec.time_limit_min is not None:
            params["time"] = spec.time_limit_min
        for key in ("partition", "account", "qos"):
            if getattr(spec, key) is not None:
                params[key] = getattr(spec, key)
        return params

    def executor(self, role: Role, nodes: int) -> Any:
        import submitit  # imported here: only a daemon that submits jobs pays for it

        launcher = self

        class _Executor(submitit.SlurmExecutor):  # type: ignore[misc]
            def _make_submission_command(self, submission_file_path: Any) -> list[str]:
                prefix = ["env", f"SLURM_CONF={launcher.env['SLURM_CONF']}"] if "SLURM_CONF" in launcher.env else []
                return [*prefix, "timeout", str(launcher.spec.sbatch_timeout_s), "sbatch", str(submission_file_path)]

        ex = _Executor(folder=self.spec.folder, max_num_timeout=0, python=shlex.quote(self.spec.interpreter))
        ex.update_parameters(**self.parameters(role, nodes))
        return ex

    def sbatch_text(self, role: Role, nodes: int) -> str:
        """The batch script submitit generates for this job (tests compare it with a reference)."""
        from submitit.slurm.slurm import _make_sbatch_string  # the text SlurmExecutor writes, without srun

        command = f"{shlex.quote(self.spec.interpreter)} -u -m submitit.core._submit {shlex.quote(self.spec.folder)}"
        return str(_make_sbatch_string(command=command, folder=self.spec.folder, **self.parameters(role, nodes)))

    def submit(self, role: Role, nodes: int) -> SubmittedJob:
        import submitit

        ex = self.executor(role, nodes)
        t0 = time.time()
        try:
            job = ex.submit(submitit.helpers.CommandFunction(self.spec.task_command(role)))
        except Exception as exc:  # submitit wraps sbatch failures in FailedJobError/CalledProcessError
            raise SubmitError(f"sbatch of the {role} of {self.spec.job_id} failed: {exc}") from exc
        return SubmittedJob(slurm_job_id=str(job.job_id), role=role, nodes=nodes, submitted_at_s=t0)
