"""Cluster presets per real fabric, the paper's testbeds, and a user's cluster from TOML."""

from __future__ import annotations

from pathlib import Path

import pytest

from planner.cluster_file import cluster_from_dict, load_cluster
from planner.hardware import SYSTEMS, cluster_preset, nic_link, system_preset

ETC = Path(__file__).resolve().parents[2] / "etc" / "clusters"


def test_inter_node_bandwidth_is_nics_times_speed_over_gpus() -> None:
    # DGX H100: 8 x 400 Gb/s ConnectX-7 for 8 GPUs -> 50 GB/s per GPU; Frontier: 4 x 200 Gb/s for 8 GCDs
    assert system_preset("dgx-h100").inter_node_link().bytes_per_s == 50e9
    assert system_preset("frontier-mi250x").inter_node_link().bytes_per_s == 12.5e9
    assert nic_link("x", nics_per_node=2, gbit_per_s=100, gpus_per_node=4).bytes_per_s == 6.25e9
    with pytest.raises(ValueError, match="nics_per_node"):
        nic_link("x", nics_per_node=0, gbit_per_s=100, gpus_per_node=4)


def test_the_papers_three_testbeds() -> None:
    sizes = {name: system_preset(name).cluster() for name in ("paper-mi250x-1024", "paper-a100-256", "paper-h200-64")}
    assert {k: (c.num_gpus, c.device.memory_bytes // 10**9) for k, c in sizes.items()} == {
        "paper-mi250x-1024": (1024, 64), "paper-a100-256": (256, 64), "paper-h200-64": (64, 141)}
    assert sizes["paper-a100-256"].inter_node_link.bytes_per_s == 12.5e9  # 4 x HDR100 per 4-GPU node
    # framework fixed costs of GPU systems (NeMo-RL's published figures); none on the CPU system
    assert all(c.step_overhead_s == 4.0 and c.refit_setup_s == 1.0 for c in sizes.values())
    assert cluster_preset("cpu", 2).refit_setup_s == 0.0


def test_presets_keep_the_fabric_of_a_full_node_for_small_jobs() -> None:
    small = cluster_preset("h200", 4)
    assert small.gpus_per_node == 4 and small.inter_node_link.bytes_per_s == 50e9
    assert cluster_preset("h200", 1024).num_nodes == 128
    with pytest.raises(ValueError, match="multiple"):
        cluster_preset("h200", 12)
    assert all(s.cluster(s.gpus_per_node).num_nodes == 1 for s in SYSTEMS.values())


def test_every_example_cluster_file_loads() -> None:
    files = sorted(ETC.glob("*.toml"))
    assert len(files) >= 3
    clusters = {f.stem: load_cluster(f) for f in files}
    assert clusters["dgx-h100-16-nodes"].num_gpus == 128
    assert clusters["dgx-h100-16-nodes"].step_overhead_s == 2.0
    assert clusters["dgx-h100-16-nodes"].refit_setup_s == 0.5
    assert clusters["leonardo-booster-a100-64gb"].inter_node_link.bytes_per_s == 12.5e9
    assert clusters["custom-device"].device.memory_bytes == 48 * 10**9


@pytest.mark.parametrize("data,match", [
    ({"cluster": {"num_nodes": 2}}, "gpus_per_node"),
    ({"cluster": {"num_nodes": 2, "gpus_per_node": 4}}, "device"),
    ({"cluster": {"system": "dgx-h100", "num_nodes": 0}}, "num_nodes"),
    ({"cluster": {"system": "dgx-h100", "num_nodes": 1, "gpu_count": 8}}, "unknown keys"),
    ({"cluster": {"system": "dgx-h100", "num_nodes": 1}, "inter_node": {"nics_per_node": 8}}, "both"),
    ({"cluster": {"system": "dgx-h100", "num_nodes": 1}, "intra_node": {"preset": "nvlink9"}}, "unknown link"),
    ({"cluster": {"system": "nope", "num_nodes": 1}}, "system"),
    ({"cluster": {"system": "dgx-h100", "num_nodes": 1}, "device": {"memory_gb": 80}}, "missing"),
    ({"cluster": {"system": "dgx-h100", "num_nodes": 1, "step_overhead_s": -1}}, "step_overhead_s"),
    ({"clusters": {}}, "unknown tables"),
])
def test_bad_cluster_files_say_what_is_wrong(data: dict, match: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=match):
        cluster_from_dict(data)


def test_invalid_toml_is_a_spec_error(tmp_path: Path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text("[cluster\nnum_nodes = 1")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_cluster(f)
