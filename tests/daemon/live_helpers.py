"""What the daemon's live-order tests share: a tiny planned job, CPU devices, the bound, and readers."""

from __future__ import annotations

from typing import Any

from nereusd.wire import protocol

from .conftest import DaemonHandle

SPEC = {"model": "tiny-3m", "algo": "grpo", "device": "cpu", "gpus_per_node": 2,
        "workload": {"prompts_per_step": 8, "prompt_tokens": 32, "response_tokens": 64}}
ELASTIC = {"anchor_job_id": "local-j", "min_gpus": 2, "max_gpus": 6, "gpus_per_node": 2}
DEVS = tuple(protocol.Device(index=i, kind="cpu", name="cpu", memory_bytes=8 << 30) for i in range(2))
WAIT_S = 60.0  # every bound holds on a loaded 2-core machine


def events_of(daemon: DaemonHandle, job: str, kind: str) -> list[dict[str, Any]]:
    return [e for e in daemon.admin("events", job=job) if e["kind"] == kind]


def alloc_kinds(daemon: DaemonHandle, job: str) -> list[str]:
    return [a["source"] for a in daemon.admin("alloc", job=job)["allocations"]]
