"""Pick the daemon's allocation source from its settings: Slurm when it is enabled and installed,
else the local source (the embedded default). ``nereusd serve`` calls ``make_source``.

Member jobs of an elastic job are launched with what the job was registered with (its spec's
``elastic.extra``: ``folder``, ``endpoint``, ``keys_dir``, ``python``, ``agent_args``); what is
missing comes from the daemon: folder <state_dir>/slurm/JOB, endpoint from <state_dir>/endpoints.json
(read when a member is submitted, so a port chosen at start-up (0) is right).
"""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path
from typing import Any

from nereusd.allocation import AllocationSource, ElasticJob
from nereusd.local_source import LocalSource, load_schedule
from nereusd.settings import Settings


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
            sbatch_timeout_s=settings.slurm.command_timeout_s,
        )

    return spec


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
    # A [local] settings section (num_nodes, slots_per_node, schedule_path) is read when present.
    local = getattr(settings, "local", None)
    schedule_path = getattr(local, "schedule_path", None)
    log.info("allocation-source", source="local", schedule=str(schedule_path) if schedule_path else None,
             reason="Slurm disabled in settings" if not settings.slurm.enabled else "squeue/sbatch not found")
    return LocalSource(num_nodes=getattr(local, "num_nodes", 4), slots_per_node=getattr(local, "slots_per_node", 8),
                       schedule=load_schedule(schedule_path) if schedule_path else ())
