"""Benchmark of the simulator: wall time, controller passes/s and decisions at 128, 1,024 and 4,096 GPUs. JSON.

    .venv/bin/python bench/simulation.py [--steps 1000] [--sizes 128,1024,4096] [--out FILE] [--quick]

Wall time depends on what else runs on the machine; CPU time (process time) is reported beside it,
with the load average at the start.

Per size: a growth trace like etc/traces/growth_1024.csv scaled to that maximum (the pool doubles from
max/16 every 15% of the steps; responses 500 -> 8,000 tokens), Llama-3.1-8B PPO on MI250X GCDs, the
Nereus policy through the real controller. Reported: wall seconds for the run (goal: <= 60 s for 1,000
steps at 1,024 GPUs on 2 cores), controller passes per second (one pass per RL step, plus retries),
decisions (replans) and their mean/max time, transitions, and resident memory at 10%, at 70% (the
pool has stopped growing) and at the end (flat from 70% on: the simulator keeps no per-step state beyond
one small record per step; what grows before is the plans and DAGs growing with the pool).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the packages first: a bench script named like one must not shadow it

from nereusd.sim.runner import SimJob, simulate  # noqa: E402
from nereusd.sim.trace import Trace, TraceRow  # noqa: E402


def growth_trace(max_gpus: int, steps: int) -> Trace:
    rng = np.random.default_rng(max_gpus)
    first = max(8, max_gpus // 16)
    rows = []
    for i in range(steps):
        gpus = min(max_gpus, first * 2 ** int(i / (0.15 * steps)))
        mean = (500 + 7500 * i / max(1, steps - 1)) * float(np.exp(rng.normal(0, 0.03)))
        rows.append(TraceRow(step=i, gpus=gpus, mean_response_tokens=mean, p95_response_tokens=2 * mean))
    return Trace(name=f"growth-{max_gpus}", rows=tuple(rows))


def _rss_mib() -> float:
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return float("nan")
    return pages * 4096 / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--sizes", default="128,1024,4096")
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true", help="200 steps at 128 and 1,024 GPUs")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.sizes = 200, "128,1024"
    job = SimJob(model="llama-3.1-8b", algo="ppo", device="mi250x", prompts_per_step=1024)
    out = {"steps": args.steps, "job": job.spec(500), "load_average": os.getloadavg(), "sizes": {}}
    for size in (int(s) for s in args.sizes.split(",")):
        rss: dict[str, float] = {}

        def progress(done: int, total: int, rss: dict[str, float] = rss) -> None:
            if done == max(1, total // 10):
                rss["at_10pct_mib"] = _rss_mib()
            if done == max(1, 7 * total // 10):  # the pool stopped growing at 60%: flat from here
                rss["at_70pct_mib"] = _rss_mib()

        r = simulate(growth_trace(size, args.steps), job, policy="nereus", gamma=0.5, seed=0, progress=progress)
        s = r.summary()
        out["sizes"][str(size)] = {
            "wall_s": s["wall_s"], "cpu_s": s["cpu_s"], "controller_passes": s["controller_passes"],
            "controller_passes_per_s": s["controller_passes_per_s"],
            "controller_passes_per_cpu_s": s["controller_passes_per_cpu_s"], "decisions": s["decisions"],
            "decisions_per_s_of_decision_time": (1e3 / s["decision_ms_mean"]) if s["decision_ms_mean"] else None,
            "decision_ms_mean": s["decision_ms_mean"], "decision_ms_max": s["decision_ms_max"],
            "transitions": s["transitions"], "transition_share": s["transition_share"], "ooms": s["ooms"],
            "rss_at_10pct_mib": rss.get("at_10pct_mib"), "rss_at_70pct_mib": rss.get("at_70pct_mib"),
            "rss_end_mib": _rss_mib(),
        }
        print(json.dumps({size: out["sizes"][str(size)]}), file=sys.stderr, flush=True)
    text = json.dumps(out, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
