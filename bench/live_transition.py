"""The live job's transitions at the wire's limit, and vs checkpoint/restart, per model size.

On the state the engine trains on (etc/jobs/live.toml's GRPO job, its model swapped per size: the
units bound as the engine's parameters and AdamW moments, a train step after every change), 4
spawned CPU workers (gloo), one chain per sample round: DP grow 2 -> 4 (Extend), DP shrink 4 -> 2,
TP merge, PP merge, TP split (DP2 -> TP2xDP2), with unreported edges between them (local splits
that set up the merges, and moves back to the round's start).

Per case and sample, as ``JobDriver.apply`` pays it (workers' planning caches and the driver's
emptied first: a layout never seen): ``transition_s`` = run_dag as the driver sees it, one command
to every worker (the DAG pickled to each, the engine's views dropped first, the workers' planning,
transfers, local copies, frees, the replies); ``apply_s`` adds the generations, the DAG build and the re-bind
(with the engine's weight sync). Right after each sample, in the same processes:

  wire_s: one batch_isend_irecv of every (src, dst) pair's bytes of the DAG (its footprints'
          pair_bytes) into receive buffers allocated and touched beforehand (warm), slowest worker;
  local_s: per worker, a memcpy of its local bytes (footprints' local_bytes) between warm buffers,
          all workers at once, slowest worker;
  limit_s = wire_s + local_s;  ratio = transition_s / limit_s  (target <= 1.25);
  cold_ratio: the same with the old baseline, receive buffers fresh (torch.empty) as the old
          bench/executor.py measured;
  overhead_s = transition_s - limit_s, and ``phases_s``: the transition split at the workers'
          clocks (``phases``: dispatch, release, planning, the opening barrier, nodes, replies).

Then every reported case's checkpoint/restart twin (bench/live_job.py's ``restart``: DCP save, the
processes exit, new processes, join, DCP load, bind), ``--restart-samples`` of each, interleaved with
the live rounds. Warm pool (transitions.executor.warm_pool) on and off alternate round by round, so
both see the same load: ``pool: off`` is the executor as it was (every new buffer freshly mapped).

Run: ``.venv/bin/python bench/live_transition.py [--models tiny-3m tiny-25m tiny-100m] [--samples 5]``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

_HERE = str(Path(__file__).resolve().parent)
ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(ROOT)] + [p for p in sys.path if str(Path(p or ".").resolve()) not in (_HERE, str(ROOT))]

import torch  # noqa: E402

from agent.coordinator import LocalCoordinator  # noqa: E402
from agent.engine.jobfile import load_job  # noqa: E402
from agent.engine.live import bind, live_cluster, live_dag, release, train_step  # noqa: E402
from agent.engine.loop import RunConfig  # noqa: E402
from bench import live_job as lj  # noqa: E402
from bench.executor import clear_caches  # noqa: E402
from planner.models import ModelSpec, model_preset  # noqa: E402
from planner.plan import GlobalPlan  # noqa: E402

# ~107M parameters (GPT-2-small-like widths); a bench model, not a planner preset
TINY_100M = ModelSpec(name="tiny-100m", num_layers=12, hidden_size=768, num_attention_heads=12, num_kv_heads=4,
                      head_dim=64, ffn_hidden_size=3072, vocab_size=2048, rope_theta=10_000.0)
LAYOUTS = {**lj.LAYOUTS,
           "tp2x2": {"actor-gen": (1, 1, [[0], [1], [2], [3]]), "ref-inf": (1, 1, [[1]]),
                     "actor-train": (2, 1, [[0, 1], [2, 3]])}}
CHAIN = (
    ("DP grow 2->4 (Extend)", "dp2", "dp4"),
    ("DP shrink 4->2 (workers 0, 1 leave)", "dp4", "dp2'"),
    ("(local TP split)", "dp2'", "tp2"),
    ("TP merge (TP2 -> DP2, 2 workers)", "tp2", "dp2'"),
    ("(local PP split)", "dp2'", "pp2"),
    ("PP merge (PP2 -> DP2, 2 workers)", "pp2", "dp2'"),
    ("(move back)", "dp2'", "dp2"),
    ("TP split (DP2 -> TP2xDP2, 4 workers)", "dp2", "tp2x2"),
    ("(merge back)", "tp2x2", "dp2"),
)
REPORTED = tuple(name for name, *_ in CHAIN if not name.startswith("("))
# the cases timed by checkpoint/restart too (each restart costs seconds)
RESTART_CASES = [REPORTED[0], REPORTED[2]]
TIMEOUT_S = lj.TIMEOUT_S
MODES = ["off", "on"]  # the warm pool's, round by round (--pool-on-only: "on" alone)


def model_of(name: str) -> ModelSpec:
    return TINY_100M if name == TINY_100M.name else model_preset(name)


def make_plan(cfg: RunConfig, version: int, layout: str) -> GlobalPlan:
    saved = dict(lj.LAYOUTS)
    lj.LAYOUTS.update(LAYOUTS)
    try:
        return lj.make_plan(cfg, version, layout)
    finally:
        lj.LAYOUTS.clear()
        lj.LAYOUTS.update(saved)


# --- in the workers ---------------------------------------------------------------------------------


def set_pool(ctx: Any, *, nbytes: int) -> int:
    """The worker's warm pool on (``nbytes`` at most) or off (0: every buffer freshly mapped and
    unmapped when freed, as before the pool; what it holds stays aside, unused, for the next round
    on). Returns the bytes it holds."""
    from transitions.executor import warm_pool

    warm_pool.WARM_POOL_BYTES = nbytes
    return warm_pool.POOL.held_bytes


def last_run(ctx: Any) -> dict[str, float]:
    """The worker's spans of its last run_dag (planning, groups, barrier, nodes), where recorded, and
    of its last RunDag command (when it arrived, its ``before``)."""
    import agent.worker
    from transitions.executor import runner

    return dict(getattr(runner, "LAST_RUN", {})) | dict(getattr(agent.worker, "LAST_RUN_DAG", {}))


# instants, not spans: what ``phases`` measures against the driver's start
_INSTANTS = ("started_at", "ended_at", "received_at")


def phases(spans: dict[int, dict[str, float]], start: float, end: float) -> dict[str, float]:
    """Where the driver-seen transition went (seconds; workers' clocks are the host's, as the driver's):
    ``dispatch`` until the last worker had its command (the driver's packing and sends, unpickling);
    ``before`` (the engine's release), ``seed``, ``plan`` (the rest of the planning; ``seed_plan_cpu``
    the CPU time of both, the rest of their span is waiting for a core) and ``early``
    (early builds made before the barrier), each the slowest worker's; ``at_barrier`` when the last
    worker reached the opening barrier; ``nodes`` from there until the last worker's nodes ended;
    ``reply`` from the last worker's end until the driver had every reply."""
    w = spans.values()
    at_barrier = max(s["started_at"] + s["prepare_s"] + s["groups_s"] + s.get("early_s", 0.0) for s in w)
    nodes_end = max(s["ended_at"] - s["destroy_groups_s"] for s in w)
    return {"dispatch": max(s["received_at"] for s in w) - start, "before": max(s["before_s"] for s in w),
            "seed": max(s["seed_s"] for s in w), "plan": max(s["prepare_s"] - s["seed_s"] for s in w),
            "seed_plan_cpu": max(s["prepare_cpu_s"] for s in w), "early": max(s.get("early_s", 0.0) for s in w),
            "at_barrier": at_barrier - start, "nodes": nodes_end - at_barrier,
            "reply": end - max(s["ended_at"] for s in w)}


def settle_pool(ctx: Any) -> None:
    """Wait for the worker's warm pool to finish its refill after the last run (untimed)."""
    from transitions.executor import warm_pool

    warm_pool.POOL.settle()


def pool_stats(ctx: Any) -> dict[str, int]:
    from transitions.executor import warm_pool

    return dataclasses.asdict(warm_pool.POOL.stats) | {"held_bytes": warm_pool.POOL.held_bytes}


CHUNK_BYTES = 256 << 20  # the baselines move and copy in chunks of this size through the same buffers


def pair_exchange(ctx: Any, *, pairs: dict[tuple[int, int], int], warm: bool) -> float:
    """In a worker: every pair's bytes it is part of, in rounds of one batch_isend_irecv per chunk of
    at most CHUNK_BYTES per pair, timed after a barrier. Warm: through buffers allocated and touched
    beforehand (gloo's limit into warm memory); cold: a fresh receive buffer per chunk (torch.empty,
    freshly mapped), as the old bench/executor.py baseline. Chunks bound the bench's own memory."""
    from transitions.channel import P2POp

    mine = {pair: n for pair, n in pairs.items() if ctx.worker_id in pair}
    rounds = max((-(-n // CHUNK_BYTES) for n in mine.values()), default=0)
    size = min(CHUNK_BYTES, max(mine.values(), default=1))
    send = torch.ones(size, dtype=torch.uint8)
    recv = {pair: torch.zeros(size, dtype=torch.uint8) for pair in mine if pair[1] == ctx.worker_id} if warm else {}
    ctx.channel.barrier()
    start = time.perf_counter()
    for r in range(rounds):
        ops = []
        for (src, dst), n in mine.items():
            k = min(CHUNK_BYTES, n - r * CHUNK_BYTES)
            if k <= 0:
                continue
            if src == ctx.worker_id:
                ops.append(P2POp(peer=dst, tensor=send[:k], is_send=True))
            else:
                buf = recv[(src, dst)][:k] if warm else torch.empty(k, dtype=torch.uint8)
                ops.append(P2POp(peer=src, tensor=buf, is_send=False))
        ctx.channel.exchange(ops)
    return time.perf_counter() - start


def memcpy_local(ctx: Any, *, local: dict[int, int]) -> float:
    """A memcpy of this worker's local bytes between warm buffers (chunks of CHUNK_BYTES), timed
    after a barrier, every worker at once."""
    n = local.get(ctx.worker_id, 0)
    size = max(1, min(n, CHUNK_BYTES))
    src = torch.ones(size, dtype=torch.uint8)
    dst = torch.zeros(size, dtype=torch.uint8)
    ctx.channel.barrier()
    start = time.perf_counter()
    done = 0
    while done < n:
        k = min(size, n - done)
        dst[:k].copy_(src[:k])
        done += k
    return time.perf_counter() - start


# --- the driver's side ------------------------------------------------------------------------------


def dag_bytes(dag: Any) -> tuple[dict[tuple[int, int], int], dict[int, int]]:
    pairs: dict[tuple[int, int], int] = defaultdict(int)
    local: dict[int, int] = defaultdict(int)
    for fp in dag.footprints:
        for pair, n in fp.pair_bytes.items():
            pairs[pair] += n
        for g, n in fp.local_bytes.items():
            local[g] += n
    return dict(pairs), dict(local)


def live_sample(pool: LocalCoordinator, cfg: RunConfig, old: GlobalPlan, new: GlobalPlan,
                bind_after: bool = True) -> dict[str, Any]:
    """One change as JobDriver.apply makes it (caches emptied first), then its baselines; without
    ``bind_after`` the engine is not bound on the new plan (the next edge then releases nothing)."""
    from transitions.dag_pieces import DagMemo
    from transitions.executor import IN_PLACE
    from transitions.node_steps import dag_messages

    pool.call(clear_caches)
    lj.clear_local_caches()
    needed = sorted(set(new.gpus) | set(old.gpus))
    t0 = time.perf_counter()
    pool.form_generation(needed)
    t1 = time.perf_counter()
    cluster = live_cluster(cfg, old, new)
    dag = live_dag(cfg, old, new, cluster=cluster)
    t1b = time.perf_counter()
    memo = DagMemo()
    sum(m.num_bytes for m in dag_messages(dag, memo, early=IN_PLACE))  # as JobDriver.apply does
    t2 = time.perf_counter()
    # as JobDriver.apply: the engine's views dropped first, in the same command; each worker sent its
    # share of the steps the driver derived above
    outcome = pool.run_dag(dag, cluster, before=release, derived=memo)
    t4 = time.perf_counter()
    if not outcome.committed:
        raise RuntimeError(f"live transition {old.version} -> {new.version} failed: {outcome.errors}")
    pairs, local = dag_bytes(dag)
    node_s = max(sum(r.measured_s for r in reps) for reps in outcome.reports.values())
    fig: dict[str, Any] = {
        "transition_s": t4 - t2, "dag_build_s": t1b - t1,
        "dag_bytes_s": t2 - t1b,
        "nodes_s": node_s, "wire_bytes": sum(pairs.values()), "local_bytes": sum(local.values()),
        "local_bytes_max_worker": max(local.values(), default=0),
        "executor_copied_bytes": sum(r.bytes_copied_locally for reps in outcome.reports.values() for r in reps),
        "executor_remapped_bytes": sum(r.bytes_remapped for reps in outcome.reports.values() for r in reps),
        # the slowest worker's node time in parts: copies of bytes staying on it, bucket packing, unpacking
        "node_parts_max_s": {k: max(sum(getattr(r, k) for r in reps) for reps in outcome.reports.values())
                             for k in ("local_copy_s", "pack_s", "unpack_s")}}
    spans = pool.call(last_run, workers=needed)
    fig["worker_spans_max_s"] = {k: max(sp.get(k, 0.0) for sp in spans.values()) for k in next(iter(spans.values()))
                                 if k not in _INSTANTS} if all(spans.values()) else {}
    if all("received_at" in sp and "seed_s" in sp for sp in spans.values()):
        fig["phases_s"] = phases(spans, t2, t4)
    # the baselines, right after, between the same processes (the generation of ``needed``); not timed;
    # first the workers' warm pools finish refilling what the run emptied (their thread would slow them)
    pool.call(settle_pool, workers=needed)
    wire = pairs or {(needed[0], needed[1]): 1}
    fig["wire_s"] = max(pool.call(pair_exchange, workers=needed, timeout_s=TIMEOUT_S, pairs=wire, warm=True).values())
    fig["wire_cold_s"] = max(pool.call(pair_exchange, workers=needed, timeout_s=TIMEOUT_S, pairs=wire,
                                       warm=False).values())
    fig["local_s"] = max(pool.call(memcpy_local, workers=needed, timeout_s=TIMEOUT_S, local=local).values())
    if not pairs:
        fig["wire_s"] = fig["wire_cold_s"] = 0.0
    t5 = time.perf_counter()
    if tuple(sorted(new.gpus)) != tuple(needed):
        pool.form_generation(sorted(new.gpus))
    t6 = time.perf_counter()
    if bind_after:
        pool.call(bind, workers=sorted(new.gpus), timeout_s=TIMEOUT_S, collective=True, cfg=cfg, plan=new)
    t7 = time.perf_counter()
    fig.update({"bind_s": t7 - t6, "bound_after": bind_after, "generation_s": (t1 - t0) + (t6 - t5)})
    fig["apply_s"] = (t4 - t0) + (t7 - t5)
    return fig


def rounds(cfg: RunConfig, samples: int, pool_bytes: int, restart_samples: int, train: bool,
           restart_after: bool = False) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """``len(MODES) * samples`` rounds of the chain on one pool, the warm pool on and off in turn (MODES); after each
    round, the next restart twin of every reported case while restart samples remain."""
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {m: {n: [] for n in REPORTED} for m in ("on", "off")}
    restarts: dict[str, list[dict[str, float]]] = {n: [] for n in REPORTED}
    version, step = 1, 0
    workers = [0, 1, 2, 3]
    with LocalCoordinator(len(workers), worker_ids=workers, timeout_s=TIMEOUT_S) as pool:
        plan = make_plan(cfg, version, CHAIN[0][1])
        pool.form_generation(sorted(plan.gpus))
        pool.call(bind, workers=sorted(plan.gpus), timeout_s=TIMEOUT_S, collective=True, cfg=cfg, plan=plan)
        # round 0 warms up, unreported: the processes, and the pool as a running job's would be (it
        # holds what the workers freed in the chain's edges before: on a joining worker, its old units)
        for rnd in range(len(MODES) * samples + 1):
            mode = "warm-up" if rnd == 0 else MODES[(rnd - 1) % len(MODES)]
            pool.call(set_pool, nbytes=0 if mode == "off" else pool_bytes)
            plans: dict[str, tuple[GlobalPlan, GlobalPlan]] = {}
            for i, (name, _, layout) in enumerate(CHAIN):
                version += 1
                new = make_plan(cfg, version, layout)
                # bound where the next edge is reported (its release is real) or its apply is compared
                # with restart (which binds); --no-train: elsewhere not (each bind costs seconds)
                after = CHAIN[(i + 1) % len(CHAIN)][0] in REPORTED or name in RESTART_CASES or train
                fig = live_sample(pool, cfg, plan, new, bind_after=after)
                if train and after:
                    pool.call(train_step, workers=sorted(new.gpus), timeout_s=TIMEOUT_S, collective=True, step=step)
                    step += 1
                if name in REPORTED and mode != "warm-up":
                    raw[mode][name].append(fig)
                    plans[name] = (plan, new)
                    lj.log(f"{cfg.model.name} round {rnd + 1} pool {mode} {name}: {fig['transition_s']:.3f} s "
                           f"(limit {fig['wire_s'] + fig['local_s']:.3f} s, {fig['wire_bytes'] / 1e6:.0f} MB)")
                plan = new
            if mode == "on":
                stats = pool.call(pool_stats)
                raw[mode][REPORTED[0]][-1]["pool_stats"] = stats
            if mode != "warm-up" and not restart_after and len(restarts[RESTART_CASES[0]]) < restart_samples:
                for name, (old, new) in plans.items():
                    if name not in RESTART_CASES:
                        continue
                    restarts[name].append(lj.restart(cfg, old, new, f"r{rnd}"))
                lj.log(f"{cfg.model.name} round {rnd + 1} restarts: "
                       + ", ".join(f"{restarts[n][-1]['restart_s']:.2f}" for n in RESTART_CASES))
    while len(restarts[RESTART_CASES[0]]) < restart_samples:  # the rest (all with --restart-after), the live pool closed
        for name in RESTART_CASES:
            old, new = plans[name]
            restarts[name].append(lj.restart(cfg, old, new, f"x{len(restarts[name])}"))
    raw["restart"] = restarts  # type: ignore[assignment]
    return raw


def summary(raw: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    med = statistics.median
    for name in REPORTED:
        case: dict[str, Any] = {}
        for mode in MODES:
            figs = raw[mode][name]
            ratios = [f["transition_s"] / max(f["wire_s"] + f["local_s"], 1e-9) for f in figs]
            cold = [f["transition_s"] / max(f["wire_cold_s"] + f["local_s"], 1e-9) for f in figs]
            keys = ("transition_s", "apply_s", "run_dag_s", "release_s", "nodes_s", "dag_build_s", "dag_bytes_s",
                    "bind_s", "generation_s", "wire_s", "wire_cold_s", "local_s")
            m = {k: med(f[k] for f in figs if k in f) for k in keys if any(k in f for f in figs)}
            spans = [f["worker_spans_max_s"] for f in figs if f.get("worker_spans_max_s")]
            m["worker_spans_max_s"] = {k: med(sp[k] for sp in spans) for k in spans[0]} if spans else {}
            parts = [f["phases_s"] for f in figs if "phases_s" in f]
            m["phases_s"] = {k: med(p[k] for p in parts) for k in parts[0]} if parts else {}
            case[f"pool {mode}"] = {
                "samples": len(figs), "apply_includes_bind": all(f.get("bound_after", True) for f in figs), "ratio": med(ratios), "cold_ratio": med(cold), **m,
                "limit_s": m["wire_s"] + m["local_s"],
                "overhead_s": med(f["transition_s"] - f["wire_s"] - f["local_s"] for f in figs),
                "wire_GBps": figs[0]["wire_bytes"] / m["wire_s"] / 1e9 if m["wire_s"] else None,
                "transition_share": {"wire": m["wire_s"] / m["transition_s"], "local": m["local_s"] / m["transition_s"],
                                     "overhead": 1 - (m["wire_s"] + m["local_s"]) / m["transition_s"]},
                "apply_share": {"wire": m["wire_s"] / m["apply_s"], "local": m["local_s"] / m["apply_s"],
                                "bind": m["bind_s"] / m["apply_s"],
                                "other_overhead": 1 - (m["wire_s"] + m["local_s"] + m["bind_s"]) / m["apply_s"]},
                "samples_ratio": ratios, "samples_transition_s": [f["transition_s"] for f in figs]}
        f0 = raw["on"][name][0]
        restart_s = [r["restart_s"] for r in raw["restart"][name]]
        on = case["pool on"]
        case.update({
            "wire_bytes": f0["wire_bytes"], "local_bytes": f0["local_bytes"],
            "local_bytes_max_worker": f0["local_bytes_max_worker"],
            "executor_copied_bytes": f0["executor_copied_bytes"], "executor_remapped_bytes": f0["executor_remapped_bytes"],
            "restart_samples": len(restart_s), "restart_s": med(restart_s) if restart_s else None,
            "restart_over_transition": med(restart_s) / on["transition_s"] if restart_s else None,
            "restart_over_apply": med(restart_s) / on["apply_s"] if restart_s else None,
            "restart_over_apply_pool_off": med(restart_s) / case["pool off"]["apply_s"]
            if restart_s and "pool off" in case else None,
            "restart_phases_s_median": {k: med(r[k] for r in raw["restart"][name])
                                        for k in raw["restart"][name][0] if k != "restart_s"} if restart_s else {},
            "samples_restart_s": restart_s})
        out[name] = case
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["tiny-3m", "tiny-25m", "tiny-100m"])
    parser.add_argument("--samples", type=int, default=5, help="rounds per pool mode (interleaved)")
    parser.add_argument("--restart-samples", type=int, default=5)
    parser.add_argument("--pool-gib", type=float, default=8.0, help="the warm pool's bound when on")
    parser.add_argument("--restart-cases", type=int, default=len(RESTART_CASES),
                        help=f"how many of {RESTART_CASES} get restart twins")
    parser.add_argument("--restart-after", action="store_true",
                        help="the restart twins after the live rounds, the live pool closed (memory)")
    parser.add_argument("--no-train", action="store_true", help="no train step between changes")
    parser.add_argument("--quick", action="store_true",
                        help="tiny-3m only, 1 round with the warm pool on, no train steps, 1 restart sample of 1 "
                             "restart case (every reported case still measured: under 50 s of CPU on 2 cores)")
    parser.add_argument("--pool-on-only", action="store_true", help="every round with the warm pool on")
    args = parser.parse_args()
    if args.quick:
        args.models, args.samples, args.restart_samples, args.restart_cases = ["tiny-3m"], 1, 1, 1
        args.pool_on_only = args.no_train = True
    if args.pool_on_only:
        MODES[:] = ["on"]
    base, _ = load_job(str(lj.JOB_FILE))
    del RESTART_CASES[args.restart_cases:]
    torch.set_num_threads(1)
    started = time.perf_counter()
    result: dict[str, Any] = {"benchmark": "live_transition", "cpus": os.cpu_count(), "backend": "gloo",
                              "torch": torch.__version__, "load_average_at_start": os.getloadavg(),
                              "samples_per_mode": args.samples, "models": {}}
    for name in args.models:
        cfg = dataclasses.replace(base, model=model_of(name))
        params = sum(t.numel for t in cfg.model.tensors())
        lj.log(f"{name}: {params / 1e6:.1f} M parameters")
        raw = rounds(cfg, args.samples, int(args.pool_gib * (1 << 30)), args.restart_samples, not args.no_train,
                     args.restart_after)
        result["models"][name] = {"parameters": params, "load_average": os.getloadavg(), "cases": summary(raw),
                                  "pool_stats_last_round": next((f["pool_stats"] for f in reversed(raw["on"][REPORTED[0]])
                                                                 if "pool_stats" in f), None)}
    result["load_average_at_end"] = os.getloadavg()
    result["bench_seconds"] = time.perf_counter() - started
    result["ratios"] = {f"{m} {c} [{mode}]": v[f"pool {mode}"]["ratio"] for m, r in result["models"].items()
                        for c, v in r["cases"].items() for mode in MODES}
    result["ratios"] |= {f"{m} {c}: restart/apply": v["restart_over_apply"] for m, r in result["models"].items()
                         for c, v in r["cases"].items()}
    json.dump(result, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
