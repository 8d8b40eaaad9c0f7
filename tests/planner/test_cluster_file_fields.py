"""A user's cluster file (planner/cluster_file.py), field by field: what each key sets on the cluster,
the system defaults it overrides, and every refusal's exact text (the one place the planner reads a
file: it must say what is wrong and where). Found by mutation testing (tests/mutate.py --module
planner/cluster_file.py: 147 of 462 mutants survived tests that matched a word of each message)."""

from __future__ import annotations

from pathlib import Path

import pytest

from planner.cluster_file import cluster_from_dict, load_cluster
from planner.errors import SpecError
from planner.hardware import H100, LINKS, NVLINK3, NVLINK4, SYSTEMS

DGX = {"system": "dgx-h100", "num_nodes": 2}


def _refused(data: dict, field: str, text: str, allowed: str | None = None, source: str = "f.toml") -> None:
    with pytest.raises(SpecError) as err:
        cluster_from_dict(data, source=source)
    assert (err.value.field, str(err.value), err.value.allowed) == (
        field, f"{field}: {text}" + (f" (allowed: {allowed})" if allowed else ""), allowed)


def test_a_system_supplies_every_default() -> None:
    c = cluster_from_dict({"cluster": DGX})
    dgx = SYSTEMS["dgx-h100"]
    assert (c.num_nodes, c.gpus_per_node, c.device, c.intra_node_link) == (2, 8, H100, NVLINK4)
    assert c.inter_node_link == dgx.inter_node_link(8) and c.inter_node_link.bytes_per_s == 50e9
    assert (c.step_overhead_s, c.refit_setup_s) == (dgx.step_overhead_s, dgx.refit_setup_s) != (0.0, 0.0)


def test_each_key_overrides_its_default() -> None:
    c = cluster_from_dict({
        "cluster": {**DGX, "gpus_per_node": 4, "step_overhead_s": 0, "refit_setup_s": 1.5},
        "device": {"name": "mi-x", "memory_gb": 48, "peak_tflops_bf16": 200, "hbm_tb_per_s": 1.5},
        "intra_node": {"preset": "nvlink3", "latency_us": 0},
        "inter_node": {"nics_per_node": 2, "nic_gbit_per_s": 200, "latency_us": 7},
    })
    assert (c.gpus_per_node, c.step_overhead_s, c.refit_setup_s) == (4, 0.0, 1.5)
    assert (c.device.name, c.device.memory_bytes, c.device.peak_flops_bf16, c.device.hbm_bytes_per_s) == (
        "mi-x", 48 * 10**9, 200e12, 1.5e12)
    assert (c.intra_node_link.name, c.intra_node_link.bytes_per_s, c.intra_node_link.latency_s) == (
        "nvlink3", NVLINK3.bytes_per_s, 0.0)
    # 2 NICs x 200 Gb/s shared by the node's 4 GPUs (its own gpus_per_node, not the system's 8)
    assert (c.inter_node_link.bytes_per_s, c.inter_node_link.latency_s) == (2 * 200e9 / 8 / 4, 7e-6)
    assert c.inter_node_link.name == "cluster:inter_node"
    plain = cluster_from_dict({"cluster": {"num_nodes": 1, "gpus_per_node": 2},
                               "device": {"preset": "h100"},
                               "intra_node": {"gb_per_s": 100}, "inter_node": {"gb_per_s": 10, "latency_us": 2}})
    assert (plain.device, plain.intra_node_link.bytes_per_s, plain.intra_node_link.latency_s) == (H100, 100e9, 5e-6)
    assert (plain.inter_node_link.bytes_per_s, plain.inter_node_link.latency_s) == (10e9, 2e-6)
    assert plain.intra_node_link.name == "cluster:intra_node" and plain.device.name == "h100-80gb"
    assert (plain.step_overhead_s, plain.refit_setup_s) == (0.0, 0.0)  # no system: nothing assumed
    custom = cluster_from_dict({"cluster": {**DGX}, "device": {"memory_gb": 1, "peak_tflops_bf16": 1,
                                                                "hbm_tb_per_s": 1}})
    assert custom.device.name == "custom"
    latency_only = cluster_from_dict({"cluster": DGX, "intra_node": {"latency_us": 9}})
    assert (latency_only.intra_node_link.bytes_per_s, latency_only.intra_node_link.latency_s) == (450e9, 9e-6)
    assert latency_only.intra_node_link.name == "nvlink4"


def test_every_refusal_says_what_and_where() -> None:
    _refused({"clusters": {}}, "f.toml", "unknown tables ['clusters']", "cluster, device, intra_node, inter_node")
    _refused({"cluster": 3}, "f.toml:cluster", "must be a table")
    _refused({"cluster": {**DGX, "gpu_count": 8, "nodes": 1}}, "f.toml:cluster", "unknown keys ['gpu_count', 'nodes']",
             "gpus_per_node, name, num_nodes, refit_setup_s, step_overhead_s, system")
    _refused({"cluster": {"system": "dgx-h100"}}, "f.toml:cluster.num_nodes", "is required")
    _refused({"cluster": {"num_nodes": 2}}, "f.toml:cluster.gpus_per_node", "is required without a system")
    _refused({"cluster": {"num_nodes": 2, "gpus_per_node": 4}}, "f.toml:device", "is required without a system")
    for bad in (0, True, 2.5, "2"):
        _refused({"cluster": {**DGX, "num_nodes": bad}}, "f.toml:cluster.num_nodes",
                 f"must be an integer >= 1, got {bad!r}")
    _refused({"cluster": {**DGX, "gpus_per_node": 0}}, "f.toml:cluster.gpus_per_node", "must be an integer >= 1, got 0")
    for bad in (-1, True, "0"):
        _refused({"cluster": {**DGX, "step_overhead_s": bad}}, "f.toml:cluster.step_overhead_s",
                 f"must be a number >= 0, got {bad!r}")
    _refused({"cluster": {**DGX, "refit_setup_s": -0.5}}, "f.toml:cluster.refit_setup_s", "must be a number >= 0, got -0.5")
    _refused({"cluster": DGX, "device": {"memory_gb": 80}}, "f.toml:device",
             "missing ['hbm_tb_per_s', 'peak_tflops_bf16'] (or give a preset)")
    _refused({"cluster": DGX, "device": {"memory_gb": 0, "peak_tflops_bf16": 1, "hbm_tb_per_s": 1}},
             "f.toml:device.memory_gb", "must be a number > 0, got 0")
    _refused({"cluster": DGX, "intra_node": {"preset": "nvlink9"}}, "f.toml:intra_node.preset",
             "unknown link 'nvlink9'", ", ".join(LINKS))
    _refused({"cluster": DGX, "inter_node": {"gb_per_s": 0}}, "f.toml:inter_node.gb_per_s", "must be a number > 0, got 0")
    _refused({"cluster": DGX, "inter_node": {"latency_us": -1}}, "f.toml:inter_node.latency_us",
             "must be a number >= 0, got -1")
    _refused({"cluster": DGX, "inter_node": {"nic_gbit_per_s": 400}}, "f.toml:inter_node",
             "give both nics_per_node and nic_gbit_per_s")
    _refused({"cluster": DGX, "inter_node": {"nics_per_node": 0, "nic_gbit_per_s": 400}},
             "f.toml:inter_node.nics_per_node", "must be an integer >= 1, got 0")
    no_system = {"cluster": {"num_nodes": 1, "gpus_per_node": 2}, "device": {"preset": "h100"}}
    _refused(no_system, "f.toml:intra_node", "is required without a system (preset, gb_per_s or NICs)")
    _refused({**no_system, "intra_node": {"gb_per_s": 100}}, "f.toml:inter_node",
             "is required without a system (preset, gb_per_s or NICs)")


def test_a_file_is_read_and_its_path_named_in_errors(tmp_path: Path) -> None:
    good = tmp_path / "mine.toml"
    good.write_text('[cluster]\nsystem = "dgx-h100"\nnum_nodes = 3\n')
    assert load_cluster(good).num_gpus == 24
    bad = tmp_path / "bad.toml"
    bad.write_text('[cluster]\nsystem = "dgx-h100"\n')
    with pytest.raises(SpecError) as err:
        load_cluster(bad)
    assert str(err.value) == f"{bad}:cluster.num_nodes: is required"
    broken = tmp_path / "broken.toml"
    broken.write_text("[cluster\n")
    with pytest.raises(SpecError) as err:
        load_cluster(broken)
    assert err.value.field == "cluster_file" and str(err.value).startswith(f"cluster_file: {broken}: not valid TOML (")
    assert cluster_from_dict({"cluster": {"system": "dgx-h100", "num_nodes": 1}}).num_gpus == 8  # default source
