"""planner/cluster_file.py, what its other tests left open (mutation testing, tests/mutate.py --module
planner/cluster_file.py: 15 of 462 mutants survived tests/planner): every section's refusal names the
file, a custom device's figures included (they said 'device.' without the file before); a NIC link's
default latency; a system's fabric shared by the node's GPUs as the file gives them."""

from __future__ import annotations

import pytest

from planner.cluster_file import cluster_from_dict
from planner.errors import SpecError

DGX = {"system": "dgx-h100", "num_nodes": 2}
DEVICE = {"memory_gb": 40, "peak_tflops_bf16": 100, "hbm_tb_per_s": 2}


def _field(data: dict) -> str:
    with pytest.raises(SpecError) as err:
        cluster_from_dict(data, source="mine.toml")
    return err.value.field


def test_every_section_that_is_not_a_table_is_named_with_the_file() -> None:
    for section in ("device", "intra_node", "inter_node"):
        assert _field({"cluster": DGX, section: "h100"}) == f"mine.toml:{section}"


def test_a_custom_devices_bad_figure_is_named_with_the_file() -> None:
    for key in ("memory_gb", "peak_tflops_bf16", "hbm_tb_per_s"):
        assert _field({"cluster": DGX, "device": {**DEVICE, key: -1}}) == f"mine.toml:device.{key}"


def test_a_bad_nic_speed_is_named_with_the_file() -> None:
    assert _field({"cluster": DGX, "inter_node": {"nics_per_node": 2, "nic_gbit_per_s": 0}}) == (
        "mine.toml:inter_node.nic_gbit_per_s")


def test_a_nic_link_without_a_latency_takes_five_microseconds() -> None:
    c = cluster_from_dict({"cluster": DGX, "inter_node": {"nics_per_node": 4, "nic_gbit_per_s": 100}})
    assert (c.inter_node_link.bytes_per_s, c.inter_node_link.latency_s) == (4 * 100e9 / 8 / 8, 5e-6)


def test_a_systems_fabric_is_shared_by_the_gpus_per_node_the_file_gives() -> None:
    # dgx-h100: 8 NICs of 400 Gbit/s a node; a node of 4 GPUs gives each GPU a quarter, not an eighth
    c = cluster_from_dict({"cluster": {**DGX, "gpus_per_node": 4}})
    assert c.inter_node_link.bytes_per_s == 8 * 400e9 / 8 / 4
