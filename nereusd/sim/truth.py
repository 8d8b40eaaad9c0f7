"""The simulator's ground truth: how long a plan's RL step really takes, and whether it really fits.

This is NOT the planner's cost model and imports nothing from planner.cost, planner.prediction or
planner.memory (tests/sim checks it): it reads only the plan, the model's architecture and the
device/link data sheets, and it holds what the planner cannot see exactly:

- hidden efficiencies per resource (GEMM, attention, HBM, intra-node link, inter-node link) that differ
  from the planner's priors, and drift: throttling and congestion episodes drawn from the seed (plus the
  trace's compute_factor / network_factor columns);
- noise per step and per model-stage, and stragglers (a replica now and then 15-50% slower; a
  model-stage waits for its slowest replica, so wide DP meets more of them);
- the generation long tail: under continuous batching a replica's generation lasts until its longest
  response is done (drawn from a log-normal fitted to the step's mean and p95), and the tail is
  latency-bound (a pipeline cannot fill its stages with the last few sequences);
- compute/communication overlap (part of TP and DP collectives hide behind compute);
- memory: weights, gradients and Adam state of every model-stage resident on a GPU, activations for the
  longest micro-batch actually met this step, logits, workspaces and allocator fragmentation. A plan
  that does not fit raises :class:`OutOfMemory` at the stage that overflows, as a worker OOM would;
- transitions: a fixed setup per new communicator generation, per-primitive fixed cost, and bandwidth
  contention on the inter-node network (TransitionTruth, in transition_truth.py).

Parameters are chosen from public measurements (sources next to each); they were fixed before any run
and are not tuned to make the paper's numbers come out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from nereusd.sim.transition_truth import TransitionTruth, restart_seconds  # re-exported
from planner.hardware import ClusterSpec
from planner.models import Head, ModelSpec
from planner.plan import GlobalPlan, StagePlan
from planner.workflow import JobSpec, ModelStage, Role, StageKind

GiB = 1024**3


@dataclass(frozen=True, kw_only=True, slots=True)
class HiddenEfficiency:
    """Achieved fraction of the data-sheet peak, per resource (what a well-run job really reaches)."""

    gemm: float
    attention: float
    hbm: float
    intra_link: float
    inter_link: float


# Sources (fractions of data-sheet peak):
# - NVIDIA H100/H200: cuBLAS BF16 large GEMMs ~650-750 of 989 TFLOP/s (NVIDIA's cuBLAS and Megatron-Core
#   performance pages; Megatron 8B training MFU ~50% overall); FlashAttention-2 forward on H100 ~350
#   TFLOP/s (Dao 2023; FA3 paper table) -> 0.4; vLLM decode reaches ~60-70% of HBM bandwidth (vLLM
#   performance blog, 2024); NCCL all-reduce bus bandwidth ~360 GB/s on NVLink4 of 450 (nccl-tests on DGX
#   H100) -> 0.8; IB NDR 400 Gb/s ~40-45 GB/s bus bandwidth at scale -> 0.8.
# - A100: cuBLAS ~250 of 312 TFLOP/s -> 0.75 (used 0.7); FA2 50-73% of peak (Dao 2023) -> 0.55; NVLink3
#   ~230 GB/s busbw of 300 -> 0.77; IB HDR -> 0.8.
# - MI250X GCD: Frontier LLM training reports ~30-38% MFU (Dash et al., "Optimizing distributed training on
#   Frontier", 2023) -> GEMM 0.45, attention 0.3; rocm bandwidth tests ~1.3 of 1.6 TB/s per GCD but decode
#   kernels lower -> 0.55; RCCL over Infinity Fabric ~50-60% -> 0.55; Slingshot-11 ~ 0.7.
HIDDEN: dict[str, HiddenEfficiency] = {
    "h100-80gb": HiddenEfficiency(gemm=0.68, attention=0.40, hbm=0.65, intra_link=0.80, inter_link=0.80),
    "h200-141gb": HiddenEfficiency(gemm=0.68, attention=0.40, hbm=0.65, intra_link=0.80, inter_link=0.80),
    "a100-64gb": HiddenEfficiency(gemm=0.70, attention=0.55, hbm=0.70, intra_link=0.77, inter_link=0.80),
    "mi250x-gcd-64gb": HiddenEfficiency(gemm=0.45, attention=0.30, hbm=0.55, intra_link=0.55, inter_link=0.70),
    "cpu": HiddenEfficiency(gemm=0.8, attention=0.8, hbm=0.8, intra_link=0.8, inter_link=0.8),
}

# Behaviour constants (sources):
NOISE_SIGMA = 0.03  # step-to-step run-time variation of one stage, ~2-4% (MLPerf training result spreads)
STRAGGLER_P = 0.01  # chance per replica per step of a slow replica (GC pause, thermal, noisy neighbour)
STRAGGLER_SLOWDOWN = (1.15, 1.5)
TP_OVERLAP = 0.3  # share of TP collectives hidden behind GEMMs (Megatron's comm overlap options, partial)
DP_OVERLAP = 0.6  # share of the DP gradient all-reduce hidden behind backward (bucketed overlap, DDP)
DECODE_ITERATION_OVERHEAD_S = 5e-4  # scheduler + sampling per decode iteration with CUDA graphs (vLLM)
WORKSPACE_BYTES = int(2.5 * GiB)  # CUDA context ~0.5 GiB + cuBLAS/NCCL workspaces and buffers
FRAGMENTATION = 1.08  # PyTorch caching allocator: reserved / allocated for dynamic tensors, 5-10%
VLLM_MEMORY_UTILIZATION = 0.90  # vLLM's default gpu_memory_utilization
# What real RL frameworks pay beside the model-stages (set after the planner priced them, issue 16):
# - the per-step framework overhead (data processing, batching, buffer sampling): NeMo-RL PR 1052's
#   timing output sums 4.0 s of such phases for Llama-3.1-8B on H100; leaner pipelines pay less: 3 s
#   on GPU systems (none on the CPU development system), with the stage noise;
# - the weight refit train -> generation each step, in the actor's generation: its set-up (NeMo-RL:
#   0.13-5 s per step for 8B; 0.5 s here) plus the bf16 shard over the intra-node link.
STEP_OVERHEAD_S = 3.0
REFIT_SETUP_S = 0.5
# Drift episodes hidden from the planner (rates per step, durations in steps, factor on efficiency).
# (episodes per step, (shortest, longest) in steps, (lowest, highest) factor)
CONGESTION = (1 / 150, (10, 40), (0.5, 0.8))  # shared fabric, other jobs' traffic
THROTTLING = (1 / 300, (20, 60), (0.85, 0.95))  # power/thermal capping


class OutOfMemory(Exception):
    """A stage of the plan does not fit on a GPU in truth (what a worker's CUDA OOM would report)."""

    def __init__(self, model_stage: str, gpu: int, need_bytes: int, capacity_bytes: int,
                 longest_response_tokens: float = 0.0) -> None:
        self.model_stage = model_stage
        self.longest_response_tokens = longest_response_tokens  # what the failing batch held
        self.gpu = gpu
        self.need_bytes = need_bytes
        self.capacity_bytes = capacity_bytes
        super().__init__(f"{model_stage}: GPU {gpu} needs {need_bytes / GiB:.1f} GiB of "
                         f"{capacity_bytes / GiB:.1f} GiB")


@dataclass(frozen=True, kw_only=True, slots=True)
class StepWorkload:
    """What one RL step really processes (a trace row)."""

    mean_response_tokens: float
    p95_response_tokens: float
    compute_factor: float = 1.0
    network_factor: float = 1.0


@dataclass(frozen=True, kw_only=True, slots=True)
class StepOutcome:
    step_latency_s: float
    stage_times_s: dict[str, float]
    peak_memory_bytes: int
    longest_response_tokens: float


def lognormal_sigma(mean: float, p95: float) -> float:
    """sigma of a log-normal with this mean and 95th percentile (p95/mean = exp(1.645 s - s^2/2))."""
    r = p95 / mean
    if r <= 1.0:
        return 0.0
    # solve s^2/2 - 1.645 s + ln r = 0, smaller root (the larger one is a heavier-tail twin)
    disc = 1.645**2 - 2 * math.log(r)
    return 1.645 - math.sqrt(max(disc, 0.0))


_PARAMS: dict[tuple[str, Head], tuple[int, int]] = {}


def _param_counts(model: ModelSpec, head: Head) -> tuple[int, int]:
    """(all parameters, parameters of one layer), counted from the architecture once per model."""
    key = (model.name, head)
    if key not in _PARAMS:
        tensors = model.tensors(head)
        _PARAMS[key] = (sum(t.numel for t in tensors), sum(t.numel for t in tensors if t.layer == 0))
    return _PARAMS[key]


def _ring(n: int) -> float:
    return 2 * (n - 1) / n if n > 1 else 0.0


@dataclass(kw_only=True)
class _Geometry:
    """What the truth needs of one model-stage's placement (computed once per plan)."""

    ms: ModelStage
    sp: StagePlan
    model: ModelSpec
    tp_inter: bool
    pp_inter: bool
    dp_inter: bool
    params_per_gpu: float
    resident_max_bytes: float  # fullest GPU of this stage: everything resident on it
    fullest_gpu: int
    gpus: np.ndarray  # every GPU of the stage


class GroundTruth:
    """The real cluster a simulated job runs on (one per run; seeded, so the same seed gives the same run)."""

    def __init__(self, job: JobSpec, cluster: ClusterSpec, *, seed: int = 0, steps: int = 10_000,
                 drift: bool = True) -> None:
        self.job = job
        self.cluster = cluster
        self.eff = HIDDEN[cluster.device.name]
        self.rng = np.random.default_rng(seed)
        self._episodes = self._draw_episodes(np.random.default_rng(seed + 1), steps) if drift else (
            np.ones(steps), np.ones(steps))
        self._geometry: dict[int, dict[str, Any]] = {}

    # --- hidden drift ---------------------------------------------------------------------------
    @staticmethod
    def _draw_episodes(rng: np.random.Generator, steps: int) -> tuple[np.ndarray, np.ndarray]:
        out = []
        for spec in (THROTTLING, CONGESTION):
            f = np.ones(steps)
            s = 0
            rate, (lo, hi), (flo, fhi) = spec
            while True:
                s += int(rng.exponential(1 / rate)) + 1
                if s >= steps:
                    break
                n = int(rng.integers(lo, hi + 1))
                f[s:s + n] = np.minimum(f[s:s + n], rng.uniform(flo, fhi))
                s += n
            out.append(f)
        return out[0], out[1]

    def factors(self, step: int, w: StepWorkload) -> tuple[float, float]:
        """(compute, network) efficiency multipliers in force at ``step``."""
        i = min(step, len(self._episodes[0]) - 1)
        return float(self._episodes[0][i]) * w.compute_factor, float(self._episodes[1][i]) * w.network_factor

    # --- geometry and memory (once per plan) -----------------------------------------------------
    def _params_per_gpu(self, model: ModelSpec, head: Head, tp: int, pp: int) -> float:
        total, per_layer = _param_counts(model, head)
        embed = total - per_layer * model.num_layers
        # TP shards matrices; PP splits layers (embedding and head sit on the end stages: the first
        # stage holds the embedding, which makes it the fullest)
        return (per_layer * math.ceil(model.num_layers / pp) + embed / (2 if pp > 1 else 1)) / tp

    def geometry(self, plan: GlobalPlan) -> dict[str, Any]:
        """model-stage -> _Geometry, plus "__plan__" and "__resident__" (bytes resident per GPU)."""
        key = id(plan)
        cached = self._geometry.get(key)
        if cached is not None and cached["__plan__"] is plan:
            return cached
        per_node = self.cluster.gpus_per_node
        resident = np.zeros(max(plan.gpus) + 1)
        geo: dict[str, Any] = {"__plan__": plan, "__resident__": resident}
        for sp in plan.stages:
            ms = self.job.workflow.stage(sp.model_stage)
            model = self.job.model_of(ms)
            tp, pp = sp.layout.tp, sp.layout.pp
            ppg = self._params_per_gpu(model, ms.role.head, tp, pp)
            bytes_per_param = 16 if ms.kind is StageKind.TRAINING else 2  # bf16 w+g, fp32 master+m+v
            sets = np.asarray(sp.gpu_sets)
            resident[sets.ravel()] += ppg * bytes_per_param
            nodes = sets // per_node
            tp_groups = nodes.reshape(len(sp.gpu_sets), pp, tp)
            geo[sp.model_stage] = _Geometry(
                ms=ms, sp=sp, model=model, params_per_gpu=ppg, resident_max_bytes=0.0, fullest_gpu=0,
                gpus=sets.ravel(),
                tp_inter=bool((tp_groups != tp_groups[:, :, :1]).any()),
                pp_inter=bool(pp > 1 and (tp_groups[:, 1:, 0] != tp_groups[:, :-1, 0]).any()),
                dp_inter=bool(len(sp.gpu_sets) > 1 and (nodes[:, 0] != nodes[0, 0]).any()))
        for sp in plan.stages:
            g = geo[sp.model_stage]
            gpus = np.asarray(sp.gpu_sets).ravel()
            i = int(np.argmax(resident[gpus]))
            g.resident_max_bytes, g.fullest_gpu = float(resident[gpus[i]]), int(gpus[i])
        if len(self._geometry) > 16:
            self._geometry.clear()
        self._geometry[key] = geo
        return geo

    def _activation_bytes(self, g: _Geometry, seq_tokens: float, mean_tokens: float) -> float:
        """Transient bytes of one model-stage on its fullest GPU for the micro-batch holding the longest
        sequence (``seq_tokens``, prompt included) among sequences of ``mean_tokens`` on average: packed
        micro-batches (no padding), as verl's and OpenRLHF's remove-padding modes run them."""
        m, sp, w = g.model, g.sp, self.job.workload
        tp, pp = sp.layout.tp, sp.layout.pp
        h = m.hidden_size
        tokens = seq_tokens + (sp.micro_batch_size - 1) * mean_tokens
        layers = math.ceil(m.num_layers / pp)
        logits = tokens * m.vocab_size * 4 / tp  # fp32 logits for the log-probs/loss
        if g.ms.kind is StageKind.TRAINING:
            # Korthikanti et al. 2022: 34*s*b*h bytes per layer with TP+SP (flash attention drops 5as/h),
            # full recompute keeps only the layer input (2*s*b*h); 1F1B keeps up to pp micro-batches.
            per_token_layer = (2 * h) if sp.recompute else (34 * h / tp)
            in_flight = min(pp, sp.grad_accum)
            return per_token_layer * layers * tokens * in_flight + 2 * logits
        if g.ms.kind is StageKind.INFERENCE:
            return 34 * h / tp * tokens + logits  # one layer's working set plus logits
        # generation: vLLM reserves its KV pool up front; OOM only if not one longest sequence fits
        kv = m.kv_bytes_per_token / (min(tp, m.num_kv_heads) * pp) * (w.prompt_tokens + seq_tokens)
        return kv

    # --- one step ---------------------------------------------------------------------------------
    def run_step(self, plan: GlobalPlan, step: int, w: StepWorkload, *, check_memory: bool = True) -> StepOutcome:
        """Time one RL step of ``plan`` (raises OutOfMemory when a stage does not fit, if ``check_memory``)."""
        geo = self.geometry(plan)
        cf, nf = self.factors(step, w)
        sigma = lognormal_sigma(w.mean_response_tokens, w.p95_response_tokens)
        mu = math.log(w.mean_response_tokens) - sigma**2 / 2
        cap = self.cluster.device.memory_bytes
        times: dict[str, float] = {}
        peak = 0.0
        longest = 0.0
        n_seq_step = self.job.workload.sequences_per_step
        cap_tokens = self.job.workload.max_response_tokens
        for name, g in geo.items():
            if name.startswith("__"):
                continue
            dp = len(g.sp.gpu_sets)
            n_seq = max(1, math.ceil(n_seq_step / dp))
            # each replica's longest response: max of n_seq log-normal draws = quantile at U^(1/n)
            u = self.rng.random(dp) ** (1.0 / n_seq)
            z = _norm_ppf(np.clip(u, 1e-12, 1 - 1e-12))
            longest_per_replica = np.exp(mu + sigma * z)
            if cap_tokens:  # the generation cap (vLLM max_tokens) cuts the tail
                longest_per_replica = np.minimum(longest_per_replica, cap_tokens)
            longest = max(longest, float(longest_per_replica.max()))
            prompt = self.job.workload.prompt_tokens
            seq_max = float(longest_per_replica.max()) + prompt
            act = self._activation_bytes(g, seq_max, prompt + w.mean_response_tokens)
            need = g.resident_max_bytes + FRAGMENTATION * act + WORKSPACE_BYTES
            if check_memory and g.ms.kind is StageKind.GENERATION and need > VLLM_MEMORY_UTILIZATION * cap:
                raise OutOfMemory(name, g.fullest_gpu, int(need), cap, seq_max - prompt)
            if check_memory and need > cap:
                raise OutOfMemory(name, g.fullest_gpu, int(need), cap, seq_max - prompt)
            peak = max(peak, need)
            per_replica = self._replica_seconds(g, w, longest_per_replica, cf, nf)
            # stragglers and noise: a model-stage takes its slowest replica
            slow = np.where(self.rng.random(dp) < STRAGGLER_P, self.rng.uniform(*STRAGGLER_SLOWDOWN, dp), 1.0)
            t = float((per_replica * slow).max()) * float(np.exp(self.rng.normal(0.0, NOISE_SIGMA)))
            t += self._dp_sync_seconds(g, nf)
            times[name] = t
        overhead = 0.0 if self.cluster.device.name == "cpu" else \
            STEP_OVERHEAD_S * float(np.exp(self.rng.normal(0.0, NOISE_SIGMA)))
        return StepOutcome(step_latency_s=self._critical_path(plan, times) + overhead, stage_times_s=times,
                           peak_memory_bytes=int(peak), longest_response_tokens=longest)

    def mean_latency(self, plan: GlobalPlan, step: int, w: StepWorkload, draws: int = 16,
                     seed: int | None = None) -> float:
        """The step latency averaged over ``draws`` draws of noise, stragglers and tails, without touching
        this run's random stream (what a prediction should be compared with)."""
        saved, self.rng = self.rng, np.random.default_rng(step + 7919 if seed is None else seed)
        try:
            return sum(self.run_step(plan, step, w, check_memory=False).step_latency_s for _ in range(draws)) / draws
        finally:
            self.rng = saved

    def _link(self, inter: bool, nf: float) -> tuple[float, float]:
        """(bytes/s, latency) of the path a group uses."""
        c = self.cluster
        if inter:
            return c.inter_node_link.bytes_per_s * self.eff.inter_link * nf, c.inter_node_link.latency_s
        return c.intra_node_link.bytes_per_s * self.eff.intra_link * min(1.0, 0.5 + nf / 2), c.intra_node_link.latency_s

    def _replica_seconds(self, g: _Geometry, w: StepWorkload, longest: np.ndarray, cf: float, nf: float) -> np.ndarray:
        m, sp, wl = g.model, g.sp, self.job.workload
        dev = self.cluster.device
        tp, pp = sp.layout.tp, sp.layout.pp
        dp = len(sp.gpu_sets)
        h, L = m.hidden_size, m.num_layers
        flops_s = dev.peak_flops_bf16 * self.eff.gemm * cf
        attn_s = dev.peak_flops_bf16 * self.eff.attention * cf
        hbm_s = dev.hbm_bytes_per_s * self.eff.hbm * cf
        tp_bw, tp_lat = self._link(g.tp_inter, nf)
        pp_bw, pp_lat = self._link(g.pp_inter, nf)
        n_params = _param_counts(m, g.ms.role.head)[0]
        if g.ms.kind is StageKind.GENERATION:
            n_seq = max(1, math.ceil((wl.prompts_per_step if g.ms.greedy else wl.sequences_per_step) / dp))
            prompt = wl.prompt_tokens
            mean = w.mean_response_tokens
            weights = 2 * g.params_per_gpu
            kv_tok = m.kv_bytes_per_token / (min(tp, m.num_kv_heads) * pp)
            kv_pool = max(VLLM_MEMORY_UTILIZATION * dev.memory_bytes - g.resident_max_bytes - WORKSPACE_BYTES, 1.0)
            concurrent = max(1.0, min(n_seq, kv_pool / (kv_tok * (prompt + mean))))
            # bulk phase (throughput-bound, pipelined over pp stages), then the tail (latency-bound)
            bulk_iters = n_seq * mean / concurrent
            tail_iters = np.maximum(longest - mean, 0.0)
            batch = concurrent
            kv_read = batch * (prompt + mean / 2) * kv_tok
            flop_iter = 2 * n_params / (tp * pp) * batch
            stage_iter = max((weights + kv_read) / hbm_s, flop_iter / flops_s)
            tp_iter = 2 * math.ceil(L / pp) * (_ring(tp) * batch * h * 2 / tp_bw + (tp - 1) * tp_lat) if tp > 1 else 0.0
            pp_iter = (pp - 1) * (batch * h * 2 / pp_bw + pp_lat)
            iter_bulk = stage_iter + tp_iter + DECODE_ITERATION_OVERHEAD_S
            # the tail: few sequences left, each token crosses all pp stages in turn
            tail_weights = weights / hbm_s
            tail_tp = 2 * math.ceil(L / pp) * (tp - 1) * tp_lat * 2 if tp > 1 else 0.0
            iter_tail = pp * (tail_weights + tail_tp) + pp_iter / max(batch, 1) + DECODE_ITERATION_OVERHEAD_S
            prefill = 2 * n_params / (tp * pp) * n_seq * prompt / flops_s
            refit = 0.0
            if g.ms.role is Role.ACTOR and self.cluster.device.name != "cpu":
                intra_bw, _ = self._link(False, nf)
                refit = REFIT_SETUP_S + weights / intra_bw
            return prefill + bulk_iters * (iter_bulk + pp_iter / pp) + tail_iters * iter_tail + refit
        # inference and training: packed sequences, micro-batches through the pipeline (1F1B)
        n_seq = max(1, math.ceil((wl.sequences_per_step if g.ms.kind is StageKind.INFERENCE
                                  else wl.sequences_per_mini_batch) / dp))
        seq = wl.prompt_tokens + w.mean_response_tokens
        tokens = n_seq * seq
        # PPO/GRPO actors recompute the rollout's log-probs under the training weights first (one more forward)
        old_logprobs = 1.0 if g.ms.old_logprob_pass else 0.0
        mult = 1.0 if g.ms.kind is StageKind.INFERENCE else (4.0 if sp.recompute else 3.0) + old_logprobs
        gemm = mult * 2 * n_params / (tp * pp) * tokens / flops_s
        attn = mult * 2 * 2 * math.ceil(L / pp) * h * seq * tokens / 2 / tp / attn_s  # causal: half the s^2
        collectives = (2 if g.ms.kind is StageKind.INFERENCE else 4 + 2 * old_logprobs) * math.ceil(L / pp)
        tp_comm = collectives * (_ring(tp) * tokens * h * 2 / tp_bw + (tp - 1) * tp_lat) if tp > 1 else 0.0
        m_micro = max(1, math.ceil(n_seq / sp.micro_batch_size))
        per_micro = (gemm + attn + (1 - TP_OVERLAP) * tp_comm) / m_micro
        pp_comm = (pp - 1) * (sp.micro_batch_size * seq * h * 2 / pp_bw + pp_lat) * (1 if mult == 1 else 2)
        pipelined = (m_micro + pp - 1) * per_micro + pp_comm
        if g.ms.kind is StageKind.TRAINING:
            pipelined += 16 * 2 * g.params_per_gpu / hbm_s  # Adam: read and write the 16 B/param state
            pipelined *= wl.train_mini_batches_per_step
        return np.full(len(longest), pipelined)

    def _dp_sync_seconds(self, g: _Geometry, nf: float) -> float:
        dp = len(g.sp.gpu_sets)
        if g.ms.kind is not StageKind.TRAINING or dp < 2:
            return 0.0
        bw, lat = self._link(g.dp_inter, nf)
        once = _ring(dp) * g.params_per_gpu * 2 / bw + 2 * (dp - 1) * lat
        return (1 - DP_OVERLAP) * once * self.job.workload.train_mini_batches_per_step

    def _critical_path(self, plan: GlobalPlan, times: dict[str, float]) -> float:
        """Stages in order gen -> inf -> train; inside one, model-stages sharing a GPU serialise."""
        geo = self.geometry(plan)
        end_of_gpu = np.zeros(len(geo["__resident__"]))
        barrier = 0.0
        for kind in (StageKind.GENERATION, StageKind.INFERENCE, StageKind.TRAINING):
            stage_end = barrier
            for sp in plan.stages:
                g = geo[sp.model_stage]
                if g.ms.kind is not kind:
                    continue
                start = max(barrier, float(end_of_gpu[g.gpus].max()))
                end = start + times[sp.model_stage]
                end_of_gpu[g.gpus] = end
                stage_end = max(stage_end, end)
            barrier = stage_end
        return barrier


def _norm_ppf(p: np.ndarray) -> np.ndarray:
    """Inverse standard normal CDF (Acklam's rational approximation, |error| < 1.2e-9)."""
    a = (-3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02, 1.383577518672690e+02,
         -3.066479806614716e+01, 2.506628277459239e+00)
    b = (-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02, 6.680131188771972e+01,
         -1.328068155288572e+01)
    c = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00, -2.549732539343734e+00,
         4.374664141464968e+00, 2.938163982698783e+00)
    d = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00, 3.754408661907416e+00)
    p = np.asarray(p, dtype=float)
    out = np.empty_like(p)
    lo, hi = p < 0.02425, p > 1 - 0.02425
    mid = ~(lo | hi)
    q = p[mid] - 0.5
    r = q * q
    out[mid] = (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q / \
        (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1)
    for mask, sign, pp in ((lo, 1.0, p), (hi, -1.0, 1 - p)):
        qq = np.sqrt(-2 * np.log(pp[mask]))
        out[mask] = sign * (((((c[0] * qq + c[1]) * qq + c[2]) * qq + c[3]) * qq + c[4]) * qq + c[5]) / \
            ((((d[0] * qq + d[1]) * qq + d[2]) * qq + d[3]) * qq + 1)
    return out


__all__ = ["GroundTruth", "HiddenEfficiency", "OutOfMemory", "StepOutcome", "StepWorkload", "TransitionTruth",
           "lognormal_sigma", "restart_seconds"]
