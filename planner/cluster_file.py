"""A user's own cluster from a TOML file, validated: the one place the planner reads a file.

    [cluster]
    system = "dgx-h100"        # a node design from planner.hardware.SYSTEMS to start from (optional)
    num_nodes = 16
    gpus_per_node = 8           # defaults to the system's
    step_overhead_s = 2.0       # fixed seconds per RL step outside the model-stages (optional)
    refit_setup_s = 1.0         # set-up of each step's train -> generation weight refit (optional)

    [device]                    # optional with a system; else all of these
    preset = "h100"             # or: name, memory_gb, peak_tflops_bf16, hbm_tb_per_s

    [intra_node]                # optional with a system; else a preset or both figures
    preset = "nvlink4"          # or: gb_per_s (per GPU, per direction), latency_us

    [inter_node]                # NICs per node x speed / GPUs per node; or gb_per_s per GPU directly
    nics_per_node = 8
    nic_gbit_per_s = 400
    latency_us = 5

Examples: etc/clusters/*.toml. ``load_cluster(path)`` reads one; ``cluster_from_dict`` validates the
parsed table (tests and the daemon's job files use it directly). Unknown keys are errors, not ignored.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from planner.errors import SpecError
from planner.hardware import (
    LINKS,
    ClusterSpec,
    DeviceSpec,
    LinkSpec,
    device_preset,
    nic_link,
    system_preset,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

_KEYS = {
    "cluster": {"system", "num_nodes", "gpus_per_node", "step_overhead_s", "refit_setup_s", "name"},
    "device": {"preset", "name", "memory_gb", "peak_tflops_bf16", "hbm_tb_per_s"},
    "intra_node": {"preset", "gb_per_s", "latency_us"},
    "inter_node": {"preset", "gb_per_s", "latency_us", "nics_per_node", "nic_gbit_per_s"},
}


def load_cluster(path: str | Path) -> ClusterSpec:
    """Read and validate a cluster TOML file."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except tomllib.TOMLDecodeError as e:
        raise SpecError("cluster_file", f"{path}: not valid TOML ({e})") from e
    return cluster_from_dict(data, source=str(path))


def _section(data: Mapping[str, Any], name: str, source: str) -> dict[str, Any]:
    sec = data.get(name, {})
    if not isinstance(sec, Mapping):
        raise SpecError(f"{source}:{name}", "must be a table")
    unknown = set(sec) - _KEYS[name]
    if unknown:
        raise SpecError(f"{source}:{name}", f"unknown keys {sorted(unknown)}", ", ".join(sorted(_KEYS[name])))
    return dict(sec)


def _number(sec: Mapping[str, Any], key: str, where: str, *, positive: bool = True) -> float:
    v = sec[key]
    if isinstance(v, bool) or not isinstance(v, int | float) or (positive and v <= 0) or v < 0:
        raise SpecError(f"{where}.{key}", f"must be a number {'> 0' if positive else '>= 0'}, got {v!r}")
    return float(v)


def _integer(sec: Mapping[str, Any], key: str, where: str) -> int:
    v = sec[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise SpecError(f"{where}.{key}", f"must be an integer >= 1, got {v!r}")
    return v


def cluster_from_dict(data: Mapping[str, Any], source: str = "cluster") -> ClusterSpec:
    unknown = set(data) - set(_KEYS)
    if unknown:
        raise SpecError(source, f"unknown tables {sorted(unknown)}", ", ".join(_KEYS))
    c, d = _section(data, "cluster", source), _section(data, "device", source)
    intra, inter = _section(data, "intra_node", source), _section(data, "inter_node", source)
    system = system_preset(str(c["system"])) if "system" in c else None
    if "num_nodes" not in c:
        raise SpecError(f"{source}:cluster.num_nodes", "is required")
    num_nodes = _integer(c, "num_nodes", f"{source}:cluster")
    if "gpus_per_node" in c:
        per_node = _integer(c, "gpus_per_node", f"{source}:cluster")
    elif system is not None:
        per_node = system.gpus_per_node
    else:
        raise SpecError(f"{source}:cluster.gpus_per_node", "is required without a system")

    device: DeviceSpec
    if "preset" in d:
        device = device_preset(str(d["preset"]))
    elif d:
        missing = {"memory_gb", "peak_tflops_bf16", "hbm_tb_per_s"} - set(d)
        if missing:
            raise SpecError(f"{source}:device", f"missing {sorted(missing)} (or give a preset)")
        where = f"{source}:device"
        device = DeviceSpec(name=str(d.get("name", "custom")), memory_bytes=int(_number(d, "memory_gb", where) * 1e9),
                            peak_flops_bf16=_number(d, "peak_tflops_bf16", where) * 1e12,
                            hbm_bytes_per_s=_number(d, "hbm_tb_per_s", where) * 1e12)
    elif system is not None:
        device = system.device
    else:
        raise SpecError(f"{source}:device", "is required without a system")

    def link(sec: dict[str, Any], where: str, default: LinkSpec | None) -> LinkSpec:
        latency = _number(sec, "latency_us", where, positive=False) * 1e-6 if "latency_us" in sec else None
        if "preset" in sec:
            if sec["preset"] not in LINKS:
                raise SpecError(f"{where}.preset", f"unknown link {sec['preset']!r}", ", ".join(LINKS))
            base = LINKS[sec["preset"]]
            return LinkSpec(name=base.name, bytes_per_s=base.bytes_per_s,
                            latency_s=base.latency_s if latency is None else latency)
        if "gb_per_s" in sec:
            return LinkSpec(name=where, bytes_per_s=_number(sec, "gb_per_s", where) * 1e9,
                            latency_s=5e-6 if latency is None else latency)
        if "nics_per_node" in sec or "nic_gbit_per_s" in sec:
            if not {"nics_per_node", "nic_gbit_per_s"} <= set(sec):
                raise SpecError(where, "give both nics_per_node and nic_gbit_per_s")
            return nic_link(where, nics_per_node=_integer(sec, "nics_per_node", where),
                            gbit_per_s=_number(sec, "nic_gbit_per_s", where), gpus_per_node=per_node,
                            latency_s=5e-6 if latency is None else latency)
        if default is None:
            raise SpecError(where, "is required without a system (preset, gb_per_s or NICs)")
        return default if latency is None else LinkSpec(name=default.name, bytes_per_s=default.bytes_per_s,
                                                        latency_s=latency)

    intra_link = link(intra, f"{source}:intra_node", system.intra_node_link if system else None)
    inter_link = link(inter, f"{source}:inter_node", system.inter_node_link(per_node) if system else None)
    overhead = _number(c, "step_overhead_s", f"{source}:cluster", positive=False) if "step_overhead_s" in c else (
        system.step_overhead_s if system else 0.0)
    refit = _number(c, "refit_setup_s", f"{source}:cluster", positive=False) if "refit_setup_s" in c else (
        system.refit_setup_s if system else 0.0)
    return ClusterSpec(device=device, num_nodes=num_nodes, gpus_per_node=per_node, intra_node_link=intra_link,
                       inter_node_link=inter_link, step_overhead_s=overhead, refit_setup_s=refit)
