"""Operation classes of the cost model, their priors (each from a public measurement) and the
immutable efficiency table the calibration learns (planner.calibration); planner.cost re-exports them."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from enum import Enum
from types import MappingProxyType

from planner.errors import SpecError


class OpClass(str, Enum):
    GEMM = "gemm"  # FLOPs at the device's peak (the attainable peak of the GEMM's per-GPU shape)
    ATTENTION_PREFILL = "attention_prefill"  # FLOPs (flash attention over whole sequences)
    ATTENTION_DECODE = "attention_decode"  # KV-cache bytes read at HBM bandwidth
    MEMORY_BOUND = "memory_bound"  # weight bytes read per decode step, optimizer update, at HBM bandwidth
    TP_ALLREDUCE_INTRA = "tp_allreduce_intra"  # bytes per GPU over the intra-node link
    TP_ALLREDUCE_INTER = "tp_allreduce_inter"
    PP_SEND_INTRA = "pp_send_intra"
    PP_SEND_INTER = "pp_send_inter"
    DP_ALLREDUCE_INTRA = "dp_allreduce_intra"
    DP_ALLREDUCE_INTER = "dp_allreduce_inter"
    # operator launches at the device's launch rate (eager host dispatch), by the path that issues them:
    LAUNCH_FORWARD = "launch_forward"  # forward passes (inference, training's forward, recompute)
    LAUNCH_DECODE = "launch_decode"  # decode steps: a one-token forward plus sampling, from a Python loop
    LAUNCH_BACKWARD = "launch_backward"  # autograd's backward (its C++ engine) and the optimizer step
    # host work of distributed calls (DTensor dispatch, gloo collectives, pipeline schedule steps), in
    # plain-launch units (planner.eager): learned from TP/PP plans, the prior elsewhere
    LAUNCH_DISTRIBUTED = "launch_distributed"
    WEIGHT_SYNC = "weight_sync"  # train -> generation weight refit, bytes per generation GPU over its link
    STEP_OVERHEAD = "step_overhead"  # fixed seconds per RL step (ClusterSpec.step_overhead_s) at "peak" 1/s
    DECODE_OVERHEAD = "decode_overhead"  # engine CPU time per live sequence per decode step (seconds)
    HOST_COPY = "host_copy"  # bytes between host and device (sleep mode: weights out and back), per GPU


# classes whose work is a time in seconds (peak 1/s), not FLOPs or bytes
TIME_CLASSES = frozenset({OpClass.STEP_OVERHEAD, OpClass.DECODE_OVERHEAD})


# Priors: every one set from a public measurement (below the best tuned figures, so an uncalibrated
# plan is not optimistic); a class never measured keeps its prior.
PRIOR_EFFICIENCY: Mapping[OpClass, float] = MappingProxyType({
    # Megatron-LM README: GPT models reach 41-48% MFU on H100 at scale (weak-scaling table, 2023); the
    # shape factor below already charges small per-GPU GEMMs, so the class itself sits at 0.45.
    OpClass.GEMM: 0.45,
    # FlashAttention-2 (Dao 2023): 50-73% of A100 peak forward, lower backward; 0.35 of dense peak.
    OpClass.ATTENTION_PREFILL: 0.35,
    # vLLM decode: ~50-70% of HBM bandwidth at realistic batch (PagedAttention paper, Kwon et al. 2023).
    OpClass.ATTENTION_DECODE: 0.5,
    # Weight-read bound decode: Llama-3.1-8B bf16 on one H100 runs ~6.5-7 ms/token at batch 1 in
    # vLLM's latency benchmark, 16 GB / 3.35 TB/s = 4.8 ms: ~0.7; 0.6 is the conservative side.
    OpClass.MEMORY_BOUND: 0.6,
    # nccl-tests all_reduce_perf on DGX H100: ~360-480 GB/s bus bandwidth of 450 GB/s NVLink per
    # direction at large messages (0.8+); 0.6 leaves room for mid-sized (per-layer) buffers.
    OpClass.TP_ALLREDUCE_INTRA: 0.6,
    OpClass.TP_ALLREDUCE_INTER: 0.5,  # nccl-tests over 8x NDR400: ~40 GB/s of 50 per GPU at large sizes
    OpClass.PP_SEND_INTRA: 0.6,
    OpClass.PP_SEND_INTER: 0.5,
    OpClass.DP_ALLREDUCE_INTRA: 0.6,
    OpClass.DP_ALLREDUCE_INTER: 0.5,
    OpClass.LAUNCH_FORWARD: 0.2,
    OpClass.LAUNCH_DECODE: 0.2,
    OpClass.LAUNCH_BACKWARD: 0.2,
    OpClass.LAUNCH_DISTRIBUTED: 0.2,
    # verl issue tracker (weight sync): NCCL broadcast from one sender ~25 GB/s, ~90 GB/s from all senders
    # on H100 NVLink (450 GB/s): 0.2 of the link.
    OpClass.WEIGHT_SYNC: 0.2,
    OpClass.STEP_OVERHEAD: 1.0,  # a time, not a rate: the configured overhead is taken as it is
    OpClass.DECODE_OVERHEAD: 1.0,  # a time: DECODE_SEQUENCE_OVERHEAD_S per sequence per step
    # Sleep mode copies into pinned host memory: vLLM's CuMemAllocator.sleep backs each allocation up
    # into torch.empty(..., pin_memory=True) with one cudaMemcpy (vllm/device_allocator/cumem.py).
    # Pinned copies on H100 PCIe 5 x16 (64 GB/s): 7.5 GB GPU -> pinned in 0.157 s = 48 GB/s (PyTorch PR
    # 120378's micro-benchmark), 55 GB/s (NeMo-RL issue 3976, same host as its 1.8 GB/s pageable
    # per-tensor copies, which the planner's plans never make): 0.75-0.86 of the link; 0.6, the
    # conservative cap every rate prior keeps (a copy into a freshly pinned buffer pays cudaHostAlloc).
    OpClass.HOST_COPY: 0.6,
})


class Efficiencies(Mapping[OpClass, float]):
    """Immutable op class -> efficiency (0, 1.5]; classes never learned read as their prior."""

    __slots__ = ("_learned",)

    def __init__(self, learned: Mapping[OpClass, float] | None = None) -> None:
        values = dict(learned or {})
        for cls, e in values.items():
            if not isinstance(cls, OpClass):
                raise SpecError("efficiencies", f"unknown op class {cls!r}", ", ".join(c.value for c in OpClass))
            if not (math.isfinite(e) and 0 < e <= 1.5):
                raise SpecError(f"efficiencies.{cls.value}", f"must be in (0, 1.5], got {e}")
        self._learned: Mapping[OpClass, float] = MappingProxyType(values)

    def __getitem__(self, cls: OpClass) -> float:
        return self._learned.get(cls, PRIOR_EFFICIENCY[cls])

    def __iter__(self) -> Iterator[OpClass]:
        return iter(OpClass)

    def __len__(self) -> int:
        return len(OpClass)

    @property
    def learned(self) -> Mapping[OpClass, float]:
        return self._learned

    def updated(self, values: Mapping[OpClass, float]) -> Efficiencies:
        return Efficiencies({**self._learned, **values})

    def __repr__(self) -> str:
        return "Efficiencies(" + ", ".join(f"{c.value}={self[c]:.3g}" for c in OpClass) + ")"

    def __hash__(self) -> int:
        return hash(tuple(sorted((c.value, v) for c, v in self._learned.items())))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Efficiencies) and dict(self._learned) == dict(other._learned)


PRIORS = Efficiencies()
