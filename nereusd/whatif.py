"""`nereusctl plan`: the what-if planner, with no daemon and no GPU.

    nereusctl plan --model llama-3.1-8b --algo ppo --device h200 --gpus 1024 \
        --prompt-tokens 1024 --response-tokens 4096 [--json]
    nereusctl plan JOB [--json]      # a running job's plan from the daemon, predicted vs measured

Prints the plan the planner would choose (per model-stage: TP, PP, DP, GPUs, micro-batch x
accumulation), the predicted step latency with per-stage times, and per-GPU peak memory. Exit codes
(nereusd.ctl): 0 ok, 1 infeasible (which model-stage, how many bytes over), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from planner.errors import SpecError
from planner.hardware import cluster_preset
from planner.models import model_preset
from planner.search import SearchResult, search
from planner.workflow import JobSpec, Workload, same_model_job, workflow_preset

GB = 1e9


def add_parsers(subparsers: Any) -> None:
    p = subparsers.add_parser("plan", help="what-if: the plan Nereus would choose for a job",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("job", nargs="?", help="a running job: show its plan from the daemon instead (same as job-plan)")
    p.add_argument("--model", help="model preset, e.g. llama-3.1-8b (required for a what-if)")
    p.add_argument("--algo", default="ppo", help="ppo | grpo | remax")
    p.add_argument("--device", default="h200", help="h100 | h200 | a100 | mi250x | cpu")
    p.add_argument("--gpus", type=int, help="GPUs in the pool (required for a what-if)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="default: the device's usual node")
    p.add_argument("--prompt-tokens", type=int, default=1024, help="mean prompt length")
    p.add_argument("--response-tokens", type=int, help="mean generated length (required for a what-if)")
    p.add_argument("--prompts-per-step", type=int, default=1024)
    p.add_argument("--samples-per-prompt", type=int, default=1)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    daemon = p.add_argument_group("with JOB: reaching the daemon")
    daemon.add_argument("--endpoint", help="admin endpoint, tcp://HOST:PORT (default: endpoints.json)")
    daemon.add_argument("--state-dir", help="daemon state dir holding endpoints.json (default /var/lib/nereus)")
    daemon.add_argument("--keys", help="admin key bundle directory (default ~/.config/nereus/admin)")
    daemon.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the daemon")
    p.set_defaults(handler=run_plan)


def build_job(args: argparse.Namespace) -> JobSpec:
    workload = Workload(prompts_per_step=args.prompts_per_step, samples_per_prompt=args.samples_per_prompt,
                        prompt_tokens=args.prompt_tokens, response_tokens=args.response_tokens)
    return same_model_job(workflow_preset(args.algo), model_preset(args.model), workload)


def gpu_ranges(gpus: frozenset[int] | set[int]) -> str:
    """'0-7,16-23': compact text for a GPU set."""
    runs: list[list[int]] = []
    for g in sorted(gpus):
        if runs and g == runs[-1][1] + 1:
            runs[-1][1] = g
        else:
            runs.append([g, g])
    return ",".join(f"{a}-{b}" if b != a else f"{a}" for a, b in runs)


def result_dict(job: JobSpec, res: SearchResult, header: dict[str, Any]) -> dict[str, Any]:
    pred = res.prediction
    stages = []
    for sp in res.plan:
        stages.append({
            "model_stage": sp.model_stage, "tp": sp.layout.tp, "pp": sp.layout.pp, "dp": sp.dp,
            "num_gpus": len(sp.gpus), "gpus": gpu_ranges(sp.gpus), "micro_batch_size": sp.micro_batch_size,
            "grad_accum": sp.grad_accum, "recompute": sp.recompute,
            "seconds": pred.stage_seconds[sp.model_stage], "start_s": pred.stage_start_s[sp.model_stage],
            "peak_memory_bytes": pred.memory[sp.model_stage].total_bytes,
            "memory": pred.memory[sp.model_stage].as_dict(),
            "breakdown_s": dict(pred.breakdown[sp.model_stage]),
        })
    return {**header, "stages": stages, "step_latency_s": pred.step_latency_s,
            "kind_seconds": dict(pred.kind_seconds), "max_peak_memory_bytes": pred.max_peak_memory_bytes,
            "memory_capacity_bytes": pred.memory_capacity_bytes,
            "candidates_considered": res.candidates_considered, "frontier_sizes": dict(res.frontier_sizes),
            "urgent_options": res.urgent_options}


def format_table(d: dict[str, Any]) -> str:
    lines = [f"{d['algo'].upper()} {d['model']} on {d['gpus']} x {d['device']} ({d['nodes']} nodes x "
             f"{d['gpus_per_node']}): {d['sequences_per_step']} sequences/step, "
             f"{d['prompt_tokens']} + {d['response_tokens']} tokens", ""]
    head = f"{'model-stage':<18}{'layout':<10}{'DP':>5}  {'GPUs':<14}{'mb x acc':>11}{'seconds':>10}" \
           f"{'start':>9}{'peak/GPU':>11}  top terms"
    lines += [head, "-" * len(head)]
    for s in d["stages"]:
        top = sorted(s["breakdown_s"].items(), key=lambda kv: -kv[1])[:2]
        terms = ", ".join(f"{k} {v:.2f}s" for k, v in top)
        layout = f"TP{s['tp']}xPP{s['pp']}" + ("+rc" if s["recompute"] else "")
        lines.append(f"{s['model_stage']:<18}{layout:<10}{s['dp']:>5}  {s['gpus']:<14}"
                     f"{str(s['micro_batch_size']) + ' x ' + str(s['grad_accum']):>11}{s['seconds']:>10.2f}"
                     f"{s['start_s']:>9.2f}{s['peak_memory_bytes'] / GB:>8.1f} GB  {terms}")
    kinds = ", ".join(f"{k} {v:.2f} s" for k, v in d["kind_seconds"].items())
    peak, cap = d["max_peak_memory_bytes"], d["memory_capacity_bytes"]
    lines += ["", f"predicted step latency: {d['step_latency_s']:.2f} s ({kinds})",
              f"peak memory per GPU: {peak / GB:.1f} GB of {cap / GB:.0f} GB ({peak / cap:.0%}, 10% headroom "
              f"included)",
              f"search: {d['candidates_considered']} candidates, {d['decision_ms']:.1f} ms"
              + ("; urgent options (recomputation / cross-node TP) were needed" if d["urgent_options"] else "")]
    return "\n".join(lines)


def run_plan(args: argparse.Namespace) -> int:
    if args.job is not None:
        from nereusd import admin_cli

        return admin_cli.job_plan(args)
    missing = [flag for flag, value in (("--model", args.model), ("--gpus", args.gpus),
                                        ("--response-tokens", args.response_tokens)) if value is None]
    if missing:
        raise SpecError("plan", f"a what-if needs {', '.join(missing)}",
                        "nereusctl plan --model M --gpus N --response-tokens T ..., or nereusctl plan JOB")
    if args.gpus < 1:
        raise SpecError("gpus", f"must be >= 1, got {args.gpus}")
    cluster = cluster_preset(args.device, args.gpus, args.gpus_per_node)
    job = build_job(args)
    t0 = time.perf_counter()
    res = search(job, cluster)
    ms = (time.perf_counter() - t0) * 1e3
    header = {"model": job.models[job.workflow.roles[0]].name, "algo": job.workflow.name,
              "device": cluster.device.name, "gpus": cluster.num_gpus, "nodes": cluster.num_nodes,
              "gpus_per_node": cluster.gpus_per_node, "sequences_per_step": job.workload.sequences_per_step,
              "prompt_tokens": job.workload.prompt_tokens, "response_tokens": job.workload.response_tokens,
              "decision_ms": ms}
    d = result_dict(job, res, header)
    print(json.dumps(d, indent=2) if args.json else format_table(d))
    return 0
