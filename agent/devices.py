"""The devices a node agent offers its job: one worker per device.

GPUs through NVML (the Python bindings, else ``nvidia-smi``), limited to CUDA_VISIBLE_DEVICES; where NVML
finds none (no driver, or fake GPUs such as a test cluster's /dev/null GRES files), the GPUs the
allocation grants (CUDA_VISIBLE_DEVICES, SLURM_STEP_GPUS / SLURM_JOB_GPUS, SLURM_GPUS_ON_NODE); else CPU
worker slots (psutil).

    devices = discover_devices()            # or discover_devices(cpu_slots=2)
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping

import psutil

from nereusd.wire import protocol


def _visible(devices: list[protocol.Device]) -> list[protocol.Device]:
    """Only the GPUs Slurm gave this job (CUDA_VISIBLE_DEVICES as indices), when it says."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None or not all(x.strip().isdigit() for x in env.split(",") if x.strip()):
        return devices  # unset, or UUIDs: NVML's view stands
    allowed = {int(x) for x in env.split(",") if x.strip()}
    return [d for d in devices if d.index in allowed]


def _nvidia_smi() -> list[protocol.Device]:
    """GPUs from `nvidia-smi` (the NVML command line) where the Python bindings are not installed."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    devices = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit() and parts[2].isdigit():
            devices.append(protocol.Device(index=int(parts[0]), kind="gpu", name=parts[1],
                                           memory_bytes=int(parts[2]) << 20))  # MiB
    return devices


def _nvml() -> list[protocol.Device]:
    """GPUs through the NVML Python bindings (nvidia-ml-py), when installed and a driver answers."""
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
    except Exception:  # no bindings, no driver, no GPU
        return []
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            out.append(protocol.Device(index=i, kind="gpu", name=name.decode() if isinstance(name, bytes) else str(name),
                                       memory_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(h).total)))
        return out
    finally:
        pynvml.nvmlShutdown()


def _indices(text: str | None) -> list[int] | None:
    """"0,1,3" or "0-3,5" as indices; None when unset or not indices (UUIDs, "N/A")."""
    if not text or not text.strip():
        return None
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            return None
        out.extend(range(int(lo), int(hi or lo) + 1))
    return sorted(set(out))


def allocated_gpus(env: Mapping[str, str] = os.environ) -> tuple[protocol.Device, ...]:
    """The GPUs the allocation grants this node, without NVML (none there, or fake GPUs): the indices of
    CUDA_VISIBLE_DEVICES, else SLURM_STEP_GPUS / SLURM_JOB_GPUS, else SLURM_GPUS_ON_NODE of them."""
    found = _indices(env.get("CUDA_VISIBLE_DEVICES"))
    for var in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        found = found if found is not None else _indices(env.get(var))
    count = env.get("SLURM_GPUS_ON_NODE", "")
    if found is None and count.isdigit():
        found = list(range(int(count)))
    return tuple(protocol.Device(index=i, kind="gpu", name="gpu (Slurm GRES, no NVML)", memory_bytes=0)
                 for i in found or ())


def discover_devices(cpu_slots: int | None = None, env: Mapping[str, str] | None = None) -> tuple[protocol.Device, ...]:
    """GPUs through NVML (bindings, else nvidia-smi), limited to CUDA_VISIBLE_DEVICES; else the GPUs the
    allocation grants (``allocated_gpus``: Slurm's GRES without NVML); else (or with ``cpu_slots``) CPU
    worker slots from psutil."""
    if cpu_slots is None:
        gpus = _visible(_nvml() or _nvidia_smi()) or list(allocated_gpus(os.environ if env is None else env))
        if gpus:
            return tuple(gpus)
    slots = cpu_slots or psutil.cpu_count(logical=False) or 1
    mem = psutil.virtual_memory().total // slots
    return tuple(protocol.Device(index=i, kind="cpu", name="cpu", memory_bytes=mem) for i in range(slots))
