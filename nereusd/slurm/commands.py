"""The one seam for Slurm subprocesses (squeue, sinfo, scontrol, sbatch, scancel).

Every call has a timeout; a failing, slow or missing command becomes a ``CommandResult`` with
``ok=False`` and a log line, never an exception into the daemon's loop. Tests point ``bin_dir`` at a
directory of stand-in scripts (a squeue that hangs, one that fails) to exercise exactly this path.

    cmds = SlurmCommands(timeout_s=20)
    data = cmds.squeue_json()           # None when squeue failed (already logged)
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nereusd.slurm.hostlist import expand, split_top_level
from nereusd.wire.logs import get_logger
from planner.errors import SpecError

TIMED_OUT = 124  # returncode reported for a command killed at its timeout (as timeout(1) does)
NOT_FOUND = 127


@dataclass(frozen=True, kw_only=True, slots=True)
class CommandResult:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    duration_s: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def error(self) -> str:
        """One line saying what went wrong (empty when ok)."""
        if self.ok:
            return ""
        tail = (self.stderr.strip() or self.stdout.strip()).splitlines()[-1:] or [""]
        return f"{self.argv[0]} exited {self.returncode} after {self.duration_s:.2f} s: {tail[0][:300]}"


class SlurmCommands:
    """Runs Slurm commands with a timeout and an environment (SLURM_CONF), logging failures."""

    def __init__(self, *, timeout_s: float = 20.0, env: Mapping[str, str] | None = None,
                 bin_dir: str | None = None) -> None:
        if timeout_s <= 0:
            raise SpecError("slurm.command_timeout_s", f"must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.env = dict(os.environ if env is None else env)
        if bin_dir is not None:  # stand-in commands first on PATH (tests), the real ones after
            self.env["PATH"] = bin_dir + os.pathsep + self.env.get("PATH", "")
        self.log = get_logger("slurm")
        self.calls = 0  # how many subprocesses were started (tests check batching with it)

    def run(self, argv: Sequence[str], *, input_text: str | None = None,
            timeout_s: float | None = None) -> CommandResult:
        self.calls += 1
        limit = timeout_s or self.timeout_s
        t0 = time.monotonic()
        try:
            proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=limit, env=self.env,
                                  input=input_text, stdin=None if input_text is not None else subprocess.DEVNULL)
            result = CommandResult(argv=tuple(argv), returncode=proc.returncode, stdout=proc.stdout,
                                   stderr=proc.stderr, duration_s=time.monotonic() - t0)
        except subprocess.TimeoutExpired:
            result = CommandResult(argv=tuple(argv), returncode=TIMED_OUT, stdout="",
                                   stderr=f"timed out after {limit:.1f} s", duration_s=time.monotonic() - t0)
        except OSError as exc:  # not installed, not executable
            result = CommandResult(argv=tuple(argv), returncode=NOT_FOUND, stdout="", stderr=str(exc),
                                   duration_s=time.monotonic() - t0)
        if not result.ok:
            self.log.warning("slurm_command_failed", argv=list(argv), returncode=result.returncode,
                             duration_s=round(result.duration_s, 3), error=result.error)
        return result

    def _json(self, argv: Sequence[str]) -> dict[str, Any] | None:
        result = self.run(argv)
        if not result.ok:
            return None
        try:
            data = json.loads(result.stdout)
        except json.JSONDecodeError as exc:
            self.log.warning("slurm_bad_json", argv=list(argv), error=str(exc), head=result.stdout[:200])
            return None
        if not isinstance(data, dict):
            self.log.warning("slurm_bad_json", argv=list(argv), error="top level is not an object")
            return None
        return data

    # --- the calls the poller and the elastic source make ------------------------------------------
    def squeue_json(self) -> dict[str, Any] | None:
        """All jobs Slurm knows (22.05 ignores -j/-u/-t with --json: callers filter by job id)."""
        return self._json(["squeue", "--json"])

    def sinfo_json(self) -> dict[str, Any] | None:
        return self._json(["sinfo", "--json"])

    def show_job(self, job_id: str) -> dict[str, str] | None:
        """``scontrol -o show job -d ID`` parsed into key=value pairs plus per-node GRES (see parse)."""
        result = self.run(["scontrol", "-o", "show", "job", "-d", str(job_id)])
        if not result.ok or not result.stdout.strip():
            return None
        return parse_show_job(result.stdout)

    def sbatch(self, script: str, args: Sequence[str] = ()) -> CommandResult:
        return self.run(["sbatch", "--parsable", *args], input_text=script)

    def scancel(self, job_ids: Sequence[str], *, signal: str | None = None) -> CommandResult:
        argv = ["scancel", *([f"--signal={signal}"] if signal else []), *map(str, job_ids)]
        return self.run(argv)

    def update_job(self, job_id: str, **fields: str | int) -> CommandResult:
        """``scontrol update JobId=X Key=Value ...`` (NumNodes, NodeList, TimeLimit ...)."""
        return self.run(["scontrol", "update", f"JobId={job_id}", *(f"{k}={v}" for k, v in fields.items())])


def parse_show_job(text: str) -> dict[str, str]:
    """Parse one-line ``scontrol -o show job -d`` output.

    Plain keys map to their values. The detail segments ``Nodes=node[1-2] CPU_IDs=0 Mem=0
    GRES=gpu:4(IDX:0-3)`` repeat once per group of nodes; they are collected into the key
    ``_node_gres`` as ``hostlist=gres`` pairs joined by ';' (see ``node_gpu_indices``).
    """
    fields: dict[str, str] = {}
    details: list[str] = []
    current_nodes: str | None = None
    for token in text.strip().splitlines()[0].split():
        key, sep, value = token.partition("=")
        if not sep:
            continue
        if key == "Nodes":
            current_nodes = value
        elif key == "GRES" and current_nodes is not None:
            details.append(f"{current_nodes}={value}")
            current_nodes = None
        elif key not in fields:
            fields[key] = value
    fields["_node_gres"] = ";".join(details)
    return fields


def gres_indices(gres: str, name: str = "gpu") -> tuple[int, ...]:
    """Device indices out of a GRES detail string: ``gpu:4(IDX:0-1,3)`` -> (0, 1, 3); none -> ()."""
    out: list[int] = []
    for item in split_top_level(gres, "()"):
        if not item.startswith(name + ":") or "(IDX:" not in item:
            continue
        body = item.split("(IDX:", 1)[1].rstrip(")")
        if body in ("N/A", ""):
            continue
        for part in body.split(","):
            lo, _, hi = part.partition("-")
            out.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(out)


def node_gpu_indices(fields: Mapping[str, str], name: str = "gpu") -> dict[str, tuple[int, ...]]:
    """Per-node device indices from ``parse_show_job`` output: {'node1': (0, 1, 2, 3), ...}."""

    out: dict[str, tuple[int, ...]] = {}
    for pair in filter(None, fields.get("_node_gres", "").split(";")):
        hosts, _, gres = pair.partition("=")
        for host in expand(hosts):
            out[host] = gres_indices(gres, name)
    return out
