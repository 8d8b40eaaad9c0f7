"""The paper's results reproduced in simulation (nereusd/sim): JSON and PNG per result, under runs/sim/.

    .venv/bin/python bench/sim_results.py [--out runs/sim] [--only drift,growth,spot,calibration] [--seed 0] [--quick]

1. drift: etc/traces/drift_8_32.csv (Llama-3.1-8B PPO, H200): static baseline, Nereus with gamma in
   {0.25, 0.4, 0.5, 0.65, 1.0}, any-gain, switch every 3 steps, oracle. Paper: -27.7% vs static with 2
   transitions; 8.3% better than any-gain, 2.5% better than every-3; gamma = 1: 14 transitions, 939.5 s/step.
2. growth: etc/traces/growth_1024.csv (1,000 steps reaching 1,024 MI250X GCDs): Nereus and static;
   transitions and their share of run time (paper: 6, 49.5 s of 62,353 s = 0.079%), wall time, decisions/s.
3. spot: etc/traces/spot_16.csv (A100, 16 GPUs, 12 changes + 2 node losses): Nereus vs static vs
   checkpoint/restart on every change (throughput in response tokens/s).
4. calibration: the planner's prediction error against the ground truth's expectation on plans it has
   NOT run, after calibrating on the drift trace (paper: mean 4.96%, max 14.61%; goal mean <= 4%, max <= 12%),
   and the running plan's error as steps go by.

Every figure is printed beside the paper's; where they differ the JSON says why (our ground truth, our
cost model). The ground truth's parameters are in nereusd/sim/truth.py with their sources.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the packages first: a bench script named like one must not shadow it

from nereusd.planning import cluster_for, job_spec  # noqa: E402
from nereusd.sim.report import plot, table  # noqa: E402
from nereusd.sim.runner import RunResult, SimJob, save_json, scale_plan, simulate  # noqa: E402
from nereusd.sim.trace import load_trace  # noqa: E402
from nereusd.sim.truth import GroundTruth, StepWorkload  # noqa: E402

TRACES = ROOT / "etc" / "traces"
GAMMAS = (0.25, 0.4, 0.5, 0.65, 1.0)


def _summaries(results: list[RunResult]) -> list[dict[str, Any]]:
    return [r.summary() for r in results]


def drift(out: Path, seed: int) -> dict[str, Any]:
    trace = load_trace(TRACES / "drift_8_32.csv", gpus_per_node=8)
    job = SimJob(model="llama-3.1-8b", algo="ppo", device="h200", prompts_per_step=1024)
    runs = [simulate(trace, job, policy="static", seed=seed)]
    runs += [simulate(trace, job, policy="nereus", gamma=g, seed=seed) for g in GAMMAS]
    runs += [simulate(trace, job, policy=p, seed=seed) for p in ("any-gain", "every:3", "oracle")]
    by = {(r.policy, r.gamma): r.summary() for r in runs}
    nereus, static = by[("nereus", 0.5)], by[("static", None)]
    anyg, every3, oracle = by[("any-gain", None)], by[("every:3", None)], by[("oracle", None)]

    def better(a: dict[str, Any], b: dict[str, Any]) -> float:
        return (b["mean_step_s"] - a["mean_step_s"]) / b["mean_step_s"]

    figures = {
        "nereus_vs_static": {"ours": -better(nereus, static), "paper": -0.277},
        "nereus_transitions": {"ours": nereus["transitions"], "paper": 2},
        "nereus_better_than_any_gain": {"ours": better(nereus, anyg), "paper": 0.083},
        "nereus_better_than_every_3": {"ours": better(nereus, every3), "paper": 0.025},
        "gamma_1_transitions": {"ours": by[("nereus", 1.0)]["transitions"], "paper": 14},
        "gamma_1_mean_step_s": {"ours": by[("nereus", 1.0)]["mean_step_s"], "paper": 939.5},
        "nereus_mean_step_s": {"ours": nereus["mean_step_s"], "paper": 861.9},
        "static_mean_step_s": {"ours": static["mean_step_s"], "paper": 1191.6},
        "nereus_over_oracle": {"ours": nereus["mean_step_s"] / oracle["mean_step_s"] - 1, "paper": None},
        "gamma_sweep": {str(g): {"mean_step_s": by[("nereus", g)]["mean_step_s"],
                                 "transitions": by[("nereus", g)]["transitions"]} for g in GAMMAS},
    }
    # the same trace with a generation cap (8,192 tokens): the planner sizes memory for the cap, so a 30%
    # length drift leaves the running plan feasible and the payback rule (and gamma) decides
    capped_job = dataclasses.replace(job, max_response_tokens=8192)
    capped = [simulate(trace, capped_job, policy="static", seed=seed)]
    capped += [simulate(trace, capped_job, policy="nereus", gamma=g, seed=seed) for g in (0.25, 0.5, 1.0)]
    capped += [simulate(trace, capped_job, policy=p, seed=seed) for p in ("any-gain", "every:3")]
    cby = {(r.policy, r.gamma): r.summary() for r in capped}
    figures["capped_8192"] = {
        "nereus_vs_static": -better(cby[("nereus", 0.5)], cby[("static", None)]),
        "nereus_transitions": cby[("nereus", 0.5)]["transitions"],
        "nereus_better_than_any_gain": better(cby[("nereus", 0.5)], cby[("any-gain", None)]),
        "nereus_better_than_every_3": better(cby[("nereus", 0.5)], cby[("every:3", None)]),
        "gamma_sweep": {str(g): {"mean_step_s": cby[("nereus", g)]["mean_step_s"],
                                 "transitions": cby[("nereus", g)]["transitions"]} for g in (0.25, 0.5, 1.0)},
    }
    why = ("Absolute s/step differ: our workload is 1,024 prompts per step (the paper's batch is not given; its "
           "~860 s steps imply a far larger one) and the ground truth is our own. Uncapped (the main run): the "
           "search fills memory, so every 30% length drift makes the running plan predicted-infeasible and the "
           "replan takes the urgent path; the payback rule never decides, hence gamma, any-gain and Nereus "
           "coincide (paper: gamma = 1 makes 14 transitions). Transitions beyond the 2 pool changes are those "
           "memory-forced replans and OOM-driven ones (the cost model plans for mean lengths, the truth's tail "
           "overflows). every:3 replans 80 times and pays for 65 transitions. With an 8,192-token cap "
           "(capped_8192) plans have slack and payback decides; there one opportunistic move the cost model "
           "predicted to gain was slower in truth, so static wins: the cost model's out-of-sample error "
           "(calibration.json) is larger than the gain it was chasing.")
    data = {"trace": trace.name, "job": job.spec(trace.rows[0].mean_response_tokens), "figures": figures,
            "why_different": why, "runs": _summaries(runs), "runs_capped_8192": _summaries(capped)}
    save_json(out / "drift.json", {**data, "steps": {f"{r.policy}:{r.gamma}": r.to_dict()["steps"] for r in runs}})
    plot([runs[0], runs[3], runs[6], runs[7], runs[8], runs[5]], out / "drift.png",
         title="drift trace: 8 -> 32 H200, 1,147 -> 3,722 tokens (Llama-3.1-8B PPO)")
    print(table(runs))
    print("with an 8,192-token generation cap:")
    print(table(capped))
    return data


def growth(out: Path, seed: int) -> dict[str, Any]:
    trace = load_trace(TRACES / "growth_1024.csv", gpus_per_node=8)
    job = SimJob(model="llama-3.1-8b", algo="ppo", device="mi250x", prompts_per_step=1024)
    t0 = time.perf_counter()
    nereus = simulate(trace, job, policy="nereus", gamma=0.5, seed=seed)
    wall = time.perf_counter() - t0
    static = simulate(trace, job, policy="static", seed=seed)
    s = nereus.summary()
    figures = {
        "transitions": {"ours": s["transitions"], "paper": 6},
        "transition_s": {"ours": s["transition_s"], "paper": 49.5},
        "run_s": {"ours": s["run_s"], "paper": 62353},
        "transition_share": {"ours": s["transition_share"], "paper": 0.00079},
        "nereus_vs_static": {"ours": s["mean_step_s"] / static.summary()["mean_step_s"] - 1, "paper": None},
        "wall_s_1000_steps": {"ours": wall, "goal": 60.0},
        "cpu_s_1000_steps": {"ours": s["cpu_s"], "goal": 60.0},
        "controller_passes_per_s": {"ours": s["controller_passes_per_s"], "paper": None},
        "decisions": {"ours": s["decisions"]},
        "decision_ms_mean": {"ours": s["decision_ms_mean"], "paper_at_1024": 338.0},
        "ooms": {"ours": s["ooms"]},
    }
    why = ("More transitions than the paper's 6: the pool doubles 4 times (4 urgent transitions) and responses "
           "grow 16x, so the 30% length trigger fires ~10 times, each making the memory-full running plan "
           "predicted-infeasible (urgent); OOM-driven replans add a few (the cost model plans for mean lengths). "
           "The share of run time is close to the paper's because our ground-truth transitions take seconds "
           "(EMU reuse, setup + bytes over the fabric) against steps of minutes.")
    data = {"trace": trace.name, "job": job.spec(trace.rows[0].mean_response_tokens), "figures": figures,
            "why_different": why, "runs": _summaries([nereus, static])}
    save_json(out / "growth.json", {**data, "transitions": nereus.transitions,
                                    "steps": {r.policy: r.to_dict()["steps"] for r in (nereus, static)}})
    plot([nereus, static], out / "growth.png", title="1,000 steps reaching 1,024 MI250X GCDs (Llama-3.1-8B PPO)")
    print(table([nereus, static]))
    return data


def spot(out: Path, seed: int) -> dict[str, Any]:
    trace = load_trace(TRACES / "spot_16.csv", gpus_per_node=4)
    # GRPO: PPO's four 8B models do not fit on 8 A100-64GB at all (the planner says so), GRPO's three do
    job = SimJob(model="llama-3.1-8b", algo="grpo", device="a100", gpus_per_node=4, prompts_per_step=512)
    runs = [simulate(trace, job, policy=p, seed=seed) for p in ("nereus", "static", "restart")]
    tput = {r.policy: r.summary()["response_tokens_per_s"] for r in runs}
    figures = {
        "throughput_vs_static": {"ours": tput["nereus"] / tput["static"], "paper": None},
        "throughput_vs_restart": {"ours": tput["nereus"] / tput["restart"], "paper": None},
        "pool_changes": {"ours": trace.pool_changes(), "paper": "> 10 in 10 h"},
    }
    data = {"trace": trace.name, "job": job.spec(trace.rows[0].mean_response_tokens), "figures": figures,
            "runs": _summaries(runs)}
    save_json(out / "spot.json", {**data, "steps": {r.policy: r.to_dict()["steps"] for r in runs}})
    plot(runs, out / "spot.png", title="spot trace: 16 A100 (4 per node), 12 changes + 2 node losses")
    print(table(runs))
    return data


def calibration(out: Path, seed: int) -> dict[str, Any]:
    """Calibrate on the drift trace, then predict plans that run never ran, against the truth's mean."""
    trace = load_trace(TRACES / "drift_8_32.csv", gpus_per_node=8)
    job = SimJob(model="llama-3.1-8b", algo="ppo", device="h200", prompts_per_step=1024)
    run = simulate(trace, job, policy="nereus", gamma=0.5, seed=seed, track_prediction_error=True)
    port = run.port
    used = {json.dumps([(s.model_stage, s.layout.tp, s.layout.pp, s.gpu_sets, s.micro_batch_size)
                        for s in p.stages]) for p in _plans_run(run)}
    samples = []
    # Time is what is tested here, not memory: the OOM knowledge is set aside so plans are not dropped
    # as infeasible (the truth's expectation is taken without its memory check).
    port.tail_ratio, port.memory_derate = 0.0, 1.0
    fresh = type(port)()  # priors only: the "before calibration" figure
    # pools and lengths the run met (8 GPUs at 1.1-1.9k tokens, 16 at 1.9-2.8k, 32 at 2.8-3.7k), and 24 GPUs,
    # a pool it never had
    grid = {8: (1150, 1300, 1450, 1600, 1750, 1900), 16: (1900, 2100, 2300, 2500, 2700, 2900),
            32: (2800, 3000, 3200, 3400, 3600, 3750), 24: (2000, 2800, 3600)}
    for gpus, lengths in grid.items():
        pool = frozenset(range(gpus))
        for resp in lengths:
            spec = job.spec(resp)
            cands = []
            for p in (port, fresh):
                try:
                    cands.append(p.search(spec, pool, 1).plan)
                except Exception:  # noqa: BLE001 - infeasible settings are simply not sampled
                    continue
            for base in list(cands):
                cands += _variants(base, job_spec(spec), gpus)
            truth = GroundTruth(job_spec(spec), cluster_for(spec, pool), seed=seed + 17, drift=False)
            w = StepWorkload(mean_response_tokens=resp, p95_response_tokens=2 * resp)
            for plan in cands:
                key = json.dumps([(s.model_stage, s.layout.tp, s.layout.pp, s.gpu_sets, s.micro_batch_size)
                                  for s in plan.stages])
                if key in used:
                    continue
                used.add(key)
                after = _predict(port, spec, pool, plan)
                before = _predict(fresh, spec, pool, plan)
                if after is None or before is None:
                    continue
                actual = truth.mean_latency(plan, 0, w, draws=8)
                samples.append({"gpus": gpus, "response_tokens": resp, "seen_pool": gpus != 24,
                                "truth_s": actual, "predicted_s": after,
                                "prior_predicted_s": before, "error": abs(after - actual) / actual,
                                "prior_error": abs(before - actual) / actual})
    errs = [s["error"] for s in samples if s["seen_pool"]]
    prior = [s["prior_error"] for s in samples if s["seen_pool"]]
    unseen = [s["error"] for s in samples if not s["seen_pool"]]
    running = [{"step": e["step"], "error": abs(e["predicted_s"] - e["truth_mean_s"]) / e["truth_mean_s"]}
               for e in run.prediction_errors]
    figures = {
        "out_of_sample_plans": {"ours": len(errs), "paper": 72},
        "mean_error_unseen_pool_24": {"ours": _mean(unseen), "plans": len(unseen)},
        "mean_error": {"ours": sum(errs) / len(errs) if errs else None, "paper": 0.0496, "goal": 0.04},
        "max_error": {"ours": max(errs) if errs else None, "paper": 0.1461, "goal": 0.12},
        "mean_error_priors": {"ours": sum(prior) / len(prior) if prior else None},
        "running_plan_error_first_10_steps": {"ours": _mean([r["error"] for r in running[:10]])},
        # efficiencies fitted on one plan predict the next one worse; how fast the fit comes back
        "running_plan_error_10_steps_after_a_transition": {"ours": _mean(
            [r["error"] for r in running for t in run.transitions if t["step"] <= r["step"] < t["step"] + 10])},
        "running_plan_error_30_to_40_steps_after": {"ours": _mean(
            [r["error"] for r in running for t in run.transitions if t["step"] + 30 <= r["step"] < t["step"] + 40])},
        "running_plan_error_last_50_steps": {"ours": _mean([r["error"] for r in running[-50:]])},
    }
    data = {"trace": trace.name, "figures": figures, "samples": samples, "running": running,
            "why_different": ("The efficiencies are fitted from whole-stage times on the plans the job ran; "
                              "plans with other layouts weigh op classes differently, and the ground truth "
                              "has effects the cost model has no term for (long tail, overlap, stragglers), "
                              "so out-of-sample error stays above the running plan's.")}
    save_json(out / "calibration.json", data)
    _plot_calibration(running, samples, out / "calibration.png")
    print(json.dumps(figures, indent=1))
    return data


def _variants(plan: Any, job: Any, gpus: int) -> list[Any]:
    """Plans near ``plan`` that a search would not pick: training micro-batches halved or doubled,
    recomputation switched on, the same layouts on half the pool."""
    import dataclasses

    from planner.plan import GlobalPlan

    out = []
    for change in ("micro", "micro-up", "recompute"):
        stages = []
        for sp in plan.stages:
            if job.workflow.stage(sp.model_stage).kind.value == "training":
                if change == "micro" and sp.micro_batch_size % 2 == 0:
                    sp = dataclasses.replace(sp, micro_batch_size=sp.micro_batch_size // 2, grad_accum=sp.grad_accum * 2)
                elif change == "micro-up" and sp.grad_accum % 2 == 0:
                    sp = dataclasses.replace(sp, micro_batch_size=sp.micro_batch_size * 2, grad_accum=sp.grad_accum // 2)
                elif change == "recompute":
                    sp = dataclasses.replace(sp, recompute=True)
            stages.append(sp)
        out.append(GlobalPlan(version=plan.version, stages=tuple(stages)))
    with contextlib.suppress(Exception):  # layouts that do not fit half the pool
        out.append(scale_plan(plan, gpus, list(range(gpus // 2)), job, plan.version))
    return out


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _predict(port: Any, spec: dict[str, Any], pool: frozenset[int], plan: Any) -> float | None:
    try:
        return float(port.predict_seconds(spec, pool, plan))
    except Exception:  # noqa: BLE001 - a plan the planner cannot evaluate is not sampled
        return None


def _plans_run(run: RunResult) -> list[Any]:
    return list(run.plans_run.values())


def _plot_calibration(running: list[dict[str, float]], samples: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in running]
    err = [100 * r["error"] for r in running]
    roll = [sum(err[max(0, i - 9):i + 1]) / len(err[max(0, i - 9):i + 1]) for i in range(len(err))]
    a.plot(steps, err, ".", ms=3, alpha=0.4, label="per step")
    a.plot(steps, roll, "-", label="10-step mean")
    a.set_xlabel("RL step")
    a.set_ylabel("running plan |error| %")
    a.set_title("calibration on the running plan")
    a.legend()
    b.scatter([s["truth_s"] for s in samples], [s["prior_predicted_s"] for s in samples], s=12, label="priors")
    b.scatter([s["truth_s"] for s in samples], [s["predicted_s"] for s in samples], s=12, label="calibrated")
    hi = max([s["truth_s"] for s in samples] + [1.0])
    b.plot([0, hi], [0, hi], "k--", lw=0.8)
    b.set_xlabel("ground truth s/step")
    b.set_ylabel("predicted s/step")
    b.set_title(f"{len(samples)} plans not run")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "runs" / "sim"))
    ap.add_argument("--only", default="drift,growth,spot,calibration")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="growth only (1,000 steps to 1,024 GCDs: ~20 s of CPU)")
    args = ap.parse_args()
    if args.quick:
        args.only = "growth"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {}
    for name in args.only.split(","):
        t0 = time.perf_counter()
        print(f"== {name}", flush=True)
        data = {"drift": drift, "growth": growth, "spot": spot, "calibration": calibration}[name](out, args.seed)
        summary[name] = {"figures": data["figures"], "wall_s": time.perf_counter() - t0}
    save_json(out / "summary.json", summary)
    print(json.dumps(summary, indent=1, default=str))


if __name__ == "__main__":
    main()
