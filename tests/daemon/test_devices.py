"""Device discovery of the node agent: NVML's command line when no bindings, CUDA_VISIBLE_DEVICES, CPU slots.

No GPU here, so `nvidia-smi` is a stand-in script printing what the real one prints for two H200s.
"""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from agent.node import discover_devices

SMI = """#!/bin/sh
echo "0, NVIDIA H200, 143771"
echo "1, NVIDIA H200, 143771"
echo "2, NVIDIA H200, 143771"
"""


def test_gpus_from_nvidia_smi_limited_to_the_visible_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "nvidia-smi").write_text(SMI)
    (tmp_path / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    devs = discover_devices()
    assert [(d.index, d.kind, d.name) for d in devs] == [(0, "gpu", "NVIDIA H200"), (1, "gpu", "NVIDIA H200"),
                                                         (2, "gpu", "NVIDIA H200")]
    assert devs[0].memory_bytes == 143771 << 20
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")  # what Slurm sets for a job's GRES
    assert [d.index for d in discover_devices()] == [0, 2]
    assert all(d.kind == "cpu" for d in discover_devices(cpu_slots=3))


def test_cpu_slots_without_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    devs = discover_devices()
    assert devs and all(d.kind == "cpu" for d in devs)
    assert len(devs) == (psutil.cpu_count(logical=False) or 1)
    assert len(discover_devices(cpu_slots=4)) == 4


def test_gpus_from_the_slurm_allocation_without_nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake GPUs (gres.conf File= links, no NVML): the count is what Slurm granted, not CPU slots."""
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    granted = {"CUDA_VISIBLE_DEVICES": "4,5,6,7", "SLURM_JOB_GPUS": "4,5,6,7", "SLURM_GPUS_ON_NODE": "4"}
    devs = discover_devices(env=granted)
    assert [(d.index, d.kind) for d in devs] == [(4, "gpu"), (5, "gpu"), (6, "gpu"), (7, "gpu")]
    assert [d.index for d in discover_devices(env={"SLURM_STEP_GPUS": "0-2,5"})] == [0, 1, 2, 5]
    assert [d.index for d in discover_devices(env={"SLURM_GPUS_ON_NODE": "2"})] == [0, 1]
    assert all(d.kind == "cpu" for d in discover_devices(env={"CUDA_VISIBLE_DEVICES": ""}))  # none granted
    assert all(d.kind == "cpu" for d in discover_devices(env={"CUDA_VISIBLE_DEVICES": "GPU-1a2b"}))  # UUIDs: no count
    assert len(discover_devices(cpu_slots=2, env=granted)) == 2  # --cpu-slots still wins
