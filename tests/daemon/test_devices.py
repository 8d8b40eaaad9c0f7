"""Device discovery of the node agent: NVML's bindings, else its command line, CUDA_VISIBLE_DEVICES, CPU slots.

`nvidia-smi` is a stand-in script printing what the real one prints for three H200s, and the NVML
bindings (pynvml, from nvidia-ml-py) are a stand-in module or hidden: the bindings are tried first, so
where nvidia-ml-py is installed on a GPU machine the real GPUs would otherwise answer instead.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import psutil
import pytest

from agent.node import discover_devices

SMI = """#!/bin/sh
echo "0, NVIDIA H200, 143771"
echo "1, NVIDIA H200, 143771"
echo "2, NVIDIA H200, 143771"
"""


@pytest.fixture(autouse=True)
def no_nvml_bindings(monkeypatch: pytest.MonkeyPatch) -> None:
    """``import pynvml`` fails (None in sys.modules) unless a test puts its own stand-in there."""
    monkeypatch.setitem(sys.modules, "pynvml", None)


def _stand_in_pynvml(names: list[str], memory_bytes: int) -> types.ModuleType:
    """What nvidia-ml-py answers on a machine with these GPUs (names as bytes, as older versions give)."""
    nvml = types.ModuleType("pynvml")
    calls: list[str] = []
    nvml.calls = calls  # type: ignore[attr-defined]
    nvml.nvmlInit = lambda: calls.append("init")  # type: ignore[attr-defined]
    nvml.nvmlShutdown = lambda: calls.append("shutdown")  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetCount = lambda: len(names)  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetHandleByIndex = lambda i: i  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetName = lambda h: names[h].encode()  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=memory_bytes)  # type: ignore[attr-defined]
    return nvml


def test_nvml_bindings_answer_before_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "nvidia-smi").write_text(SMI)
    (tmp_path / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = _stand_in_pynvml(["NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-80GB"], 85899345920)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    devs = discover_devices()
    assert [(d.index, d.kind, d.name, d.memory_bytes) for d in devs] == [
        (0, "gpu", "NVIDIA A100-SXM4-80GB", 85899345920), (1, "gpu", "NVIDIA A100-SXM4-80GB", 85899345920)]
    assert nvml.calls == ["init", "shutdown"]  # type: ignore[attr-defined]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert [d.index for d in discover_devices()] == [1]
    # bindings without a driver (nvmlInit raises): the command line answers
    def no_driver() -> None:
        raise RuntimeError("NVML Shared Library Not Found")
    nvml.nvmlInit = no_driver  # type: ignore[attr-defined]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert [d.name for d in discover_devices()] == ["NVIDIA H200"] * 3


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
