"""PPO step time on CPU for a tiny model under several layouts, with the per-model-stage breakdown,
side by side in one run (JSON on stdout).

Every layout runs the same PPO job (actor, reference, critic and a learned reward model, all
``tiny-3m``; 6 model-stages) on 1 or 2 local gloo ranks; each stage's time is the slowest rank's.
Ratios are against the single-process layout. Run: ``python bench/rl_step.py [--steps 3] [--quick]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from agent.engine.launch import run_local  # noqa: E402
from agent.engine.loop import RLLoop, RunConfig, uniform_plan  # noqa: E402
from agent.engine.tasks import SortDigits  # noqa: E402
from planner.models import TINY_3M  # noqa: E402
from planner.plan import Layout  # noqa: E402

CFG = RunConfig(algo="ppo", task=SortDigits(num_digits=12), model=TINY_3M, reward_model=TINY_3M,
                prompts_per_step=16, train_mini_batches_per_step=2, seed=0)
GEN_TP2 = {"actor-gen": (Layout(2, 1), ((0, 1),))}
# name -> (world size, every stage's layout, per-stage overrides)
LAYOUTS: dict[str, tuple[int, Layout, dict]] = {
    "1proc TP1xPP1": (1, Layout(1, 1), {}),
    "DP2 (TP1xPP1 x2)": (2, Layout(1, 1), {}),
    "TP2": (2, Layout(2, 1), {}),
    "PP2": (2, Layout(1, 2), {}),
    "gen TP2, rest PP2": (2, Layout(1, 2), GEN_TP2),
}


def run(rank: int, world: int, name: str, steps: int) -> dict[str, object]:
    _, layout, overrides = LAYOUTS[name]
    loop = RLLoop(CFG, uniform_plan(CFG, layout, tuple(range(world)), overrides=overrides), rank=rank)
    loop.step(0)  # warm-up: pipeline shape set-up, allocator
    out = []
    for s in range(1, steps + 1):
        t0 = time.perf_counter()
        r = loop.step(s)
        out.append({"step_s": time.perf_counter() - t0, "stages": r.stage_seconds,
                    "score": r.mean_score, "response_tokens": r.mean_response_tokens,
                    "sync_sent_bytes": r.sync_sent_bytes, "sync_predicted_s": r.sync_predicted_s,
                    "sync_measured_s": r.sync_measured_s})
    return {"steps": out}


def summarise(name: str, per_rank: list[dict]) -> dict[str, Any]:
    steps = [max(r["steps"][i]["step_s"] for r in per_rank) for i in range(len(per_rank[0]["steps"]))]
    stage_names = per_rank[0]["steps"][0]["stages"].keys()
    stages = {s: statistics.median(max(r["steps"][i]["stages"][s] for r in per_rank)
                                   for i in range(len(steps))) for s in stage_names}
    return {"layout": name, "ranks": len(per_rank), "step_s_median": statistics.median(steps),
            "stage_s_median": {k: round(v, 4) for k, v in stages.items()},
            "mean_response_tokens": per_rank[0]["steps"][-1]["response_tokens"],
            "weight_sync_sent_mb_per_step": round(sum(r["steps"][-1]["sync_sent_bytes"] for r in per_rank) / 1e6, 3),
            # the executor's prediction for the sync vs the slowest rank's measured run (median of steps)
            "weight_sync_predicted_s": round(per_rank[0]["steps"][-1]["sync_predicted_s"], 5),
            "weight_sync_measured_s_median": round(statistics.median(
                max(r["steps"][i]["sync_measured_s"] for r in per_rank) for i in range(len(steps))), 5)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layouts", nargs="*", default=list(LAYOUTS))
    ap.add_argument("--quick", action="store_true",
                    help="2 timed steps of the single-process and TP2 layouts (TP2: 2 real gloo ranks)")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.layouts = 2, [name for name in LAYOUTS if name.startswith(("1proc", "TP2"))]
    rows = []
    for name in args.layouts:
        world = LAYOUTS[name][0]
        if world == 1:
            torch.set_num_threads(1)
            import torch.distributed as dist  # noqa: F401 (single process: no group at all)

            per_rank = [run(0, 1, name, args.steps)]
        else:
            per_rank = run_local(run, world, name, args.steps, timeout_s=600)
        rows.append(summarise(name, per_rank))
    base = rows[0]["step_s_median"]
    for r in rows:
        r["step_s_median"] = round(float(r["step_s_median"]), 4)
        r["vs_" + rows[0]["layout"].split()[0]] = round(float(r["step_s_median"]) / float(base), 2)
    print(json.dumps({"bench": "rl_step", "quick": args.quick, "steps": args.steps, "algo": "ppo", "model": TINY_3M.name,
                      "sequences_per_step": CFG.sequences_per_step,
                      "prompt_tokens": CFG.prompt_tokens, "max_new_tokens": CFG.response_tokens,
                      "threads_per_rank": 1, "results": rows}, indent=1))


if __name__ == "__main__":
    main()
