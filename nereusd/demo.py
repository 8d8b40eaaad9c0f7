"""`python -m nereusd.demo` (what `make run` runs): the what-if planner on a drifting PPO job.

PPO on Llama-3.1-8B, 32 H200 GPUs, 1,024 prompts per step, while the mean response grows from 1k to
8k tokens (as in the paper's drift traces). For each length: the plan the planner picks, its predicted
step latency, and what a static plan kept all run would cost at that length: the plan chosen for 1k
tokens (it runs out of memory as responses grow) and the plan sized for 8k tokens (safe, but slower on
short responses). Needs no GPU, no Slurm and no daemon.
"""

from __future__ import annotations

import sys
import time

from planner.hardware import ClusterSpec, cluster_preset
from planner.models import model_preset
from planner.plan import GlobalPlan
from planner.prediction import predict
from planner.search import search
from planner.workflow import JobSpec, Workload, same_model_job, workflow_preset

RESPONSE_TOKENS = (1024, 2048, 3072, 4096, 6144, 8192)
SHORT = {"actor-gen": "gen", "ref-inf": "ref", "critic-inf": "cinf", "reward-inf": "rm",
         "actor-train": "atrain", "critic-train": "ctrain"}


def job_at(response_tokens: int) -> JobSpec:
    return same_model_job(workflow_preset("ppo"), model_preset("llama-3.1-8b"),
                          Workload(prompts_per_step=1024, prompt_tokens=1024, response_tokens=response_tokens))


def describe(plan: GlobalPlan) -> str:
    return " ".join(f"{SHORT.get(s.model_stage, s.model_stage)}={s.layout.tp}.{s.layout.pp}x{s.dp}"
                    + ("rc" if s.recompute else "") for s in plan)


def _static(job: JobSpec, cluster: ClusterSpec, plan: GlobalPlan) -> tuple[str, float | None]:
    pred = predict(job, cluster, plan)
    return (f"{pred.step_latency_s:8.1f}", pred.step_latency_s) if pred.feasible else (f"{'OOM':>8}", None)


def main() -> int:
    cluster = cluster_preset("h200", 32)
    print("Nereus what-if: PPO Llama-3.1-8B on 32 x H200, 1,024 prompts x (1,024 prompt + N response tokens)")
    print("plan: model-stage=TP.PPxDP. Static plans kept all run: 'fit 1k' = chosen for 1k-token responses,")
    print("'fit 8k' = sized for the longest (8k); gain = replanning vs 'fit 8k'\n")
    print(f"{'response':>9} {'step s':>8} {'fit 1k':>8} {'fit 8k':>8} {'gain':>5} {'peak GB':>8} {'ms':>5}  plan")
    fit_short = search(job_at(RESPONSE_TOKENS[0]), cluster).plan
    fit_long = search(job_at(RESPONSE_TOKENS[-1]), cluster).plan
    previous = ""
    for n in RESPONSE_TOKENS:
        job = job_at(n)
        t0 = time.perf_counter()
        res = search(job, cluster)
        ms = (time.perf_counter() - t0) * 1e3
        short_txt, _ = _static(job, cluster, fit_short)
        long_txt, long_s = _static(job, cluster, fit_long)
        gain = f"{1 - res.prediction.step_latency_s / long_s:5.0%}" if long_s else f"{'-':>5}"
        now = describe(res.plan)
        print(f"{n:>9} {res.prediction.step_latency_s:8.1f} {short_txt} {long_txt} {gain} "
              f"{res.prediction.max_peak_memory_bytes / 1e9:8.1f} {ms:5.0f}  "
              f"{now if now != previous else '(same plan)'}")
        previous = now
    print("\nTry: nereusctl plan --model llama-3.1-8b --algo ppo --device h200 --gpus 1024 "
          "--prompt-tokens 1024 --response-tokens 4096")
    return 0


if __name__ == "__main__":
    sys.exit(main())
