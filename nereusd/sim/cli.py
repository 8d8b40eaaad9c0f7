"""`nereusctl simulate`: what would this job cost on this cluster, with this availability, under this policy?

    nereusctl simulate --trace etc/traces/drift_8_32.csv --model llama-3.1-8b --algo ppo --device h200 \
        [--gamma 0.5] [--policy nereus|static|any-gain|every:K|restart|oracle ...] [--json] [--plot out.png]

Replays the trace through the real controller on a virtual clock against the ground truth
(nereusd/sim/). Several ``--policy`` may be given (default: nereus and static); a progress bar runs on
stderr; at the end a table per policy (mean step time, throughput in response tokens/s, transitions,
time in transitions, OOMs) and, with ``--plot``, the PNG (needs matplotlib: ``pip install -e '.[sim]'``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from nereusd.sim.report import plot, table
from nereusd.sim.runner import SimJob, simulate
from nereusd.sim.trace import load_trace
from planner.hardware import cluster_preset


def add_parsers(subparsers: Any) -> None:
    p = subparsers.add_parser("simulate", help="replay a trace through the controller against a ground truth",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True, help="CSV: step,gpus,mean_response_tokens,p95_response_tokens[,...]")
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--algo", default="ppo", help="ppo | grpo | remax")
    p.add_argument("--device", default="h200", help="h100 | h200 | a100 | mi250x")
    p.add_argument("--gpus-per-node", type=int, default=None, help="default: the device's usual node")
    p.add_argument("--prompts-per-step", type=int, default=1024)
    p.add_argument("--samples-per-prompt", type=int, default=1)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-response-tokens", type=int, default=None, help="generation cap (default: none)")
    p.add_argument("--gamma", type=float, default=0.5, help="payback gamma of the nereus policy")
    p.add_argument("--policy", action="append", help="nereus | static | any-gain | every:K | restart | oracle")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None, help="replay only the first N rows")
    p.add_argument("--json", action="store_true", help="machine-readable output (summaries and per-step records)")
    p.add_argument("--plot", help="write a PNG of step latency, GPU pool and response length")
    p.set_defaults(handler=run_simulate)


def _progress(label: str) -> Any:
    tty = sys.stderr.isatty()

    def show(done: int, total: int) -> None:
        if not tty and done != total:
            return
        filled = int(30 * done / total)
        sys.stderr.write(f"\r{label:>12} [{'#' * filled}{'.' * (30 - filled)}] {done}/{total}")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return show


def run_simulate(args: argparse.Namespace) -> int:
    per_node = args.gpus_per_node or cluster_preset(args.device, 1024).gpus_per_node
    trace = load_trace(args.trace, gpus_per_node=per_node)
    if args.steps:
        trace = trace.head(args.steps)
    job = SimJob(model=args.model, algo=args.algo, device=args.device, gpus_per_node=per_node,
                 prompts_per_step=args.prompts_per_step, samples_per_prompt=args.samples_per_prompt,
                 prompt_tokens=args.prompt_tokens, max_response_tokens=args.max_response_tokens)
    results = []
    for policy in args.policy or ["nereus", "static"]:
        results.append(simulate(trace, job, policy=policy, gamma=args.gamma, seed=args.seed,
                                progress=_progress(policy)))
    if args.plot:
        out = plot(results, args.plot, title=f"{trace.name}: {args.model} {args.algo} on {args.device}")
        if out is None:
            print("nereusctl: --plot needs matplotlib (pip install -e '.[sim]'); no plot written", file=sys.stderr)
    if args.json:
        print(json.dumps({"trace": trace.name, "job": job.spec(trace.rows[0].mean_response_tokens),
                          "runs": [r.to_dict() for r in results]}, indent=1))
    else:
        print(table(results))
    return 0
