"""Pick the daemon's allocation source from its settings: Slurm when it is enabled and installed,
else the local source (the embedded default). ``nereusd serve`` calls ``make_source``.

Member jobs of an elastic job are launched with what the job was registered with (its spec's
``elastic.extra``: ``folder``, ``endpoint``, ``keys_dir``, ``python``, ``agent_args``, and for a live job
``job_file``, ``worker_cmd``, ``driver_args``, ``exclusive``); what is missing comes from the daemon:
folder <state_dir>/slurm/JOB, endpoint from <state_dir>/endpoints.json (read when a member is
submitted, so a port chosen at start-up (0) is right). A live job's member reads its driver's
endpoint from the file the anchor published in the job folder (nereusd.slurm.submit).

The local source starts, per granted node of a job whose spec names its job file or agent keys
(``elastic.extra`` ``job_file`` / ``keys_dir``; a job with neither is only tracked), one agent::

    python -m agent.node --endpoint CONTROL --keys KEYS --job JOB --node NODE --cpu-slots SLOTS
        [--worker-cmd '<[local] worker_cmd>'] [--driver tcp://127.0.0.1:PORT
        [--driver-cmd '<[local] driver_cmd> --job-file JOB_FILE']] <[local] agent_args>

``--driver`` (one free port per job, the same on all its nodes) and, on the job's first node (the
anchor) only, ``--driver-cmd`` come with a job file. KEYS is ``extra.keys_dir``, else
``<state_dir>/keys/agent-<user>`` (``nereusd keys create NAME --user USER --role agent --out`` that
directory); a job whose bundle or job file is missing is refused (AllocationError) before it is tracked.
``{python}`` in the commands is this interpreter.
"""

from __future__ import annotations

import json
import shlex
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

from nereusd.allocation import AllocationError, AllocationSource, ElasticJob, NodeAllocation
from nereusd.local_source import LocalSource, load_schedule
from nereusd.settings import Settings
from planner.errors import SpecError


def _endpoint(settings: Settings) -> str:
    try:
        return str(json.loads((Path(settings.daemon.state_dir) / "endpoints.json").read_text())["control"])
    except (OSError, ValueError, KeyError):
        return f"tcp://{settings.control.bind_host}:{settings.control.port}"


def launch_spec_for(settings: Settings) -> Any:
    from nereusd.slurm.submit import LaunchSpec

    def spec(job: ElasticJob) -> LaunchSpec:
        extra = job.extra
        return LaunchSpec(
            job_id=job.job_id, gpus_per_node=job.gpus_per_node, partition=job.partition,
            folder=extra.get("folder") or str(Path(settings.daemon.state_dir) / "slurm" / job.job_id),
            endpoint=extra.get("endpoint") or _endpoint(settings), keys_dir=extra.get("keys_dir"),
            python=extra.get("python"), agent_args=tuple(shlex.split(extra.get("agent_args", ""))),
            sbatch_timeout_s=settings.slurm.command_timeout_s, job_file=extra.get("job_file") or None,
            worker_cmd=extra.get("worker_cmd") or None, driver_args=tuple(shlex.split(extra.get("driver_args", ""))),
            anchor_job_id=job.anchor_job_id, exclusive=bool(extra.get("exclusive")),
        )

    return spec


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalAgents:
    """The local source's ``agent_argv``: the agent command of one node of a job (None: start none)."""

    def __init__(self, settings: Settings, python: str = sys.executable) -> None:
        self.settings = settings
        self.python = python
        self.driver_ports: dict[str, int] = {}  # job -> its driver's port, one for all its nodes
        self.anchors: dict[str, str] = {}  # job -> the node its driver runs on (the first one started)

    def _command(self, template: str) -> str:
        return template.replace("{python}", shlex.quote(self.python))

    def keys_dir(self, job: ElasticJob) -> Path:
        keys = Path(job.extra.get("keys_dir") or Path(self.settings.daemon.state_dir) / "keys" / f"agent-{job.slurm_user}")
        from nereusd.wire.keys import load_bundle

        try:
            load_bundle(keys)
        except SpecError as exc:
            raise AllocationError(f"job {job.job_id}: no agent key bundle for user {job.slurm_user} ({exc}); give "
                                  "elastic.extra.keys_dir, or create one with `nereusd keys create NAME --user "
                                  f"{job.slurm_user} --role agent --out {keys}`") from None
        return keys

    def wanted(self, job: ElasticJob) -> bool:
        """Agents are started for a job that names its job file or agent keys; others are only tracked
        (their agents are started by hand: tests, agents-only runs)."""
        return bool(job.extra.get("job_file") or job.extra.get("keys_dir"))

    def check(self, job: ElasticJob) -> None:
        """Refuse (AllocationError) a job whose agents could not start, before it is tracked."""
        if not self.wanted(job):
            return
        self.keys_dir(job)
        job_file = job.extra.get("job_file")
        if job_file and (not Path(job_file).is_absolute() or not Path(job_file).is_file()):
            raise AllocationError(f"job {job.job_id}: elastic.extra.job_file {job_file!r} is not an existing "
                                  "absolute path")

    def __call__(self, job: ElasticJob, node: NodeAllocation) -> list[str] | None:
        if not self.wanted(job):
            return None
        job_file = job.extra.get("job_file")
        local = self.settings.local
        argv = [self.python, "-m", "agent.node", "--endpoint", _endpoint(self.settings),
                "--keys", str(self.keys_dir(job)), "--job", job.job_id, "--node", node.node,
                "--cpu-slots", str(len(node.gpu_indices))]
        if local.worker_cmd.strip():
            argv += ["--worker-cmd", self._command(local.worker_cmd)]
        if job_file:
            port = self.driver_ports.setdefault(job.job_id, _free_port())
            argv += ["--driver", f"tcp://127.0.0.1:{port}"]
            if self.anchors.setdefault(job.job_id, node.node) == node.node:
                argv += ["--driver-cmd", f"{self._command(local.driver_cmd)} --job-file {shlex.quote(job_file)}"]
        return argv + shlex.split(local.agent_args)


def make_source(settings: Settings, log: Any) -> AllocationSource:
    if settings.slurm.enabled and shutil.which("squeue") and shutil.which("sbatch"):
        from nereusd.slurm.commands import SlurmCommands
        from nereusd.slurm.elastic import SlurmSource
        from nereusd.slurm.poller import SlurmPoller

        s = settings.slurm
        commands = SlurmCommands(timeout_s=s.command_timeout_s)
        poller = SlurmPoller(commands, interval_s=s.poll_interval_s, backoff_max_s=s.poll_backoff_max_s)
        log.info("allocation-source", source="slurm", poll_interval_s=s.poll_interval_s)
        return SlurmSource(commands, poller, launch_spec=launch_spec_for(settings),
                           max_submissions_per_minute=s.max_member_submissions_per_minute)
    local = settings.local
    log.info("allocation-source", source="local", schedule=str(local.schedule_path) if local.schedule_path else None,
             agents=local.start_agents,
             reason="Slurm disabled in settings" if not settings.slurm.enabled else "squeue/sbatch not found")
    return LocalSource(num_nodes=local.num_nodes, slots_per_node=local.slots_per_node,
                       schedule=load_schedule(local.schedule_path) if local.schedule_path else (),
                       agent_argv=LocalAgents(settings) if local.start_agents else None,
                       log_dir=Path(settings.daemon.state_dir) / "local")
