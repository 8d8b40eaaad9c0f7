"""Markers that say what a test needs beyond this CPU machine, and skip reasons that say exactly what
is missing, so that a one-GPU machine runs every test it can:

- ``gpu``: one CUDA GPU;
- ``gpus(n)``: ``n`` CUDA devices (NCCL between processes needs one device per rank);
- ``vllm``: a CUDA GPU and the vllm extra (``pip install -e '.[vllm]'``; ``make test`` installs it
  where ``nvidia-smi`` is found).

torch is imported only when a test carrying one of these markers is about to run.
"""

from __future__ import annotations

import importlib.util

import pytest


def _cuda_devices() -> tuple[int, str]:
    import torch

    if not torch.cuda.is_available():
        return 0, f"torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False)"
    n = torch.cuda.device_count()
    return n, f"this machine has {n} CUDA device{'s' if n != 1 else ''}"


def needs_skip(item: pytest.Item) -> str | None:
    """Why ``item`` cannot run here, or None."""
    wants = [m.args[0] if m.args else 1 for m in item.iter_markers("gpus")]
    if item.get_closest_marker("gpu") or item.get_closest_marker("vllm"):
        wants.append(1)
    if wants:
        need = max(wants)
        have, why = _cuda_devices()
        if have < need:
            return f"needs {need} CUDA device{'s' if need != 1 else ''}: {why}"
    if item.get_closest_marker("vllm") and importlib.util.find_spec("vllm") is None:
        return "needs the vllm extra: vllm is not importable (pip install -e '.[vllm]')"
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    reason = needs_skip(item)
    if reason:
        pytest.skip(reason)
