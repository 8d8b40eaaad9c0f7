"""Devices, links, systems and clusters (planner/hardware.py): every refusal word for word at its
boundary, the NIC arithmetic, systems sized into clusters (partial nodes, named machines, the shared
fabric), preset lookups, and the presets against the data-sheet figures they cite. Found by mutation
testing (tests/mutate.py --module planner/hardware.py: 95 of 206 mutants survived, most of them in
refusals no test read and boundaries no test sat on)."""

from __future__ import annotations

import dataclasses

import pytest

from planner.errors import SpecError
from planner.hardware import (
    CPU,
    GB,
    H100,
    H200,
    LOOPBACK,
    NVLINK4,
    SYSTEMS,
    ClusterSpec,
    DeviceSpec,
    LinkSpec,
    SystemSpec,
    cluster_preset,
    device_preset,
    nic_link,
    system_preset,
)


def _refusal(fn, *args, **kw) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(SpecError) as info:
        fn(*args, **kw)
    return str(info.value)


DEV = dict(name="d", memory_bytes=1, peak_flops_bf16=1.0, hbm_bytes_per_s=1.0, host_bytes_per_s=1.0)


@pytest.mark.parametrize("field", ["memory_bytes", "peak_flops_bf16", "hbm_bytes_per_s", "host_bytes_per_s"])
def test_a_device_figure_must_be_positive(field: str) -> None:
    DeviceSpec(**DEV)  # type: ignore[arg-type]  # the smallest positive figures are accepted
    assert _refusal(DeviceSpec, **{**DEV, field: 0}) == f"device.{field}: must be > 0, got 0"
    assert _refusal(DeviceSpec, **{**DEV, field: -2}) == f"device.{field}: must be > 0, got -2"


def test_a_link_needs_bandwidth_and_a_latency_of_at_least_zero() -> None:
    LinkSpec(name="l", bytes_per_s=1e-9, latency_s=0.0)
    text = "link.l: bandwidth must be > 0 and latency >= 0"
    assert _refusal(LinkSpec, name="l", bytes_per_s=0.0, latency_s=1.0) == text
    assert _refusal(LinkSpec, name="l", bytes_per_s=1.0, latency_s=-1e-9) == text


def _cluster(**kw) -> ClusterSpec:  # type: ignore[no-untyped-def]
    args = dict(device=H100, num_nodes=1, gpus_per_node=1, intra_node_link=NVLINK4, inter_node_link=LOOPBACK)
    return ClusterSpec(**{**args, **kw})  # type: ignore[arg-type]


def test_a_cluster_refuses_negative_overheads_and_empty_nodes() -> None:
    c = _cluster(step_overhead_s=0.0, refit_setup_s=0.0, decode_step_overhead_s=0.0)  # zero is allowed
    assert (c.num_gpus, c.all_gpus()) == (1, (0,))
    for field in ("step_overhead_s", "refit_setup_s", "decode_step_overhead_s"):
        assert _refusal(_cluster, **{field: -0.5}) == f"cluster.{field}: must be >= 0, got -0.5"
        assert _refusal(_cluster, **{field: float("nan")}) == f"cluster.{field}: must be >= 0, got nan"
    assert _refusal(_cluster, num_nodes=0) == "cluster.num_nodes: must be >= 1, got 0"
    assert _refusal(_cluster, gpus_per_node=0) == "cluster.gpus_per_node: must be >= 1, got 0"


def test_gpus_nodes_and_links_of_a_cluster() -> None:
    c = _cluster(num_nodes=3, gpus_per_node=4)
    assert c.num_gpus == 12 and c.all_gpus() == tuple(range(12))
    assert [c.node_of(g) for g in (0, 3, 4, 11)] == [0, 0, 1, 2]
    assert c.link_between(4, 7) is NVLINK4 and c.link_between(3, 4) is LOOPBACK


def test_a_nic_link_shares_the_nodes_nics_among_its_gpus() -> None:
    link = nic_link("f", nics_per_node=4, gbit_per_s=200, gpus_per_node=8)
    assert (link.name, link.bytes_per_s, link.latency_s) == ("f", 4 * 200e9 / 8 / 8, 5e-6)
    assert nic_link("f", nics_per_node=1, gbit_per_s=0.5, gpus_per_node=1, latency_s=0.0).bytes_per_s == 0.5e9 / 8
    text = "link.f: nics_per_node and gpus_per_node must be >= 1, gbit_per_s > 0"
    for kw in ({"nics_per_node": 0}, {"gbit_per_s": 0.0}, {"gbit_per_s": -1.0}, {"gpus_per_node": 0}):
        args = {"nics_per_node": 1, "gbit_per_s": 1.0, "gpus_per_node": 1, **kw}
        assert _refusal(nic_link, "f", **args) == text


SYS = SystemSpec(name="s", device=H200, gpus_per_node=8, intra_node_link=NVLINK4, nics_per_node=4,
                 nic_gbit_per_s=400, nic_latency_s=7e-6, step_overhead_s=2.0, refit_setup_s=0.5)


def test_a_system_makes_clusters_of_whole_nodes_and_one_partial_node() -> None:
    c = SYS.cluster(32)
    assert (c.num_nodes, c.gpus_per_node, c.device, c.intra_node_link) == (4, 8, H200, NVLINK4)
    assert (c.step_overhead_s, c.refit_setup_s) == (2.0, 0.5)
    assert (c.inter_node_link.name, c.inter_node_link.bytes_per_s, c.inter_node_link.latency_s) == (
        "s-fabric", 4 * 400e9 / 8 / 8, 7e-6)
    # fewer GPUs than a node: one node of that many, still sharing the node's NICs among all 8 GPUs
    small = SYS.cluster(2)
    assert (small.num_nodes, small.gpus_per_node) == (1, 2)
    assert small.inter_node_link.bytes_per_s == 4 * 400e9 / 8 / 8
    assert SYS.cluster(8).num_nodes == 1
    # another node size: its own share of the NICs
    four = SYS.cluster(8, gpus_per_node=4)
    assert (four.num_nodes, four.gpus_per_node, four.inter_node_link.bytes_per_s) == (2, 4, 4 * 400e9 / 8 / 4)
    assert SYS.inter_node_link().bytes_per_s == 4 * 400e9 / 8 / 8
    assert SYS.inter_node_link(2).bytes_per_s == 4 * 400e9 / 8 / 2
    assert isinstance(SYS.cluster(16).num_nodes, int)


def test_a_system_refuses_sizes_it_cannot_make() -> None:
    assert _refusal(SYS.cluster, 0) == "gpus: must be >= 1, got 0"
    assert SYS.cluster(1).num_gpus == 1  # one GPU is a size
    assert _refusal(SYS.cluster, 12) == "gpus: 12 is not a multiple of 8 GPUs per node"
    assert _refusal(SYS.cluster) == "gpus: system s has no size: give the number of GPUs"
    named = dataclasses.replace(SYS, num_nodes=3)
    assert named.cluster().num_gpus == 24
    assert named.cluster(gpus_per_node=4).num_gpus == 12


def test_preset_lookups_accept_aliases_and_name_what_they_know() -> None:
    assert device_preset("H100") is H100 and device_preset("h200-141gb") is H200 and device_preset("cpu") is CPU
    known = "a100, a100-64gb, cpu, h100, h100-80gb, h200, h200-141gb, mi250x, mi250x-gcd-64gb"
    assert _refusal(device_preset, "tpu") == f"device: unknown preset 'tpu' (allowed: {known})"
    assert system_preset("DGX-H100") is SYSTEMS["dgx-h100"]
    assert _refusal(system_preset, "nope") == f"system: unknown preset 'nope' (allowed: {', '.join(sorted(SYSTEMS))})"
    c = cluster_preset("h200", 16)
    assert (c.num_nodes, c.gpus_per_node, c.device) == (2, 8, H200)
    assert cluster_preset("h200", 16, gpus_per_node=4).num_nodes == 4
    assert cluster_preset("h100", 1).num_gpus == 1
    assert _refusal(cluster_preset, "h100", 0) == "gpus: must be >= 1, got 0"


def test_presets_match_the_data_sheets_they_cite() -> None:
    # NVIDIA H100 SXM5 / H200 SXM data sheets: 989 TFLOP/s dense BF16; 3.35 and 4.8 TB/s; 80 and 141 GB
    assert (H100.memory_bytes, H100.peak_flops_bf16, H100.hbm_bytes_per_s) == (80 * GB, 989e12, 3.35e12)
    assert (H200.memory_bytes, H200.peak_flops_bf16, H200.hbm_bytes_per_s) == (141 * GB, 989e12, 4.8e12)
    assert NVLINK4.bytes_per_s == 900e9 / 2  # 900 GB/s bidirectional per GPU
    # DGX H100: 8 GPUs, 8 ConnectX-7 at 400 Gb/s: 50 GB/s per GPU
    assert SYSTEMS["dgx-h100"].cluster(16).inter_node_link.bytes_per_s == 50e9
    # the paper's testbeds: 1,024 MI250X GCDs, 256 A100-64GB, 64 H200
    assert [SYSTEMS[n].cluster().num_gpus for n in ("paper-mi250x-1024", "paper-a100-256", "paper-h200-64")] == [
        1024, 256, 64]
    assert SYSTEMS["cpu-dev"].cluster(2).inter_node_link.bytes_per_s == 3e9  # gloo loopback, 48 Gb/s


def test_a_devices_matmul_ceiling_scales_every_gemm_term_and_nothing_else() -> None:
    """DeviceSpec.matmul_ceiling (MAMF share relative to H100's): an A100's GEMMs run 86.9 / 80.3 of the
    H100-calibrated rate of its peak, its attention and weight reads do not move; bad ceilings are refused."""
    import dataclasses

    from planner.cost import Links, OpClass, gemm_peak, microbatch_terms
    from planner.hardware import A100_64G, H100, H200, MI250X_GCD, ClusterSpec, cluster_preset
    from planner.models import LLAMA_31_8B
    from planner.plan import Layout
    from planner.workflow import ACTOR_GEN, Workload

    assert A100_64G.matmul_ceiling == pytest.approx(0.869 / 0.803)
    assert MI250X_GCD.matmul_ceiling == pytest.approx(0.767 / 0.803)
    assert H100.matmul_ceiling == H200.matmul_ceiling == 1.0
    cl = cluster_preset("a100", 4)
    flat = ClusterSpec(device=dataclasses.replace(A100_64G, matmul_ceiling=1.0), num_nodes=1, gpus_per_node=4,
                       intra_node_link=cl.intra_node_link, inter_node_link=cl.inter_node_link)
    assert gemm_peak(cl, LLAMA_31_8B, Layout(2, 1), 512) == pytest.approx(
        A100_64G.matmul_ceiling * gemm_peak(flat, LLAMA_31_8B, Layout(2, 1), 512))
    w = Workload(prompts_per_step=8, prompt_tokens=64, response_tokens=32)
    got = microbatch_terms(LLAMA_31_8B, ACTOR_GEN, Layout(1, 1), w, 8, False, cl, Links())
    ref = microbatch_terms(LLAMA_31_8B, ACTOR_GEN, Layout(1, 1), w, 8, False, flat, Links())
    for a, b in zip(got, ref, strict=True):
        scale = A100_64G.matmul_ceiling if a.op_class is OpClass.GEMM else 1.0
        assert a.peak_per_s == pytest.approx(scale * b.peak_per_s) and a.work == b.work
    for bad in (0.0, -1.0):
        with pytest.raises(SpecError, match="matmul_ceiling"):
            dataclasses.replace(H100, matmul_ceiling=bad)
