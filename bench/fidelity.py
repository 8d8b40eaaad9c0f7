"""Cost-model fidelity against public measurements: what was priced, predicted vs published, ratio. JSON.

    .venv/bin/python bench/fidelity.py [--out FILE] [--table] [--quick]

Each row is one published figure (RL step times, training and generation throughput, time per output
token at several concurrencies, memory footprints, the paper's 16-GPU example), the setting it was
measured in (the RL rows and their recipes: bench/fidelity_rl.py), the layout the planner priced
(the closest it can express: it has no distributed optimizer / FSDP, so those training layouts are
priced as ZeRO-0 replicas of the same TP/PP, time only, and their memory is reported as the planner
sees it), and predicted / published.

Two columns of ratios:
- ``ratio_priors``: the uncalibrated model (priors are conservative on purpose: expect < 1 throughput);
- ``ratio_calibrated``: after ONE calibration per op-class family from an anchor row, as the live job
  would calibrate on its own first steps: GEMM from the policy training phase of NeMo-RL's
  Llama-3.1-8B step (issue 959), weight reads (MEMORY_BOUND) from vLLM Llama-3.1-8B decode at
  concurrency 1 (each anchor sets only the class it is dominated by; see ANCHORS). Anchor rows are
  marked; every other calibrated ratio is out of sample (pretraining rows then show the MFU gap
  between pretraining and RL).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.fidelity_rl import (  # noqa: E402
    rl_llama8b,
    rl_qwen32b,
    v03_70b_generation,
    v03_70b_logprobs,
    v03_70b_refit,
    v03_70b_step,
    v03_70b_training,
    v03_generation,
    v03_logprobs,
    v03_refit,
    v03_step,
    v03_training,
)
from planner.cost import PRIORS, Efficiencies, Links, OpClass, stage_cost  # noqa: E402
from planner.hardware import A100_64G, H100, NVLINK3, ClusterSpec, DeviceSpec, nic_link  # noqa: E402
from planner.memory import resident_bytes  # noqa: E402
from planner.models import LLAMA_31_8B, LLAMA_33_70B  # noqa: E402
from planner.plan import Layout  # noqa: E402
from planner.workflow import ModelStage, Role, StageKind, Workload  # noqa: E402

Eff = Mapping[OpClass, float]
# Pretraining (no RL): a training model-stage without the old-log-prob pass; serving: a generation
# model-stage whose weights never change (no refit), i.e. not the actor.
PRETRAIN = ModelStage("pretrain", Role.CRITIC, StageKind.TRAINING)
SERVE = ModelStage("serve", Role.REFERENCE, StageKind.GENERATION)
# A100 SXM 80GB (torchtitan) and 40GB (the vLLM sweep): same compute, HBM 2.039 / 1.555 TB/s (data sheet)
A100_80G = dataclasses.replace(A100_64G, name="a100-80gb", memory_bytes=80 * 10**9)
A100_40G = dataclasses.replace(A100_64G, name="a100-40gb", memory_bytes=40 * 10**9, hbm_bytes_per_s=1.555e12)


def _one_node(device: DeviceSpec) -> ClusterSpec:
    return ClusterSpec(device=device, num_nodes=1, gpus_per_node=1, intra_node_link=NVLINK3,
                       inter_node_link=NVLINK3)


# --- training throughput: torchtitan docs/performance.md, 64 A100-80GB, FSDP2, local batch 1,
# sequence 8,192 (Llama 3 default), tokens/s per GPU.

def _titan(model: Any, ac: str, eff: Eff) -> tuple[float, dict[str, Any]]:
    """Seconds of one FSDP2 rank's step, as torchtitan runs it: the compute of a TP1 replica (ZeRO-0
    in the planner's terms, for time only), with (1) its activation checkpointing as torchtitan's
    policy has it and (2) the optimizer update of the rank's 1/64 shard (FSDP shards optimizer
    state: each rank steps only its own parameters' shard, where a ZeRO-0 replica steps all)."""
    w = Workload(prompts_per_step=64, prompt_tokens=8191, response_tokens=1)
    cl = ClusterSpec(device=A100_80G, num_nodes=8, gpus_per_node=8, intra_node_link=NVLINK3,
                     inter_node_link=nic_link("hdr", nics_per_node=8, gbit_per_s=200, gpus_per_node=8))

    def cost(recompute: bool) -> Any:
        return stage_cost(model, PRETRAIN, Layout(1, 1), w, micro_batch_size=1, grad_accum=1, recompute=recompute,
                          dp=64, cluster=cl, links=Links(dp_intra=False), eff=eff)

    def of(c: Any, cls: OpClass) -> float:
        return sum(t.seconds(eff) for t in c.terms if t.op_class is cls)

    c = cost(ac == "full")
    seconds = c.seconds
    if ac == "op":
        # selective op AC (torchtitan/distributed/activation_checkpoint.py, _custom_policy): "Saves output
        # of all compute ops, except every second mm" (attention outputs saved): half the matmuls of a
        # forward are recomputed in backward, so half of the planner's recomputed-forward GEMM time
        seconds += 0.5 * (of(cost(True), OpClass.GEMM) - of(c, OpClass.GEMM))
    # the only MEMORY_BOUND term of a training stage is the optimizer update (planner.cost.sync_raw)
    seconds -= (1 - 1 / 64) * of(c, OpClass.MEMORY_BOUND)
    return 8192 / seconds, {"step_s": round(seconds, 2)}


def titan_8b(eff: Eff) -> tuple[float, dict[str, Any]]:
    return _titan(LLAMA_31_8B, "op", eff)  # selective op AC


def titan_70b(eff: Eff) -> tuple[float, dict[str, Any]]:
    return _titan(LLAMA_33_70B, "full", eff)  # full AC


# --- generation: decode rate (1 / time per output token) of Llama-3.1-8B bf16 in vLLM at concurrency c.

def _decode_rate(device: DeviceSpec, prompt: int, out: int, c: int, eff: Eff) -> float:
    """Per-sequence decode tokens/s at concurrency c: decode seconds of a wave of c sequences / out tokens."""
    w = Workload(prompts_per_step=c, prompt_tokens=prompt, response_tokens=out)
    cost = stage_cost(LLAMA_31_8B, SERVE, Layout(1, 1), w, micro_batch_size=c, grad_accum=1, recompute=False,
                      dp=1, cluster=_one_node(device), links=Links(), eff=eff)
    decode = [t for t in cost.terms if t.op_class in (OpClass.MEMORY_BOUND, OpClass.ATTENTION_DECODE,
                                                       OpClass.DECODE_OVERHEAD)]
    gemm = [t for t in cost.terms if t.op_class is OpClass.GEMM]
    # the roofline kept either the weight read or the decode GEMM (the first GEMM term)
    seconds = sum(t.seconds(eff) for t in decode) + (gemm[0].seconds(eff) if len(gemm) == 2 else 0.0)
    return out / seconds


def vllm_a100_c1(eff: Eff) -> tuple[float, dict[str, Any]]:
    return _decode_rate(A100_40G, 1024, 128, 1, eff), {}


def vllm_a100_c8_gain(eff: Eff) -> tuple[float, dict[str, Any]]:
    """Aggregate throughput gain from 1 to 8 concurrent requests."""
    return 8 * _decode_rate(A100_40G, 1024, 128, 8, eff) / _decode_rate(A100_40G, 1024, 128, 1, eff), {}


# The H100 sweep's harness bounds its throughput: output tok/s stops at 1,384 from c = 16 and falls to
# 1,312 at c = 64 (TPOT 46.91 ms, 64 / 46.91 ms = 1,364 tok/s), where one H100 decodes Llama-3.1-8B at
# several thousand tok/s (the planner's weights-plus-KV model: ~9 ms per token at c = 64; KV reads at
# c = 16 x ~384 tokens are ~5% of the weight bytes per step, which cannot make +66% over c = 4). So a
# row of that sweep is the GPU's TPOT or c / (the harness's ceiling), whichever is longer: the ceiling
# from the sweep's c = 64 point (not a row of the table); c = 1 and 4 sit far below it (4 / 1,364 tok/s
# = 2.9 ms against 6.6 ms), so only c = 16 reads it. A property of that measurement, not of vLLM or
# of the planner: an RL engine's offline generate has no client to stream to.
INFBENCH_CEILING_TOK_S = 64 / 46.91e-3


def _h100_tpot(c: int, eff: Eff) -> tuple[float, dict[str, Any]]:
    # "chatbot-short": short prompts and answers; 256 in / 256 out assumed (not published)
    gpu_ms = 1e3 / _decode_rate(H100, 256, 256, c, eff)
    return max(gpu_ms, 1e3 * c / INFBENCH_CEILING_TOK_S), {"assumed_lengths": "256 in / 256 out",
                                                           "gpu_tpot_ms": round(gpu_ms, 3)}


def tpot_h100_c1(eff: Eff) -> tuple[float, dict[str, Any]]:
    return _h100_tpot(1, eff)


def tpot_h100_c4(eff: Eff) -> tuple[float, dict[str, Any]]:
    return _h100_tpot(4, eff)


def tpot_h100_c16(eff: Eff) -> tuple[float, dict[str, Any]]:
    return _h100_tpot(16, eff)


# --- memory

def vllm_weights(eff: Eff) -> tuple[float, dict[str, Any]]:
    return resident_bytes(LLAMA_31_8B, SERVE, Layout(1, 1)).params_bytes / 2**30, {}


def _paper(total: int, tp: int, pp: int, eff: Eff) -> Any:
    sys.path.insert(0, str(ROOT / "tests" / "planner"))
    from test_fidelity import _train_only  # the test's own setting, one definition

    del eff
    return _train_only(total, 2, tp, pp)


def paper_422_4k(eff: Eff) -> tuple[float, dict[str, Any]]:
    p = _paper(4096, 2, 2, eff)
    return p.max_peak_memory_bytes / p.memory_capacity_bytes, {"feasible": p.feasible}


def paper_441_4k(eff: Eff) -> tuple[float, dict[str, Any]]:
    p = _paper(4096, 4, 1, eff)
    return p.max_peak_memory_bytes / p.memory_capacity_bytes, {"feasible": p.feasible}


def paper_2k_speedup(eff: Eff) -> tuple[float, dict[str, Any]]:
    a, b = _paper(2048, 2, 2, eff), _paper(2048, 4, 1, eff)
    return b.step_latency_s / a.step_latency_s, {"(4,2,2)_s": round(a.step_latency_s, 2),
                                                 "(4,4,1)_s": round(b.step_latency_s, 2)}


NEMO = "NVIDIA-NeMo/RL docs/about/performance-summary.md (v0.4, GRPO, DGX-H100)"
TITAN = "pytorch/torchtitan docs/performance.md (Llama 3, 64 A100-80GB, FSDP2)"
SWEEP = "johnmusgrave.com/p/vllm-throughput-latency-sweep-on (vLLM 0.23, A100 40GB, bf16, 1024 in / 128 out)"
INFBENCH = "yobitelcomm.github.io/bench/recipes/concurrency-sweep (vLLM 0.21, H100-80GB, fp16, chatbot-short)"
VLLM_LOG = "vLLM log 'Loading model weights took 14.99 GiB' (awslabs data-on-eks, Llama-3.1-8B architecture)"
ISSUE959 = "github.com/NVIDIA-NeMo/RL/issues/959 (v0.3 blog figures: 8B, Megatron, 1 node x 8 H100)"
PAPER = "shared/PAPER.md: 16 GPUs, (4,2,2) fastest at 2K, OOM at 4K where (4,4,1) fits"

# (name, what, setting, priced as, published, unit, source, function, kind)
# kind: "time" / "rate" (ratio = predicted / published), "memory", "check" (a call that must match)
ROWS: list[tuple[str, str, str, str, float, str, str, Callable[[Eff], tuple[float, dict[str, Any]]], str]] = [
    ("nemo_rl_llama8b_16", "GRPO step time", "Llama-3.1-8B, 16 H100, 2,048 samples, 4 optimizer steps, mean "
     "gen 1,060 of max 4,096", "gen TP1 x DP16 (all in flight), ref/old-logprob/train PP2 x DP8 with full "
     "recomputation (as the recipe), sequences packed into 4,096-token micro-batches (ZeRO-0 replicas: "
     "NeMo-RL uses a distributed optimizer); + NeMo-RL's refit as it runs", 97.7, "s", NEMO,
     rl_llama8b, "time"),
    ("nemo_rl_qwen32b_32", "GRPO step time", "Qwen3-32B, 32 H100, 2,048 samples, 4 optimizer steps, mean gen "
     "3,206 of max 4,096", "gen TP4 x DP8, ref/train TP4 PP4 x DP2, no recomputation, packed; + NeMo-RL's refit",
     393.0, "s", NEMO, rl_qwen32b, "time"),
    ("nemo_rl_v03_8b_8_step", "GRPO step time", "Llama-3.1-8B, 8 H100 (grpo_math_8B_megatron.yaml "
     "at v0.3.0), mean gen 795", "as nemo_rl_llama8b_16 on 8 GPUs, without recomputation (the recipe's "
     "activation_checkpointing: false), logprob batch 4", 112.0, "s", ISSUE959, v03_step, "time"),
    ("nemo_rl_v03_8b_8_generation", "generation phase", "same", "actor-gen less its refit term", 58.0, "s",
     ISSUE959, v03_generation, "time"),
    ("nemo_rl_v03_8b_8_training", "policy training phase", "same", "actor-train less its old-log-prob pass",
     28.0, "s", ISSUE959, v03_training, "time"),
    ("nemo_rl_v03_8b_8_logprobs", "log-prob phase (policy + reference)", "same",
     "ref-inf + actor-train's old-log-prob pass", 18.0, "s", ISSUE959, v03_logprobs, "time"),
    ("nemo_rl_v03_8b_8_refit", "refit phase", "same (the issue's rerun: 8 s)", "NeMo-RL's refit with the planner's "
     "classes: set-up + the whole unsharded model gathered on every GPU (PP broadcast) + the training "
     "state's offload (optimizer state to pageable host memory at 1.8 GB/s, parameters to pinned)", 5.0, "s",
     ISSUE959, v03_refit, "time"),
    ("nemo_rl_v03_8b_8_refit_rerun", "refit phase, the issue reporter's rerun", "same recipe (step 116 s = "
     "27 + 8 + 56 + 18, 811 tokens)", "as nemo_rl_v03_8b_8_refit", 8.0, "s", ISSUE959, v03_refit, "time"),
    ("nemo_rl_v03_70b_64_step", "GRPO step time", "Llama-3.3-70B (3.1 architecture), 64 H100 "
     "(grpo_math_70B_megatron.yaml at v0.3.0), mean gen 398", "gen TP4 x DP16, ref/old-logprob/train TP4 PP4 "
     "x DP4 (across 2 nodes), no recomputation, packed; + the refit's offload", 147.0, "s", ISSUE959,
     v03_70b_step, "time"),
    ("nemo_rl_v03_70b_64_generation", "generation phase", "same", "actor-gen less its refit term", 84.0, "s",
     ISSUE959, v03_70b_generation, "time"),
    ("nemo_rl_v03_70b_64_training", "policy training phase", "same", "actor-train less its old-log-prob pass",
     28.0, "s", ISSUE959, v03_70b_training, "time"),
    ("nemo_rl_v03_70b_64_logprobs", "log-prob phase (policy + reference)", "same",
     "ref-inf + actor-train's old-log-prob pass", 18.0, "s", ISSUE959, v03_70b_logprobs, "time"),
    ("nemo_rl_v03_70b_64_refit", "refit phase", "same (the issue's rerun: 26 s)", "as nemo_rl_v03_8b_8_refit (the PP "
     "broadcast over the NICs: the TP4 x PP4 group spans two nodes)", 14.0, "s", ISSUE959, v03_70b_refit, "time"),
    ("torchtitan_llama3_8b", "training tokens/s/GPU", "Llama-3-8B, seq 8,192, local batch 1, selective op AC",
     "TP1 replica x DP64 (compute of an FSDP rank; gradient all-reduce over the node's 8 HDR NICs; half the "
     "matmuls recomputed, as torchtitan's op policy; the rank's 1/64 optimizer shard)", 2973.0, "tok/s/GPU",
     TITAN, titan_8b, "rate"),
    ("torchtitan_llama3_70b", "training tokens/s/GPU", "Llama-3-70B, seq 8,192, local batch 1, full AC",
     "TP1 replica x DP64 with full recomputation (the rank's 1/64 optimizer shard)", 331.0, "tok/s/GPU", TITAN, titan_70b, "rate"),
    ("vllm_a100_c1", "decode tokens/s, concurrency 1", "Llama-3.1-8B bf16, A100 40GB", "one GPU, b = 1",
     75.0, "tok/s", SWEEP, vllm_a100_c1, "rate"),
    ("vllm_a100_c8_gain", "throughput gain 1 -> 8 concurrent", "same", "b = 8 vs b = 1", 6.6, "x", SWEEP,
     vllm_a100_c8_gain, "rate"),
    ("vllm_h100_tpot_c1", "TPOT p50, concurrency 1", "Llama-3.1-8B fp16, H100-80GB", "one GPU, b = 1", 6.48,
     "ms", INFBENCH, tpot_h100_c1, "time"),
    ("vllm_h100_tpot_c4", "TPOT p50, concurrency 4", "same", "b = 4", 6.59, "ms", INFBENCH, tpot_h100_c4, "time"),
    ("vllm_h100_tpot_c16", "TPOT p50, concurrency 16", "same", "b = 16, or the sweep's own "
     "output-token ceiling (its c = 64 point: 1,364 tok/s), whichever is longer", 10.94, "ms", INFBENCH, tpot_h100_c16, "time"),
    ("vllm_llama8b_weights", "weights in GPU memory", "Llama-3.1-8B bf16, TP1", "resident params of a "
     "generation unit", 14.99, "GiB", VLLM_LOG, vllm_weights, "memory"),
    ("paper_422_oom_at_4k", "(4,2,2) at 4K: peak / capacity", "Llama-3.1-8B actor training, 16 A100-64GB, fp32 "
     "main grads, micro-batch 2", "(DP,TP,PP) = (4,2,2)", 1.0, "> 1 = OOM", PAPER, paper_422_4k, "check_over"),
    ("paper_441_fits_at_4k", "(4,4,1) at 4K: peak / capacity", "same", "(4,4,1)", 1.0, "<= 1 fits", PAPER,
     paper_441_4k, "check_under"),
    ("paper_422_beats_441_at_2k", "(4,4,1) time / (4,2,2) time at 2K", "same", "both", 1.0, "> 1 = (4,2,2) "
     "faster", PAPER, paper_2k_speedup, "check_over"),
]

# Each anchor sets only the class that dominates it: GEMM from an RL training phase (the regime the
# planner prices), MEMORY_BOUND (weight reads) from decode at concurrency 1. Attention prefill is ~2% of
# the training phase's FLOPs at ~930 tokens per sequence and the KV reads < 1% of the c = 1 decode
# (1,088 tokens x 128 KiB vs 16 GB of weights): neither anchor identifies them, so they keep their priors
# (scaling them with the anchor's factor moved RL generation, where KV reads are a third, to 0.74).
# The weight-read anchor runs vLLM 0.23 (the H100 TPOT rows 0.21, both 2026); NeMo-RL v0.3.0 generated
# with vllm==0.9.0 and v0.4.0 with 0.10.0 (pyproject.toml at those tags): the calibrated 0.735 carries a
# newer engine's decode speed into older engines' phases, which is why RL generation reads ~0.8
# calibrated where the prior (0.6, the same 0.74 c = 1 figure's conservative side) gives 0.87-0.97.
ANCHORS = {"nemo_rl_v03_8b_8_training": (OpClass.GEMM,),
           "vllm_a100_c1": (OpClass.MEMORY_BOUND,)}


def _row(name: str) -> tuple[Any, ...]:
    return next(r for r in ROWS if r[0] == name)


def calibrated(passes: int = 6) -> Efficiencies:
    """One factor per class family from its anchor row, refined a few passes (the anchors share some
    terms: decode has a prefill GEMM, training reads HBM for the optimizer)."""
    eff = Efficiencies()
    for _ in range(passes):
        learned = dict(eff.learned)
        for name, classes in ANCHORS.items():
            row = _row(name)
            pred, _ = row[7](eff)
            # rates scale with efficiency, times inversely
            factor = row[4] / pred if row[8] == "rate" else pred / row[4]
            learned.update({c: min(1.5, eff[c] * factor) for c in classes})
        eff = Efficiencies(learned)
    return eff


def run() -> dict[str, Any]:
    cal = calibrated()
    rows = []
    for name, what, setting, priced, published, unit, source, fn, kind in ROWS:
        pred, extra = fn(PRIORS)
        pred_cal, _ = fn(cal)
        row: dict[str, Any] = {"name": name, "what": what, "setting": setting, "priced_as": priced,
                               "published": published, "unit": unit, "source": source,
                               "predicted_priors": round(pred, 4), "predicted_calibrated": round(pred_cal, 4),
                               **extra}
        if kind in ("time", "rate", "memory"):
            row["ratio_priors"] = round(pred / published, 3)
            row["ratio_calibrated"] = round(pred_cal / published, 3)
            row["anchor"] = name in ANCHORS
        else:
            row["called_as_measured"] = bool(pred > 1.0) if kind == "check_over" else bool(pred <= 1.0)
        rows.append(row)
    out_of_sample = [r["ratio_calibrated"] for r in rows if "ratio_calibrated" in r and not r["anchor"]]
    return {
        "rows": rows,
        "calibrated_efficiencies": {c.value: round(v, 3) for c, v in cal.learned.items()},
        "out_of_sample_calibrated_ratios": {"min": min(out_of_sample), "max": max(out_of_sample),
                                            "within_0.85_1.15": sum(0.85 <= r <= 1.15 for r in out_of_sample),
                                            "count": len(out_of_sample)},
        "paper_example_called_as_measured": all(r.get("called_as_measured", True) for r in rows),
    }


def table(result: dict[str, Any]) -> str:
    lines = ["| row | published | predicted (priors) | ratio | predicted (calibrated) | ratio |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "ratio_priors" in r:
            tag = " (anchor)" if r["anchor"] else ""
            lines.append(f"| {r['name']}{tag} | {r['published']} {r['unit']} | {r['predicted_priors']:.4g} | "
                         f"{r['ratio_priors']} | {r['predicted_calibrated']:.4g} | {r['ratio_calibrated']} |")
        else:
            lines.append(f"| {r['name']} | {r['unit']} | {r['predicted_priors']:.4g} | "
                         f"called: {r['called_as_measured']} | | |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--table", action="store_true", help="print a Markdown table instead of JSON")
    ap.add_argument("--quick", action="store_true", help="the same run (it takes about a second)")
    args = ap.parse_args()
    result = run()
    text = json.dumps(result, indent=2)
    print(table(result) if args.table else text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
