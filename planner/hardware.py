"""Devices, links and clusters, with presets from vendor data sheets.

Bandwidths are per GPU and per direction, in bytes/s; FLOP/s are dense (no sparsity) bf16 unless
named otherwise. A GPU is a global integer id; its node is ``gpu // gpus_per_node``.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.errors import SpecError, unknown_preset

GiB = 1024**3
GB = 1000**3


# GEMM efficiency falls with the per-GPU shape: NVIDIA's "Matrix Multiplication Background" guide
# (docs.nvidia.com/deeplearning/performance) shows tile/wave quantisation and a memory-bound regime
# below a few hundred rows, and a slower climb with the width. A GEMM of M tokens and N output
# columns per GPU reaches peak / ((1 + M0/M) (1 + N0/N)): M = 256 tokens -> 0.8, 4,096 -> 0.98; a
# Llama-8B layer's width per GPU 4,096/tp -> 0.97 at tp = 1, 0.89 at tp = 8. Affine in the micro-batch
# size, so the option tables keep their lines (planner.cost.gemm_peak). Per device: these on GPUs, none
# on the CPU worker.
GEMM_HALF_TOKENS = 64.0
GEMM_HALF_WIDTH = 128.0


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceSpec:
    name: str
    memory_bytes: int
    peak_flops_bf16: float
    hbm_bytes_per_s: float
    host_bytes_per_s: float = 25e9  # host <-> device copies, per direction (PCIe 4 x16 by default)
    # GEMM shape efficiency (planner.cost.gemm_peak): rows (tokens) and columns per GPU at which a GEMM
    # runs at half its peak; tensor-core tiles and waves make small GEMMs slow on GPUs (see planner.cost)
    gemm_half_tokens: float = GEMM_HALF_TOKENS
    gemm_half_width: float = GEMM_HALF_WIDTH
    # share of the data-sheet peak the device's best matmul reaches, relative to an H100 SXM's (the GEMM
    # class's efficiency and its prior are H100 figures): see MATMUL_CEILING_NOTE
    matmul_ceiling: float = 1.0

    def __post_init__(self) -> None:
        for field in ("memory_bytes", "peak_flops_bf16", "hbm_bytes_per_s", "host_bytes_per_s", "matmul_ceiling"):
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


# Maximum achievable matmul FLOPS (MAMF: the best bf16 matmul over a sweep of shapes, mean of 100 runs;
# stas00/ml-engineering compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS comparison
# table"): A100 SXM 271.2 of 312 TFLOP/s (86.9%), H100 SXM 794.5 of 989 (80.3%), MI250X 147.0 of 191.5
# per GCD (76.7%). One GEMM efficiency per class, learned on H100s, prices an A100 8% slow without it
# (torchtitan's A100 rows, bench/fidelity.py). DeviceSpec.matmul_ceiling is the share relative to
# H100's; H200 is H100's die at the same clocks (1.0); the CPU worker has no such figure (1.0).
MATMUL_CEILING_NOTE = "MAMF share / H100 SXM's 80.3%"
A100_MATMUL_CEILING = 0.869 / 0.803
MI250X_MATMUL_CEILING = 0.767 / 0.803

# --- device presets -------------------------------------------------------------------------------
# NVIDIA H100 SXM5 80GB data sheet: 989 TFLOP/s dense BF16 (1,979 with sparsity), 3.35 TB/s HBM3.
# Host link: PCIe Gen5 x16 (H100/H200 SXM) is 64 GB/s per direction; Gen4 x16 (A100) 32 GB/s; Frontier's
# CPU-GCD Infinity Fabric 36 GB/s per direction (OLCF user guide).
H100 = DeviceSpec(name="h100-80gb", memory_bytes=80 * GB, peak_flops_bf16=989e12, hbm_bytes_per_s=3.35e12,
                  host_bytes_per_s=64e9)
# NVIDIA H200 SXM 141GB data sheet: 989 TFLOP/s dense BF16, 4.8 TB/s HBM3e.
H200 = DeviceSpec(name="h200-141gb", memory_bytes=141 * GB, peak_flops_bf16=989e12, hbm_bytes_per_s=4.8e12,
                  host_bytes_per_s=64e9)
# NVIDIA A100 SXM data sheet: 312 TFLOP/s dense BF16, 2.039 TB/s HBM2e (80GB part); the paper's
# cluster runs a 64 GB variant, so memory is 64 GB with the SXM compute and bandwidth figures.
A100_64G = DeviceSpec(name="a100-64gb", memory_bytes=64 * GB, peak_flops_bf16=312e12, hbm_bytes_per_s=2.039e12,
                      host_bytes_per_s=32e9, matmul_ceiling=A100_MATMUL_CEILING)
# AMD Instinct MI250X data sheet: 383 TFLOP/s peak BF16, 3.2 TB/s, 128 GB HBM2e for the whole
# package of two GCDs; one GCD (what the runtime sees as a GPU) has half of each.
MI250X_GCD = DeviceSpec(
    name="mi250x-gcd-64gb", memory_bytes=64 * GB, peak_flops_bf16=191.5e12, hbm_bytes_per_s=1.6e12,
    host_bytes_per_s=36e9, matmul_ceiling=MI250X_MATMUL_CEILING,
)
# A CPU worker slot on the project's development machine (2 cores of an AMD EPYC Zen 5, AVX-512):
# peak fp32 (the engine's dtype on CPU) of one core from the core's design: two 512-bit FMA pipes,
# 2 x 16 x 2 = 64 FLOP/cycle at the 2.6 GHz base clock (lscpu BogoMIPS 5,192) = 166 GFLOP/s; the old
# figure, 50 GFLOP/s implied by the tiny GPT's AdamW step, left the calibrated GEMM efficiency pinned at
# its 1.5 bound. Memory: memcpy 15 GB/s (shared/notes/torch-cpu.md).
# no tile/wave quantisation on a CPU worker: no GEMM shape factor (the calibration learns its one figure)
CPU = DeviceSpec(name="cpu", memory_bytes=8 * GiB, peak_flops_bf16=1.66e11, hbm_bytes_per_s=15e9, host_bytes_per_s=15e9,
                 gemm_half_tokens=0.0, gemm_half_width=0.0)

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
    # fixed seconds per RL step outside the model-stages (driver scheduling, rollout/experience transfer,
    # rule-based rewards, logging): op class STEP_OVERHEAD; 0 where nothing is known (learned from steps)
    step_overhead_s: float = 0.0
    # set-up of each step's train -> generation weight refit (IPC handles, conversion, engine reload)
    refit_setup_s: float = 0.0
    # the generation engine's serial CPU time per decode step, at any batch (GPU_DECODE_STEP_OVERHEAD_S)
    decode_step_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        for field in ("step_overhead_s", "refit_setup_s", "decode_step_overhead_s"):
            if not (getattr(self, field) >= 0):
                raise SpecError(f"cluster.{field}", f"must be >= 0, got {getattr(self, field)}")
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


def nic_link(name: str, *, nics_per_node: int, gbit_per_s: float, gpus_per_node: int,
             latency_s: float = 5e-6) -> LinkSpec:
    """The inter-node link one GPU sees: the node's NICs shared by its GPUs, per direction
    (NICs per node x link speed / GPUs per node)."""
    if nics_per_node < 1 or gbit_per_s <= 0 or gpus_per_node < 1:
        raise SpecError(f"link.{name}", "nics_per_node and gpus_per_node must be >= 1, gbit_per_s > 0")
    return LinkSpec(name=name, bytes_per_s=nics_per_node * gbit_per_s * 1e9 / 8 / gpus_per_node,
                    latency_s=latency_s)


@dataclass(frozen=True, kw_only=True, slots=True)
class SystemSpec:
    """A node design: its device, GPUs per node, the intra-node link and the NICs of the fabric."""

    name: str
    device: DeviceSpec
    gpus_per_node: int
    intra_node_link: LinkSpec
    nics_per_node: int
    nic_gbit_per_s: float
    nic_latency_s: float = 5e-6
    num_nodes: int | None = None  # a named machine (the paper's testbeds) has a size
    step_overhead_s: float = 0.0
    refit_setup_s: float = 0.0

    def inter_node_link(self, gpus_per_node: int | None = None) -> LinkSpec:
        return nic_link(f"{self.name}-fabric", nics_per_node=self.nics_per_node, gbit_per_s=self.nic_gbit_per_s,
                        gpus_per_node=gpus_per_node or self.gpus_per_node, latency_s=self.nic_latency_s)

    def cluster(self, num_gpus: int | None = None, gpus_per_node: int | None = None) -> ClusterSpec:
        per_node = gpus_per_node or self.gpus_per_node
        if num_gpus is None:
            if self.num_nodes is None:
                raise SpecError("gpus", f"system {self.name} has no size: give the number of GPUs")
            num_gpus = self.num_nodes * per_node
        if num_gpus < 1:
            raise SpecError("gpus", f"must be >= 1, got {num_gpus}")
        # the fabric is shared by the GPUs a node has, even when a job uses fewer of them
        inter = self.inter_node_link(per_node)
        if num_gpus < per_node:
            per_node = num_gpus
        if num_gpus % per_node:
            raise SpecError("gpus", f"{num_gpus} is not a multiple of {per_node} GPUs per node")
        return ClusterSpec(device=self.device, num_nodes=num_gpus // per_node, gpus_per_node=per_node,
                           intra_node_link=self.intra_node_link, inter_node_link=inter,
                           step_overhead_s=self.step_overhead_s, refit_setup_s=self.refit_setup_s)


# Fixed per-step overhead of an RL framework on GPU systems (data processing, batching for log-probs
# and training, buffer sampling): NeMo-RL PR 1052's timing output for Llama-3.1-8B on H100 lists
# buffer_sampling 1.38 + logprob_inference_prep 1.34 + training_prep 1.06 + data_processing 0.23 s.
GPU_STEP_OVERHEAD_S = 4.0
# Refit set-up per step, Llama-3.1-8B on one H100 node: 0.13 s (NeMo-RL PR 1052's timing output,
# weight_sync) up to ~1 s: NeMo-RL issue 959's 5-8 s colocated "Refit (s)" (v0.3 Megatron) is mostly
# its optimizer-state offload into pageable host memory, ~10 GB per GPU at ~1.8 GB/s (NeMo-RL issue
# 3976; bench/fidelity.py prices it), which the planner's plans never run; what is left of it (vLLM
# waking its weights, IPC handles, format conversion) is ~1 s
# (transitions.cost.DEFAULT_COMMUNICATOR_SETUP_S is the DAG's per-primitive analogue).
GPU_REFIT_SETUP_S = 1.0

# Serial CPU time per decode step of a generation engine that does not overlap its scheduling with the
# GPU (ClusterSpec.decode_step_overhead_s), whatever the batch: scheduling, input preparation and
# output bookkeeping. vLLM issue 10634 (V1 engine, before async scheduling; vLLM PR 19970 added that in
# June 2025, experimental and off by default) measured a 5-6 ms gap between two decode steps of
# Llama-2-7B at batch 256; less the per-sequence part (planner.cost.DECODE_SEQUENCE_OVERHEAD_S x 256 =
# 3.84 ms, vLLM RFC 6854), 5.5 - 3.84 = 1.66 ms per step. The RL frameworks' pinned engines run that
# way (NeMo-RL v0.3.0 / v0.4.0: vllm 0.9.0 / 0.10.0, no async scheduling in their configs: bench/
# fidelity_rl.py prices their steps with it). An engine that overlaps it has none (a serving sweep on
# vLLM 0.21: 6.48 ms per token at batch 1, where 16 GB of weights take 4.8 ms at the full 3.35 TB/s,
# leaves no room for 1.66 ms in series). The presets carry 0: which engine a job runs is the job's, and
# the simulator's ground truth (nereusd/sim/truth.py) runs 0.5 ms per iteration, which a 1.66 ms prior
# could not be calibrated down to (efficiencies stay <= 1.5).
GPU_DECODE_STEP_OVERHEAD_S = 1.66e-3

# Node designs from vendor and site documentation:
# - NVIDIA DGX H100/H200 user guide: 8 GPUs, NVLink 4, 8x ConnectX-7 400 Gb/s (compute fabric) -> 50 GB/s per GPU.
# - AMD/HPE Frontier node (OLCF user guide): 4 MI250X = 8 GCDs, 4 Slingshot-11 200 Gb/s NICs -> 12.5 GB/s per GCD.
# - A100 4-GPU HGX nodes: one HDR 200 Gb/s port per GPU -> 25 GB/s (the project's usual A100 system).
# - CINECA Leonardo Booster (user guide): 4 A100-64GB per node, 2x dual-port HDR100 = 4 x 100 Gb/s -> 12.5 GB/s.
SYSTEMS: dict[str, SystemSpec] = {sys_.name: sys_ for sys_ in (
    SystemSpec(name="dgx-h100", device=H100, gpus_per_node=8, intra_node_link=NVLINK4, nics_per_node=8,
               nic_gbit_per_s=400, step_overhead_s=GPU_STEP_OVERHEAD_S,
               refit_setup_s=GPU_REFIT_SETUP_S),
    SystemSpec(name="dgx-h200", device=H200, gpus_per_node=8, intra_node_link=NVLINK4, nics_per_node=8,
               nic_gbit_per_s=400, step_overhead_s=GPU_STEP_OVERHEAD_S,
               refit_setup_s=GPU_REFIT_SETUP_S),
    SystemSpec(name="hgx-a100-64gb", device=A100_64G, gpus_per_node=4, intra_node_link=NVLINK3, nics_per_node=4,
               nic_gbit_per_s=200, step_overhead_s=GPU_STEP_OVERHEAD_S,
               refit_setup_s=GPU_REFIT_SETUP_S),
    SystemSpec(name="frontier-mi250x", device=MI250X_GCD, gpus_per_node=8, intra_node_link=INFINITY_FABRIC,
               nics_per_node=4, nic_gbit_per_s=200, nic_latency_s=6e-6, step_overhead_s=GPU_STEP_OVERHEAD_S,
               refit_setup_s=GPU_REFIT_SETUP_S),
    SystemSpec(name="cpu-dev", device=CPU, gpus_per_node=2, intra_node_link=LOOPBACK, nics_per_node=1,
               nic_gbit_per_s=48, nic_latency_s=50e-6),  # gloo loopback, 3 GB/s
    # the paper's three testbeds (PAPER.md): 1,024 MI250X GCDs, 256 A100-64GB, 64 H200-141GB
    SystemSpec(name="paper-mi250x-1024", device=MI250X_GCD, gpus_per_node=8, intra_node_link=INFINITY_FABRIC,
               nics_per_node=4, nic_gbit_per_s=200, nic_latency_s=6e-6, num_nodes=128,
               step_overhead_s=GPU_STEP_OVERHEAD_S,
               refit_setup_s=GPU_REFIT_SETUP_S),
    SystemSpec(name="paper-a100-256", device=A100_64G, gpus_per_node=4, intra_node_link=NVLINK3, nics_per_node=4,
               nic_gbit_per_s=100, num_nodes=64, step_overhead_s=GPU_STEP_OVERHEAD_S,
               refit_setup_s=GPU_REFIT_SETUP_S),
    SystemSpec(name="paper-h200-64", device=H200, gpus_per_node=8, intra_node_link=NVLINK4, nics_per_node=8,
               nic_gbit_per_s=400, num_nodes=8, step_overhead_s=GPU_STEP_OVERHEAD_S,
               refit_setup_s=GPU_REFIT_SETUP_S),
)}
# device preset -> the usual system built from it
_SYSTEM_OF_DEVICE = {"h100-80gb": "dgx-h100", "h200-141gb": "dgx-h200", "a100-64gb": "hgx-a100-64gb",
                     "mi250x-gcd-64gb": "frontier-mi250x", "cpu": "cpu-dev"}


def device_preset(name: str) -> DeviceSpec:
    key = DEVICE_ALIASES.get(name.lower(), name.lower())
    if key not in DEVICES:
        raise unknown_preset("device", name, list(DEVICES) + list(DEVICE_ALIASES))
    return DEVICES[key]


def system_preset(name: str) -> SystemSpec:
    if name.lower() not in SYSTEMS:
        raise unknown_preset("system", name, list(SYSTEMS))
    return SYSTEMS[name.lower()]


def cluster_preset(device: str, num_gpus: int, gpus_per_node: int | None = None) -> ClusterSpec:
    """The usual system built from ``device``: e.g. ``cluster_preset("h200", 1024)`` is 128 DGX nodes."""
    dev = device_preset(device)
    system = SYSTEMS[_SYSTEM_OF_DEVICE[dev.name]]
    if num_gpus < 1:
        raise SpecError("gpus", f"must be >= 1, got {num_gpus}")
    return system.cluster(num_gpus, gpus_per_node)
