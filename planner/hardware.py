"""Devices, links and clusters, with presets from vendor data sheets.

Bandwidths are per GPU and per direction, in bytes/s; FLOP/s are dense (no sparsity) bf16 unless
named otherwise. A GPU is a global integer id; its node is ``gpu // gpus_per_node``.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.errors import SpecError, unknown_preset

GiB = 1024**3
GB = 1000**3


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceSpec:
    name: str
    memory_bytes: int
    peak_flops_bf16: float
    hbm_bytes_per_s: float

    def __post_init__(self) -> None:
        for field in ("memory_bytes", "peak_flops_bf16", "hbm_bytes_per_s"):
            if getattr(self, field) <= 0:
                raise SpecError(f"device.{field}", f"must be > 0, got {getattr(self, field)}")


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkSpec:
    name: str
    bytes_per_s: float  # per GPU, per direction
    latency_s: float

    def __post_init__(self) -> None:
        if self.bytes_per_s <= 0 or self.latency_s < 0:
            raise SpecError(f"link.{self.name}", "bandwidth must be > 0 and latency >= 0")


# --- device presets -------------------------------------------------------------------------------
# NVIDIA H100 SXM5 80GB data sheet: 989 TFLOP/s dense BF16 (1,979 with sparsity), 3.35 TB/s HBM3.
H100 = DeviceSpec(name="h100-80gb", memory_bytes=80 * GB, peak_flops_bf16=989e12, hbm_bytes_per_s=3.35e12)
# NVIDIA H200 SXM 141GB data sheet: 989 TFLOP/s dense BF16, 4.8 TB/s HBM3e.
H200 = DeviceSpec(name="h200-141gb", memory_bytes=141 * GB, peak_flops_bf16=989e12, hbm_bytes_per_s=4.8e12)
# NVIDIA A100 SXM data sheet: 312 TFLOP/s dense BF16, 2.039 TB/s HBM2e (80GB part); the paper's
# cluster runs a 64 GB variant, so memory is 64 GB with the SXM compute and bandwidth figures.
A100_64G = DeviceSpec(name="a100-64gb", memory_bytes=64 * GB, peak_flops_bf16=312e12, hbm_bytes_per_s=2.039e12)
# AMD Instinct MI250X data sheet: 383 TFLOP/s peak BF16, 3.2 TB/s, 128 GB HBM2e for the whole
# package of two GCDs; one GCD (what the runtime sees as a GPU) has half of each.
MI250X_GCD = DeviceSpec(
    name="mi250x-gcd-64gb", memory_bytes=64 * GB, peak_flops_bf16=191.5e12, hbm_bytes_per_s=1.6e12
)
# A CPU worker slot on the project's development machine (2 cores): measured in
# shared/notes/torch-cpu.md (memcpy 15 GB/s; the tiny GPT's AdamW step implies ~50 GFLOP/s fp32).
CPU = DeviceSpec(name="cpu", memory_bytes=8 * GiB, peak_flops_bf16=5e10, hbm_bytes_per_s=15e9)

DEVICES: dict[str, DeviceSpec] = {d.name: d for d in (H100, H200, A100_64G, MI250X_GCD, CPU)}
DEVICE_ALIASES = {"h100": "h100-80gb", "h200": "h200-141gb", "a100": "a100-64gb", "mi250x": "mi250x-gcd-64gb"}

# --- link presets ---------------------------------------------------------------------------------
# NVLink 4 (H100/H200 SXM): 900 GB/s bidirectional per GPU -> 450 GB/s per direction.
NVLINK4 = LinkSpec(name="nvlink4", bytes_per_s=450e9, latency_s=3e-6)
# NVLink 3 (A100 SXM): 600 GB/s bidirectional -> 300 GB/s per direction.
NVLINK3 = LinkSpec(name="nvlink3", bytes_per_s=300e9, latency_s=3e-6)
# AMD Infinity Fabric between MI250X GCDs (Frontier node): 50-200 GB/s per direction depending on
# the pair; 100 GB/s is the typical figure used here.
INFINITY_FABRIC = LinkSpec(name="infinity-fabric", bytes_per_s=100e9, latency_s=4e-6)
# InfiniBand HDR: 200 Gb/s per port = 25 GB/s; NDR: 400 Gb/s = 50 GB/s; one port per GPU.
IB_HDR = LinkSpec(name="ib-hdr", bytes_per_s=25e9, latency_s=5e-6)
IB_NDR = LinkSpec(name="ib-ndr", bytes_per_s=50e9, latency_s=5e-6)
# HPE Slingshot-11: 200 Gb/s per NIC = 25 GB/s (Frontier: one NIC per MI250X, i.e. per 2 GCDs).
SLINGSHOT = LinkSpec(name="slingshot-11", bytes_per_s=12.5e9, latency_s=6e-6)
# gloo over loopback on the development machine: ~3 GB/s for large buffers (notes/torch-cpu.md).
LOOPBACK = LinkSpec(name="loopback-gloo", bytes_per_s=3e9, latency_s=50e-6)

LINKS: dict[str, LinkSpec] = {
    link.name: link for link in (NVLINK4, NVLINK3, INFINITY_FABRIC, IB_HDR, IB_NDR, SLINGSHOT, LOOPBACK)
}


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterSpec:
    """A homogeneous cluster: ``num_nodes`` nodes of ``gpus_per_node`` identical devices."""

    device: DeviceSpec
    num_nodes: int
    gpus_per_node: int
    intra_node_link: LinkSpec
    inter_node_link: LinkSpec

    def __post_init__(self) -> None:
        if self.num_nodes < 1:
            raise SpecError("cluster.num_nodes", f"must be >= 1, got {self.num_nodes}")
        if self.gpus_per_node < 1:
            raise SpecError("cluster.gpus_per_node", f"must be >= 1, got {self.gpus_per_node}")

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node

    def node_of(self, gpu: int) -> int:
        return gpu // self.gpus_per_node

    def link_between(self, a: int, b: int) -> LinkSpec:
        return self.intra_node_link if self.node_of(a) == self.node_of(b) else self.inter_node_link

    def all_gpus(self) -> tuple[int, ...]:
        return tuple(range(self.num_gpus))


# device preset -> (gpus per node, intra-node link, inter-node link) of the usual systems
_SYSTEMS: dict[str, tuple[int, LinkSpec, LinkSpec]] = {
    "h100-80gb": (8, NVLINK4, IB_NDR),
    "h200-141gb": (8, NVLINK4, IB_NDR),
    "a100-64gb": (4, NVLINK3, IB_HDR),
    "mi250x-gcd-64gb": (8, INFINITY_FABRIC, SLINGSHOT),
    "cpu": (2, LOOPBACK, LOOPBACK),
}


def device_preset(name: str) -> DeviceSpec:
    key = DEVICE_ALIASES.get(name.lower(), name.lower())
    if key not in DEVICES:
        raise unknown_preset("device", name, list(DEVICES) + list(DEVICE_ALIASES))
    return DEVICES[key]


def cluster_preset(device: str, num_gpus: int, gpus_per_node: int | None = None) -> ClusterSpec:
    """The usual system built from ``device``: e.g. ``cluster_preset("h200", 1024)`` is 128 DGX nodes."""
    dev = device_preset(device)
    per_node, intra, inter = _SYSTEMS[dev.name]
    if gpus_per_node is not None:
        per_node = gpus_per_node
    if num_gpus < 1:
        raise SpecError("gpus", f"must be >= 1, got {num_gpus}")
    if num_gpus < per_node:
        per_node = num_gpus
    if num_gpus % per_node:
        raise SpecError("gpus", f"{num_gpus} is not a multiple of {per_node} GPUs per node")
    return ClusterSpec(
        device=dev,
        num_nodes=num_gpus // per_node,
        gpus_per_node=per_node,
        intra_node_link=intra,
        inter_node_link=inter,
    )
