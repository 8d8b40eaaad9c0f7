"""Benchmark of the planner: decision time at scale, and plan quality against exhaustive search. JSON.

    .venv/bin/python bench/decisions.py [--out FILE] [--repeats 5] [--quick]

0. Decision as the daemon pays it (the headline; bench/daemon_path.py): nereusd's JobController on a
   SQLite store with the daemon's PlannerBinding, PPO on Llama-3.1-8B and Llama-3.3-70B, 1,024 prompts
   of 1,024 + 3,072 tokens, nodes of 8 H200s around 1,024 GPUs. From the event arriving (a measurement
   with a response length never seen; agents registering: a GPU count never seen; a node lost) to the
   last order ready: trigger, search, admission, the transition DAG with every node's part, the
   decision, plan and transition rows committed (the transition row with its record's head: the
   record's unit-level body, derived by expanding the DAG, is stored after the orders leave and is
   counted in ``median_step_ms``, not in ``median_ms``). Samples interleave the cases and the two jobs
   (medians of ``--repeats``); beside them the first decision of a fresh daemon process on a stored
   job (a new response length), after the daemon's start-up warm-up, whose time (wall and CPU, and
   per step) is reported too: medians of ``--repeats`` fresh processes, each on a copy of one store.
   After those rounds, a job per model on the same daemon whose sequences grow 1.35x per decision
   (``growing-responses``: 2,248 .. 9,845 response tokens), so its targets are plans never planned
   before. The lengths of the interleaved rounds are new but their plans recur (the length swings
   between two plans' ranges), so each row counts the replica-class shapes whose footprints it derived
   (``new_class_shapes``) and each case's ``new_shapes`` gives the samples that derived any: what a
   decision costs when its target is really new. Target <= 30 ms for every case.
1. Search only (secondary): replan (planner.search) + admission (planner.admission.decide, payback rule, with the
   transition time given as an input) for PPO on Llama-3.1-8B and Llama-3.3-70B at 8, 32, 128, 512,
   1,024 and 4,096 H200 GPUs, 1,024 prompts of 1,024 + 4,096 tokens; the running plan is the one chosen
   for 3,072-token responses (a sequence-length drift trigger). Wall and CPU time (CPU time is the
   fairer figure on a shared machine): cold (the first decision on that workload: the option tables'
   per-layout lines are not cached), warm (median and max of ``--repeats`` decisions on the same
   inputs: lines cached, as after a pool change), new workload (warm process, an unseen response
   length each time, as after a drift), and the very first decision of a fresh interpreter at 1,024
   GPUs. Target <= 30 ms at 1,024. Beside them, the walk to the next reachable plan when the best
   plan's DAG does not fit (fallback_to_next_plan: the extra searches of planner.alternatives).
2. Plan quality: settings (models x GPUs x response lengths, GRPO and PPO) small enough for
   planner.exhaustive.exhaustive_search; the gap is (search - exhaustive) / exhaustive on the step latency
   both optimise. Reported: share of settings at the optimum, max and p95 gap, and the gap of the
   planner's full prediction (planner.prediction.predict) of both plans. Targets: >= 90%, max <= 2%.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner import admission  # noqa: E402
from planner.errors import InfeasibleError  # noqa: E402
from planner.exhaustive import exhaustive_search  # noqa: E402
from planner.hardware import cluster_preset  # noqa: E402
from planner.models import model_preset  # noqa: E402
from planner.search import search  # noqa: E402
from planner.workflow import JobSpec, Workload, same_model_job, workflow_preset  # noqa: E402

DECISION_GPUS = (8, 32, 128, 512, 1024, 4096)
QUICK_GPUS = (32, 1024)
DAEMON_NODES = 120  # 960 GPUs at the start; +3 nodes and -1 per round: 984, 976, 1,000, ... 1,048, 1,040
DECISION_MODELS = ("llama-3.1-8b", "llama-3.3-70b")


def _job(algo: str, model: str, prompts: int, samples: int, response: int) -> JobSpec:
    return same_model_job(workflow_preset(algo), model_preset(model),
                          Workload(prompts_per_step=prompts, samples_per_prompt=samples, prompt_tokens=1024,
                                   response_tokens=response))


def _decide(model: str, gpus: int, response: int, current: Any) -> tuple[float, float, Any]:
    """One decision (replan + admission): (wall ms, CPU ms, decision)."""
    cluster = cluster_preset("h200", gpus)
    job = _job("ppo", model, 1024, 1, response)
    current_plan, current_pred = current
    state = admission.initial_state(admission.Observation(step=0, gpu_pool=frozenset(range(gpus)),
                                                          signals={admission.Signal.SEQUENCE_LENGTH: 4096.0}))
    obs = admission.Observation(step=10, gpu_pool=frozenset(range(gpus)),
                                signals={admission.Signal.SEQUENCE_LENGTH: 4096.0 * 1.4})
    t0, c0 = time.perf_counter(), time.process_time()
    _state, trigger = admission.observe(state, obs)
    assert trigger is not None
    dec = admission.decide(trigger=trigger, current_plan=current_plan, current_prediction=current_pred,
                           replan=lambda: search(job, cluster), transition_s=lambda old, new: 10.0)
    return (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3, dec


def decision_time(model: str, gpus: int, repeats: int) -> dict[str, Any]:
    """cold: the first decision on this workload (per-layout lines not cached yet); warm: the same
    inputs again (lines cached: what a replan after a pool change costs); new workload: warm process,
    a response length never seen (what a replan after a sequence-length drift costs)."""
    try:
        cur = search(_job("ppo", model, 1024, 1, 3072), cluster_preset("h200", gpus))
        current: tuple[Any, Any] = (cur.plan, cur.prediction)
    except InfeasibleError:
        current = (None, None)
    cold_ms, cold_cpu, dec = _decide(model, gpus, 4096, current)
    warm = [_decide(model, gpus, 4096, current) for _ in range(repeats)]
    fresh = [_decide(model, gpus, 4096 + 8 * (i + 1), current) for i in range(repeats)]
    times, cpu = [w[0] for w in warm], [w[1] for w in warm]
    latency = None if dec.candidate_prediction is None else dec.candidate_prediction.step_latency_s
    return {"model": model, "gpus": gpus, "median_ms": round(statistics.median(times), 2),
            "max_ms": round(max(times), 2), "median_cpu_ms": round(statistics.median(cpu), 2),
            "min_cpu_ms": round(min(cpu), 2), "cold_ms": round(cold_ms, 2), "cold_cpu_ms": round(cold_cpu, 2),
            "new_workload_median_ms": round(statistics.median(f[0] for f in fresh), 2),
            "new_workload_median_cpu_ms": round(statistics.median(f[1] for f in fresh), 2),
            "verdict": dec.verdict.rule.value, "step_latency_s": latency}


def fallback_time(model: str, gpus: int, repeats: int) -> dict[str, Any]:
    """A decision whose best plan's DAG does not fit (the transition raises for it): admission walks the
    next reachable plans (planner.alternatives) and takes the first. Warm lines, like the warm figures."""
    from planner.alternatives import next_plans

    cluster = cluster_preset("h200", gpus)
    job = _job("ppo", model, 1024, 1, 4096)
    trigger = admission.Trigger(kind=admission.TriggerKind.URGENT, step=1, reasons=("bench",))
    wall, cpu, rank = [], [], 0
    for _ in range(repeats + 1):
        best = search(job, cluster)

        def transition_s(old: Any, new: Any, best: Any = best) -> float:
            if new is best.plan:
                raise InfeasibleError("transition infeasible: the bench's best plan does not fit")
            return 10.0

        def alternatives(error: InfeasibleError | None, best: Any = best) -> Any:
            return next_plans(job, cluster, None, offered=(best.plan,))

        t0, c0 = time.perf_counter(), time.process_time()
        # the running plan: one the new pool cannot hold (as after a shrink), so every candidate moves
        dec = admission.decide(trigger=trigger, current_plan="running", current_prediction=None,
                               replan=lambda: best, transition_s=transition_s,  # noqa: B023 (called at once)
                               alternatives=alternatives)
        wall.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
        rank = max(p.rank for p in dec.passed_over) + 1
    return {"model": model, "gpus": gpus, "median_ms": round(statistics.median(wall[1:]), 2),
            "median_cpu_ms": round(statistics.median(cpu[1:]), 2), "chosen_rank": rank,
            "note": "the replan itself is outside: this is the walk (one more search per plan tried)"}


GROWTH = 1.35  # the growing-responses job: each sequence (prompt + response) this much longer than the last
# (past the 30% drift threshold on the sequence length, so every measurement is a decision)


def daemon_path(repeats: int) -> dict[str, Any]:
    """The controller's path, interleaved: each round, per job, a new response length, a node loss and
    three nodes joining (every GPU count stays new: +24 and -8 per round). Then, per model, a job on the
    same daemon whose responses grow (from 1,400 tokens, each sequence GROWTH times the last: 2,248 ..
    9,845 response tokens in 5 decisions, the drift RL runs see), where each decision's target plan is one the daemon has not planned before; its rows are
    the case ``growing-responses``. Every row counts the replica-class shapes whose footprints it
    derived (``new_class_shapes``); each case's summary gives the samples with new shapes apart."""
    from bench.daemon_path import DaemonJob
    from nereusd.planning import PlannerBinding

    binding = PlannerBinding()
    jobs = {m: DaemonJob(m, DAEMON_NODES, binding) for m in DECISION_MODELS}
    rows: list[dict[str, Any]] = [{"model": m, **job.place()} for m, job in jobs.items()]
    for k in range(repeats):
        for model, job in jobs.items():
            # alternately up and down by > 30% (the drift threshold), and never a length seen before
            length = (5200 if k % 2 == 0 else 3000) + 16 * k
            rows.append({"model": model, "round": k, **job.new_length(length)})
            rows.append({"model": model, "round": k, **job.lose(f"n{k:04d}")})
            rows.append({"model": model, "round": k, **job.grow(3)})
    growing = {m: DaemonJob(m, DAEMON_NODES, binding, response_tokens=1400) for m in DECISION_MODELS}
    for job in growing.values():
        job.place()
    for k in range(repeats):
        for model, job in growing.items():
            row = job.new_length(round((1024 + 1400) * GROWTH ** (k + 1)) - 1024)
            rows.append({"model": model, "round": k, **row, "case": "growing-responses"})
    summary = {}
    for model in DECISION_MODELS:
        for case in ("new-response-length", "node-loss", "new-gpu-count", "growing-responses"):
            got = [r for r in rows if r["model"] == model and r.get("case") == case and "round" in r]
            fresh = [r for r in got if r["new_class_shapes"]]
            summary[f"{model}/{case}"] = {
                "median_ms": round(statistics.median(r["ms"] for r in got), 2),
                "max_ms": round(max(r["ms"] for r in got), 2),
                "median_cpu_ms": round(statistics.median(r["cpu_ms"] for r in got), 2),
                # the whole step: the orders, then the DAG record's unit-level body stored after them
                "median_step_ms": round(statistics.median(r["step_ms"] for r in got), 2),
                "admitted": sum(r["admitted"] for r in got), "samples": len(got),
                # the samples whose decision derived footprints of class shapes new to the daemon
                "new_shapes": {"samples": len(fresh), "median_ms": _median_or_none([r["ms"] for r in fresh]),
                               "median_cpu_ms": _median_or_none([r["cpu_ms"] for r in fresh]),
                               "median_class_shapes": _median_or_none([r["new_class_shapes"] for r in fresh])},
                # every node's "part done" report of the admitted transition, through the controller
                "median_reports_cpu_ms": _median_or_none([r["reports_cpu_ms"] for r in got]),
                "gpus": [r["gpus"] for r in got]}
    return {"summary": summary, "rows": rows}


def _median_or_none(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return round(statistics.median(got), 2) if got else None


def daemon_first_decision(model: str, samples: int = 5) -> dict[str, Any]:
    """A fresh daemon process on a stored, running job: its start-up warm-up, then the first decision
    (a measurement with a new response length). ``samples`` fresh processes, each on its own copy of
    the one placed store (a decision writes to it): medians, and every sample's row."""
    from bench.daemon_path import DaemonJob
    from nereusd.planning import PlannerBinding

    job = DaemonJob(model, 128, PlannerBinding())
    job.place()
    job.store.close()
    # as nereusd starts: imports, the store and the job's controller restored, then the planner's warm-up
    # over the running plans (nereusd.daemon._warm_up_planner) and gc.freeze, then the first decision
    code = ("import json, sys, time, gc; sys.path.insert(0, '.'); from pathlib import Path; "
            "t0 = time.perf_counter(); from bench.daemon_path import DaemonJob; "
            "from nereusd.planning import PlannerBinding; b = PlannerBinding(); "
            f"j = DaemonJob({model!r}, 0, b, Path(sys.argv[1])); t1, c1 = time.perf_counter(), time.process_time(); "
            "running = [(j.ctl._spec_now(), j.ctl.plan)]; new = 'running' in b.warm_up.__code__.co_varnames; "
            "w = b.warm_up(running=running) if new else b.warm_up(); "
            "gc.freeze() if new else None; t2, c2 = time.perf_counter(), time.process_time(); "  # an older daemon froze nothing
            "row = j.new_length(5000); "
            "print(json.dumps({'start_ms': round((t1 - t0) * 1e3, 1), 'warm_up_ms': round((t2 - t1) * 1e3, 1), "
            "'warm_up_cpu_ms': round((c2 - c1) * 1e3, 1), 'warm_up': w, **row}))")
    rows = []
    for k in range(max(1, samples)):
        copy = job.dir.with_name(f"{job.dir.name}-{k}")
        shutil.copytree(job.dir, copy)
        out = subprocess.run([sys.executable, "-c", code, str(copy)], capture_output=True, text=True, check=True,
                             cwd=ROOT)
        shutil.rmtree(copy, ignore_errors=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    shutil.rmtree(job.dir, ignore_errors=True)
    med = {f"median_{k}": round(statistics.median(r[k] for r in rows), 2)
           for k in ("ms", "cpu_ms", "warm_up_ms", "warm_up_cpu_ms")}
    return {"model": model, "samples": len(rows), **med, "rows": rows}


def first_in_process(model: str, gpus: int) -> dict[str, Any]:
    """The very first decision of a fresh interpreter (imports done, every cache and lazy import cold)."""
    code = ("import json, importlib.util as u; "
            f"s = u.spec_from_file_location('bench_planner', {str(Path(__file__).resolve())!r}); "
            "m = u.module_from_spec(s); s.loader.exec_module(m); "
            f"w, c, _d = m._decide({model!r}, {gpus}, 4096, (None, None)); print(json.dumps([w, c]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    wall, cpu = json.loads(out.stdout.strip().splitlines()[-1])
    return {"model": model, "gpus": gpus, "wall_ms": round(wall, 2), "cpu_ms": round(cpu, 2)}


def quality_settings(quick: bool) -> list[tuple[str, str, int, int, int, int]]:
    """(algo, model, prompts, samples, gpus, response tokens)."""
    out = []
    for model in ("llama-3.1-8b", "qwen3-14b", "qwen3-32b"):
        for gpus in (4, 8):
            for response in (1024, 4096, 8192):
                out.append(("grpo", model, 32, 4, gpus, response))
    for response in (1024, 4096, 8192):
        out.append(("ppo", "llama-3.1-8b", 32, 1, 4, response))
        out.append(("ppo", "llama-3.1-8b", 32, 1, 2, response))  # infeasible: both searches must agree
        for gpus in (4, 8):
            out.append(("remax", "llama-3.1-8b", 32, 1, gpus, response))
    return out


def plan_quality(quick: bool) -> dict[str, Any]:
    rows = []
    for algo, model, prompts, samples, gpus, response in quality_settings(quick):
        cluster = cluster_preset("h200", gpus)
        job = _job(algo, model, prompts, samples, response)
        row: dict[str, Any] = {"algo": algo, "model": model, "gpus": gpus, "response_tokens": response}
        try:
            t0 = time.perf_counter()
            ref = exhaustive_search(job, cluster)
            row["exhaustive_s"] = round(time.perf_counter() - t0, 2)
        except InfeasibleError:
            row["infeasible"] = True
            try:
                search(job, cluster)
                row["search_agrees"] = False
            except InfeasibleError:
                row["search_agrees"] = True
            rows.append(row)
            continue
        t0 = time.perf_counter()
        res = search(job, cluster)
        row["search_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
        row["gap"] = (res.objective_s - ref.objective_s) / ref.objective_s
        row["predicted_gap"] = (res.prediction.step_latency_s - ref.prediction.step_latency_s) / \
            ref.prediction.step_latency_s
        row["step_latency_s"] = round(res.objective_s, 3)
        rows.append(row)
    gaps = sorted(r["gap"] for r in rows if "gap" in r)
    p95 = gaps[min(len(gaps) - 1, int(round(0.95 * (len(gaps) - 1))))] if gaps else None
    return {
        "settings": len(rows),
        "feasible_settings": len(gaps),
        "share_optimal": sum(g <= 1e-9 for g in gaps) / len(gaps) if gaps else None,
        "max_gap": max(gaps) if gaps else None,
        "p95_gap": p95,
        "max_predicted_gap": max((r["predicted_gap"] for r in rows if "gap" in r), default=None),
        "infeasible_agreement": all(r.get("search_agrees", True) for r in rows),
        "rows": rows,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="search-only rows at 32 and 1,024 GPUs only")
    args = ap.parse_args()
    t0, c0 = time.perf_counter(), time.process_time()
    path = daemon_path(args.repeats)
    fresh = [daemon_first_decision(m, args.repeats) for m in DECISION_MODELS]
    decisions = [decision_time(m, g, args.repeats) for m in DECISION_MODELS
                 for g in (QUICK_GPUS if args.quick else DECISION_GPUS)]
    at_1024 = [d["median_ms"] for d in decisions if d["gpus"] == 1024]
    cpu_1024 = {k: max((d[k] for d in decisions if d["gpus"] == 1024), default=None)
                for k in ("median_cpu_ms", "cold_cpu_ms", "new_workload_median_cpu_ms")}
    result = {
        "machine": {"cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]},
        "daemon_decision": path["summary"],
        "daemon_decision_max_median_ms": max(v["median_ms"] for v in path["summary"].values()),
        "daemon_first_decision": fresh,
        "daemon_decision_target_ms": 30,
        "daemon_decision_rows": path["rows"],
        "decision_time": decisions,
        "decision_ms_at_1024_gpus_max_of_models": max(at_1024) if at_1024 else None,
        "decision_cpu_ms_at_1024_gpus_max_of_models": cpu_1024,
        "first_decision_in_process": [first_in_process(m, 1024) for m in DECISION_MODELS],
        "fallback_to_next_plan": [fallback_time(m, g, args.repeats) for m in DECISION_MODELS
                                  for g in ((32,) if args.quick else (32, 1024))],
        "decision_target_ms_at_1024": 30,
        "paper_decision_ms": {"32": 0.17, "1024": 338},
        "plan_quality": plan_quality(args.quick),
        "plan_quality_targets": {"share_optimal": 0.9, "max_gap": 0.02},
        "paper_plan_quality": {"share_optimal": 0.611, "max_gap": 0.05, "p95_gap": 0.041},
    }
    result["bench_s"] = {"wall": round(time.perf_counter() - t0, 1), "cpu": round(time.process_time() - c0, 1)}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
