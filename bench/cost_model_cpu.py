"""Out-of-sample check of the calibrated cost model on the live CPU engine. JSON.

    .venv/bin/python bench/cost_model_cpu.py --measure [--rounds 3 --steps 3] [--save FILE]
    .venv/bin/python bench/cost_model_cpu.py FILE [--anchor "1proc TP1xPP1"]
    .venv/bin/python bench/cost_model_cpu.py --quick | --collective-chain

``--measure`` runs bench/rl_step.py's layouts itself, interleaved (every layout once per round), so
that the layouts share the machine's load: on 2 cores shared with other sessions the same layout's
step swung 2-3x minutes apart, and layouts measured one after another then compare loads, not
layouts. Each round's times are scaled by that round's anchor-layout step against the anchor's median
(ratios side by side), and the stage times are medians over rounds of the rounds' median steps. A
FILE is rl_step.py's JSON (or a saved one).

bench/rl_step.py measures one PPO job (tiny-3m for every role) under several layouts on local gloo
ranks. This calibrates the planner's efficiencies on the ANCHOR layout's measured model-stage times
only (planner.calibration.fit_from_stage_times, as the daemon does each step), then predicts every
other layout's model-stage times and step time, which it never saw, and reports the errors (the
paper: mean 4.96%, max 14.61% over 72 plans; issue 16's target: mean 4%, max 12%). ``leave_one_out``
does the same with every other layout as calibration data (the stage sums: weight-sync, no
model-stage, is left out of both sides).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import dataclasses  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

from agent.engine.loop import uniform_plan  # noqa: E402
from bench.rl_step import CFG, LAYOUTS  # noqa: E402
from planner.calibration import fit_from_stage_times  # noqa: E402
from planner.cost import Efficiencies  # noqa: E402
from planner.hardware import cluster_preset  # noqa: E402
from planner.plan import GlobalPlan, StagePlan  # noqa: E402
from planner.prediction import predict  # noqa: E402
from planner.workflow import (  # noqa: E402
    StageKind,  # noqa: E402
    Workload,
    same_model_job,
)


def _job():  # type: ignore[no-untyped-def]
    w = Workload(prompts_per_step=CFG.prompts_per_step, samples_per_prompt=CFG.samples_per_prompt,
                 prompt_tokens=CFG.prompt_tokens, response_tokens=CFG.response_tokens,
                 train_mini_batches_per_step=CFG.train_mini_batches_per_step)
    # the engine trains on the rollout's behaviour log-probs: no old-log-prob pass (agent/engine/loop.py)
    wf = CFG.workflow
    wf = dataclasses.replace(wf, model_stages=tuple(dataclasses.replace(ms, old_logprob_pass=False)
                                                    for ms in wf.model_stages))
    return same_model_job(wf, CFG.model, w)


def _plan(name: str) -> GlobalPlan:
    """The layout's plan as the engine runs it: generation decodes every row of a replica as one wave
    (agent/engine/loop.py _generate), inference runs the rows in micro-batches of ``micro_batch_size``
    (all of them: uniform_plan leaves grad_accum at 1 for non-training stages, which under PP would
    price half the rows)."""
    world, layout, overrides = LAYOUTS[name]
    plan = uniform_plan(CFG, layout, tuple(range(world)), overrides=overrides)
    stages = []
    for sp in plan:
        ms = CFG.workflow.stage(sp.model_stage)
        if ms.kind is not StageKind.TRAINING:
            rows = (CFG.sequences_per_step if not ms.greedy else CFG.prompts_per_step) // sp.dp
            b, g = (rows, 1) if ms.kind is StageKind.GENERATION else (sp.micro_batch_size, rows // sp.micro_batch_size)
            sp = StagePlan(model_stage=sp.model_stage, layout=sp.layout, gpu_sets=sp.gpu_sets, micro_batch_size=b,
                           grad_accum=g, recompute=sp.recompute)
        stages.append(sp)
    return GlobalPlan(version=plan.version, stages=tuple(stages))


def _chain_rank(rank: int, world: int, repeats: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    from bench.cpu_call_costs import median_between_barriers

    x, small = torch.randn(16, 256), torch.randn(16, 256)
    got = {"plain_op_s": median_between_barriers(lambda: small.mul_(1.0), repeats),
           "all_reduce_median_s": median_between_barriers(lambda: dist.all_reduce(x), repeats)}
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(repeats):
        small.mul_(1.0)
        dist.all_reduce(x)
    got["all_reduce_chained_mean_s"] = (time.perf_counter() - t0) / repeats - got["plain_op_s"]
    return got


def collective_chain(repeats: int = 300) -> dict[str, Any]:
    """What planner.eager.COLLECTIVE_LAUNCHES prices: a small gloo all-reduce (a TP2 layer's, 16 x 256)
    on 2 ranks as the median between barriers and as the mean in a chain (one plain op between calls,
    as a pass issues them); the slower rank's figures, in us and in plain-op units past the link's two
    hops (planner.hardware.LOOPBACK)."""
    from agent.engine.launch import run_local
    from planner.hardware import LOOPBACK

    load = os.getloadavg()[0]
    ranks = run_local(_chain_rank, 2, repeats, timeout_s=300)
    got = {k: max(r[k] for r in ranks) for k in ranks[0]}
    hops = 2 * LOOPBACK.latency_s
    return {"load_1min": round(load, 2), **{k: round(v * 1e6, 1) for k, v in got.items()},
            "chained_over_median": round(got["all_reduce_chained_mean_s"] / got["all_reduce_median_s"], 2),
            "launch_units_median": round((got["all_reduce_median_s"] - hops) / got["plain_op_s"], 1),
            "launch_units_chained": round((got["all_reduce_chained_mean_s"] - hops) / got["plain_op_s"], 1)}


def measure(rounds: int, steps: int, layouts: list[str] | None = None) -> list[dict[str, Any]]:
    """Every layout of bench/rl_step.py once per round, interleaved; stage times: median over rounds of
    each round's median step (rl_step.summarise)."""
    import torch

    from agent.engine.launch import run_local
    from bench.rl_step import run as run_layout
    from bench.rl_step import summarise

    names = layouts or list(LAYOUTS)
    per: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    loads = []
    for _ in range(rounds):
        for name in names:
            world = LAYOUTS[name][0]
            loads.append(os.getloadavg()[0])
            if world == 1:
                torch.set_num_threads(1)
                per_rank = [run_layout(0, 1, name, steps)]
            else:
                per_rank = run_local(run_layout, world, name, steps, timeout_s=600)
            per[name].append(summarise(name, per_rank))
            print(f"round {len(per[name])}/{rounds} {name}: step {per[name][-1]['step_s_median']:.3f} s, "
                  f"load {loads[-1]:.1f}", file=sys.stderr, flush=True)
    # the machine's load drifts within minutes: each round's times are scaled by the anchor (the first
    # layout) of the same round against its median, so the layouts compare at one load
    anchor = [float(r["step_s_median"]) for r in per[names[0]]]
    scale = [statistics.median(anchor) / a for a in anchor]
    out = []
    for name, rs in per.items():
        stages = {k: round(statistics.median(r["stage_s_median"][k] * f for r, f in zip(rs, scale)), 4)
                  for k in rs[0]["stage_s_median"]}
        out.append({"layout": name, "rounds": len(rs),
                    "step_s_median": statistics.median(float(r["step_s_median"]) * f for r, f in zip(rs, scale)),
                    "stage_s_median": stages,
                    "step_s_rounds_raw": [round(float(r["step_s_median"]), 4) for r in rs]})
    out[0]["load_1min"] = {"min": min(loads), "max": max(loads)}
    return out


def run(rows: list[dict[str, Any]], anchor: str, passes: int = 8) -> dict[str, Any]:
    job, cluster = _job(), cluster_preset("cpu", 2)
    by_name = {r["layout"]: r for r in rows}
    eff: Efficiencies | None = None
    for _ in range(passes):  # the daemon refits every step on the running plan's measured stage times
        eff = fit_from_stage_times(job, _plan(anchor), by_name[anchor]["stage_s_median"], eff, cluster=cluster)
    assert eff is not None
    out = []
    for name, r in by_name.items():
        p = predict(job, cluster, _plan(name), eff)
        measured_stages = sum(r["stage_s_median"].values())
        stage_err = {k: round((p.stage_seconds[k] - v) / v, 3) for k, v in r["stage_s_median"].items()
                     if k in p.stage_seconds and v > 0}
        out.append({"layout": name, "anchor": name == anchor, "measured_step_s": r["step_s_median"],
                    "measured_stage_sum_s": round(measured_stages, 4), "predicted_step_s": round(p.step_latency_s, 4),
                    "error_vs_stage_sum": round((p.step_latency_s - measured_stages) / measured_stages, 3),
                    "error_vs_step": round((p.step_latency_s - r["step_s_median"]) / r["step_s_median"], 3),
                    "stage_errors": stage_err})
    oos = [abs(o["error_vs_stage_sum"]) for o in out if not o["anchor"]]
    return {"anchor": anchor, "calibrated_efficiencies": {c.value: round(v, 4) for c, v in eff.learned.items()},
            "plans": out, "out_of_sample": {"count": len(oos), "mean_abs_error": round(statistics.mean(oos), 3)
                                            if oos else None, "max_abs_error": round(max(oos), 3) if oos else None}}


def leave_one_out(rows: list[dict[str, Any]], rounds: int = 4) -> dict[str, Any]:
    """Each layout predicted by a model calibrated on every OTHER layout's measured model-stage times
    (fed in turn, ``rounds`` times, as a daemon that ran those plans one after another would see them)."""
    job, cluster = _job(), cluster_preset("cpu", 2)
    by_name = {r["layout"]: r for r in rows}
    out = []
    for held, r in by_name.items():
        eff: Efficiencies | None = None
        for _ in range(rounds):
            for name, other in by_name.items():
                if name != held:
                    eff = fit_from_stage_times(job, _plan(name), other["stage_s_median"], eff, cluster=cluster)
        assert eff is not None
        p = predict(job, cluster, _plan(held), eff)
        measured = sum(v for k, v in r["stage_s_median"].items() if k in p.stage_seconds)
        predicted = sum(p.stage_seconds[k] for k in r["stage_s_median"] if k in p.stage_seconds)
        out.append({"held_out": held, "measured_stage_sum_s": round(measured, 4), "predicted_stage_sum_s": round(predicted, 4),
                    "error": round(predicted / measured - 1, 3),
                    "stage_errors": {k: round(p.stage_seconds[k] / v - 1, 3) for k, v in r["stage_s_median"].items()
                                     if k in p.stage_seconds and v > 0}})
    errs = [abs(o["error"]) for o in out]
    return {"plans": out, "mean_abs_error": round(statistics.mean(errs), 3), "max_abs_error": round(max(errs), 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rl_step_json", type=Path, nargs="?")
    ap.add_argument("--anchor", default="1proc TP1xPP1")
    ap.add_argument("--measure", action="store_true", help="measure the layouts here, interleaved")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--save", type=Path, default=None, help="write the measured rows (rl_step.py's format)")
    ap.add_argument("--quick", action="store_true",
                    help="measure 1 round of 1 step of the anchor, TP2 and PP2 (under 50 s of CPU)")
    ap.add_argument("--collective-chain", action="store_true",
                    help="only measure what COLLECTIVE_LAUNCHES prices (collective_chain)")
    args = ap.parse_args()
    if args.collective_chain:
        print(json.dumps(collective_chain(100 if args.quick else 300), indent=2))
        return 0
    layouts = None
    if args.quick:
        args.measure, args.rounds, args.steps = True, 1, 1
        layouts = [args.anchor, "TP2", "PP2"]
    if args.measure:
        rows = measure(args.rounds, args.steps, layouts)
        if args.save:
            args.save.write_text(json.dumps({"bench": "cost_model_cpu", "results": rows}, indent=1) + "\n")
    elif args.rl_step_json is not None:
        rows = json.loads(args.rl_step_json.read_text())["results"]
    else:
        ap.error("give rl_step.py's JSON or --measure")
    print(json.dumps({**run(rows, args.anchor), "leave_one_out": leave_one_out(rows)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
