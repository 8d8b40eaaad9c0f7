"""The engine's CLI (``python -m agent.engine.loop``): an RL run on one process or on local gloo
ranks, with a progress line per step while it runs (``agent.engine.progress``)."""

from __future__ import annotations

import argparse
import json

import torch

from agent.engine import loop as _loop
from agent.engine.loop import RLLoop, RunConfig, uniform_plan
from planner.plan import Layout


def _run_rank(rank: int, world: int, cfg: RunConfig, layout: Layout, steps: int,
              show: bool = True) -> list[dict[str, object]]:
    from agent.engine.progress import Progress

    loop = RLLoop(cfg, uniform_plan(cfg, layout, tuple(range(world))), rank=rank)
    out: list[dict[str, object]] = []
    progress = Progress(steps) if show and rank == 0 else None
    for s in range(steps):
        r = loop.step(s)
        if progress is not None:
            progress.update(s, r)
        acc = None if r.mean_accuracy != r.mean_accuracy else round(r.mean_accuracy, 4)  # NaN: no task
        out.append({"step": s, "mean_score": round(r.mean_score, 4), "accuracy": acc,
                    "reward_errors": len(r.reward_errors),
                    "seconds": round(r.seconds, 3),
                    "stage_seconds": {k: round(v, 4) for k, v in r.stage_seconds.items()}})
    return out


def main() -> None:
    from agent.engine.launch import run_local

    ap = argparse.ArgumentParser(prog="python -m agent.engine.loop", description=_loop.__doc__)
    ap.add_argument("--algo", default="grpo", choices=("ppo", "grpo", "remax"))
    ap.add_argument("--job", help="a job file (etc/jobs/*.toml): model, prompts, reward, ...; --algo/--seed ignored")
    ap.add_argument("--steps", type=int, default=None, help="RL steps (default: the job file's, else 5)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--world", type=int, default=1, help="local gloo ranks; replicas fill them (DP)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="print one JSON row per step at the end (stdout)")
    args = ap.parse_args()
    cfg, steps = RunConfig(algo=args.algo, seed=args.seed), 5
    if args.job:
        from agent.engine.jobfile import load_job

        cfg, steps = load_job(args.job)
    steps = args.steps or steps
    torch.manual_seed(cfg.seed)
    layout = Layout(args.tp, args.pp)
    if args.world == 1 and layout.size == 1:
        rows = _run_rank(0, 1, cfg, layout, steps)
    else:
        rows = run_local(_run_rank, args.world, cfg, layout, steps, timeout_s=3600)[0]
    if args.json:
        for row in rows:
            print(json.dumps(row))
