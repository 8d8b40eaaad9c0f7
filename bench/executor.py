"""Benchmark the live executor; prints one JSON document with side-by-side figures from one run.

1. Throughput: the executor (the transition DAG with in-place building, the same DAG into fresh
   memory, and the geometry plan) vs a raw single-buffer batch_isend_irecv of the same bytes per
   worker pair, between the same processes (ratio = executor throughput / raw; target >= 0.8).
2. EMU transition vs checkpoint/restart for the same change on 4 CPU workers: TP1xDP2 -> TP2xDP2 and
   DP2 -> DP4 (Extend), for each model given. Checkpoint/restart = DCP save, process exit, new
   processes, new world, DCP load (target: >= 100x faster live). Restart has a large fixed part and
   both grow with the state, so the speedup depends on the state size: a fit over the models gives
   the state size up to which the live transition is >= 100x faster on this machine.

Run: ``.venv/bin/python bench/executor.py [--model tiny-25m] [--restart-models tiny-3m tiny-25m] [--quick]``
(CPU, gloo, 4 workers).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

# run as a script, bench/ itself lands first on sys.path, where a script named like a package shadows the
# package (in this process and in every spawned worker, which re-imports this file)
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [p for p in sys.path if str(Path(p or ".").resolve()) != _HERE]

import torch  # noqa: E402

from agent.coordinator import LocalCoordinator  # noqa: E402
from planner.hardware import cluster_preset  # noqa: E402
from planner.models import model_preset  # noqa: E402
from planner.plan import GlobalPlan, Layout, StagePlan  # noqa: E402
from planner.workflow import ACTOR_TRAIN  # noqa: E402
from transitions.global_dag import build_transition  # noqa: E402
from transitions.local_dag import plan_units  # noqa: E402
from transitions.scenarios import stage_states  # noqa: E402
from transitions.transfer_plan import DEFAULT_BUCKET_BYTES  # noqa: E402

NUM_WORKERS = 4
BUCKET_BYTES = [DEFAULT_BUCKET_BYTES]  # --bucket-mib
DEVICE = ["cpu"]  # --device: cpu (gloo) or cuda (NCCL, one GPU per worker)
RATIO = ("throughput_ratio = raw_single_buffer_s / executor_s (same bytes, so = executor GB/s / raw GB/s). "
         "Paths: [dag] the transition DAG as the executor runs it on CPU (a unit cut from one the worker "
         "gives up is built from that unit's pages before the sends that read it, which then send from the "
         "new unit: bytes_remapped changed buffers uncopied); [dag, fresh memory] the "
         "same DAG with every new unit in freshly allocated memory and sends from the old units; [dag, broadcast] an "
         "Extend fan-out run as one broadcast (the default for fan-outs of >= 32 MiB per rank; [dag] forces "
         "point-to-point there). "
         "executor_s: per worker the sum of its nodes' measured_s (the whole transition on that worker: "
         "allocation of new state, packing, transfers, unpacking, local copies), max over workers, min over "
         "repeats. raw_single_buffer_s: one fresh uint8 buffer per (src, dst) pair holding that pair's total "
         "bytes of the transition, all pairs in one batch_isend_irecv between the same 4 processes, max over "
         "workers, min over repeats interleaved with the executor's. *_median: the same with medians. "
         "throughput_ratio_vs_warm_raw: against receive buffers allocated and touched beforehand. "
         "transfer_ratio: executor time without copies of bytes that stay on their worker.")


def global_plan(version: int, tp: int, gpu_sets: list[list[int]]) -> GlobalPlan:
    return GlobalPlan(version=version, stages=(StagePlan(model_stage="actor-train", layout=Layout(tp, 1),
                                                         gpu_sets=tuple(tuple(g) for g in gpu_sets),
                                                         micro_batch_size=1),))


CHANGES = {
    "tp1xdp2->tp2xdp2": ((1, [[0], [1]]), (2, [[0, 1], [2, 3]])),
    "dp2->dp4 (extend)": ((1, [[0], [1]]), (1, [[0], [1], [2], [3]])),
}
# throughput only: one replica feeding three (point-to-point Extends vs one broadcast)
FAN_OUT = {"dp1->dp4 (fan-out)": ((1, [[0]]), (1, [[0], [1], [2], [3]]))}
PATHS = ("dag", "dag, fresh memory")
FAN_OUT_PATHS = ("dag", "dag, broadcast")


class Change:
    """One layout change as a transition DAG, with the state to start from."""

    def __init__(self, model: str, name: str) -> None:
        (tp0, sets0), (tp1, sets1) = {**CHANGES, **FAN_OUT}[name]
        states = stage_states(model_preset(model), (ACTOR_TRAIN,))
        old_plan, new_plan = global_plan(1, tp0, sets0), global_plan(2, tp1, sets1)
        self.cluster = cluster_preset("cpu", NUM_WORKERS)
        self.dag = build_transition(states, self.cluster, old_plan, new_plan)
        self.old_units = [u for sp in old_plan for u in plan_units(states[sp.model_stage], sp, 1)]
        self.new_units = [u for sp in new_plan for u in plan_units(states[sp.model_stage], sp, 2)]

    def dag_pairs(self) -> dict[tuple[int, int], int]:
        out: dict[tuple[int, int], int] = defaultdict(int)
        for fp in self.dag.footprints:
            for pair, n in fp.pair_bytes.items():
                out[pair] += n
        return dict(out)

    def run(self, pool: LocalCoordinator, path: str, cold: bool = False) -> Any:
        """One run from the old state; ``cold``: the workers' planning caches emptied first (a layout
        they have never seen), the processes themselves warm."""
        pool.init_units(self.old_units, seed=1)
        if cold:
            pool.call(clear_caches)
        pool.call(barrier)
        return pool.run_dag(self.dag, self.cluster, max_bucket_bytes=BUCKET_BYTES[0],
                            in_place=path != "dag, fresh memory", fan_out=path == "dag, broadcast")


def raw_exchange(ctx: Any, *, pairs: dict[tuple[int, int], int], warm: bool = False) -> float:
    """In a worker: one buffer per pair it is part of, one batch_isend_irecv, timed. Cold (the
    default): the receive buffer is allocated fresh, as a transition's new state is; warm: buffers
    allocated and touched before the clock starts (pure transport, a stricter baseline)."""
    from transitions.channel import P2POp
    from transitions.executor import warm_pool

    warm_pool.POOL.settle()  # the executor's refill after its last run, done before this baseline
    ops = []
    for (src, dst), n in pairs.items():
        if ctx.worker_id == src:
            ops.append(P2POp(peer=dst, tensor=torch.ones(n, dtype=torch.uint8, device=ctx.device), is_send=True))
        elif ctx.worker_id == dst:
            ops.append(P2POp(peer=src, tensor=torch.zeros(n, dtype=torch.uint8, device=ctx.device) if warm
                             else torch.empty(n, dtype=torch.uint8, device=ctx.device), is_send=False))
    ctx.channel.barrier()
    start = time.perf_counter()
    ctx.channel.exchange(ops)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    return time.perf_counter() - start


def barrier(ctx: Any) -> None:
    ctx.channel.barrier()


def clear_caches(ctx: Any) -> int:
    """Empty every functools cache of the planner and transition modules in this worker, what the
    worker derived from the DAGs it ran (its ``DagMemo``) and the process's default planning cache
    (a DAG received by pickle expands with it)."""
    from transitions.planning_cache import DEFAULT_CACHE

    ctx.memo.clear()
    DEFAULT_CACHE.clear()
    cleared = 2
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(("planner.", "transitions.")):
            continue
        for obj in list(vars(module).values()):
            if callable(getattr(obj, "cache_clear", None)) and getattr(obj, "__module__", "") == name:
                obj.cache_clear()
                cleared += 1
    return cleared


def throughput(pool: LocalCoordinator, model: str, repeats: int, fan_out: bool = True) -> dict[str, Any]:
    """Per change and path: the slowest worker's time in the executor (transfers, packing and local
    copies) vs one raw buffer per pair of the same bytes; min over interleaved repeats (this machine
    is shared, so the least disturbed sample is the comparable one), medians alongside."""
    out: dict[str, Any] = {}
    for name in [*CHANGES, *(FAN_OUT if fan_out else ())]:
        change = Change(model, name)
        for path in FAN_OUT_PATHS if name in FAN_OUT else PATHS:
            pairs = change.dag_pairs()
            total = sum(pairs.values())
            exec_s, moving_s, raw_s, warm_s, predicted = [], [], [], [], 0.0
            pack_s, unpack_s = [], []
            for _ in range(repeats):
                outcome = change.run(pool, path)
                assert outcome.committed, outcome.errors
                exec_s.append(max(sum(r.measured_s for r in reps) for reps in outcome.reports.values()))
                # without the copies of bytes that never leave their worker (the raw path has none)
                moving_s.append(max(sum(r.measured_s - r.local_copy_s for r in reps)
                                    for reps in outcome.reports.values()))
                predicted = max(sum(r.predicted_s for r in reps) for reps in outcome.reports.values())
                pack_s.append(max(sum(r.pack_s for r in reps) for reps in outcome.reports.values()))
                unpack_s.append(max(sum(r.unpack_s for r in reps) for reps in outcome.reports.values()))
                raw_s.append(max(pool.call(raw_exchange, pairs=pairs).values()))
                warm_s.append(max(pool.call(raw_exchange, pairs=pairs, warm=True).values()))
            e, r, w = min(exec_s), min(raw_s), min(warm_s)
            out[f"{name} [{path}]"] = {
                "samples_executor_s": exec_s, "samples_raw_s": raw_s,
                "bytes_moved": total, "pairs": len(pairs), "executor_s": e, "raw_single_buffer_s": r,
                "executor_GBps": total / e / 1e9, "raw_GBps": total / r / 1e9, "throughput_ratio": r / e,
                "throughput_ratio_median": statistics.median(raw_s) / statistics.median(exec_s),
                "executor_without_local_copies_s": min(moving_s), "transfer_ratio": r / min(moving_s),
                "raw_warm_buffers_s": w, "throughput_ratio_vs_warm_raw": w / e,
                "pack_s": min(pack_s), "unpack_s": min(unpack_s),
                "alongside": sorted({f"{x.primitive} with {x.alongside}" for reps in outcome.reports.values()
                                     for x in reps if getattr(x, "alongside", "")}),
                "bytes_copied_locally": max(sum(x.bytes_copied_locally for x in reps)
                                            for reps in outcome.reports.values()),
                "built_in_place": sorted({f"{x.primitive} on worker {w}" for w, reps in outcome.reports.items()
                                         for x in reps if x.in_place}),
                "bytes_remapped": sum(x.bytes_remapped for reps in outcome.reports.values() for x in reps),
                "predicted_L_tran_s": predicted}
    return out


def emu_vs_restart(model: str, repeats: int, changes: tuple[str, ...] = tuple(CHANGES),
                   live: LocalCoordinator | None = None) -> dict[str, Any]:
    """Per change: the live transition (cold caches and warm) vs checkpoint/restart. ``live``: a pool
    to run the live side in (--quick: the throughput's own, a spawn saved) instead of a fresh one; it
    then plays the old processes of the last change's first restart, and is closed by it."""
    out = {}
    for name in changes:
        change = Change(model, name)
        emu_s: list[float] = []
        restart_s: list[float] = []
        phases = []
        warm_s: list[float] = []
        with contextlib.nullcontext(live) if live is not None else \
                LocalCoordinator(NUM_WORKERS, timeout_s=120, device=DEVICE[0]) as pool:
            if live is None:
                pool.form_generation()
            for _ in range(repeats):
                # the whole DAG run as the driver sees it, each worker planning a layout it has not
                # seen (caches emptied); and again with its caches warm from the previous run
                for cold, samples in ((True, emu_s), (False, warm_s)):
                    outcome = change.run(pool, "dag", cold=cold)
                    assert outcome.committed, outcome.errors
                    samples.append(outcome.seconds)
        for i in range(min(repeats, 2)):  # each restart costs seconds: two samples are enough
            with tempfile.TemporaryDirectory(prefix="nereus-bench-") as tmp:
                # the old processes: the live pool itself for the last change's first restart (--quick:
                # four spawns saved; it is done with), else fresh ones
                first = live if live is not None and i == 0 and name == changes[-1] else \
                    LocalCoordinator(NUM_WORKERS, timeout_s=120, device=DEVICE[0])
                if first is not live:
                    first.form_generation()
                first.init_units(change.old_units, seed=2)
                t0 = time.perf_counter()
                first.save_checkpoint(tmp, f"ck{i}")
                t1 = time.perf_counter()
                first.close()  # the old processes exit
                t2 = time.perf_counter()
                second = LocalCoordinator(NUM_WORKERS, timeout_s=120, device=DEVICE[0])  # new processes
                second.form_generation()
                t3 = time.perf_counter()
                second.load_checkpoint(tmp, f"ck{i}", change.new_units)
                t4 = time.perf_counter()
                second.close()
            restart_s.append(t4 - t0)
            phases.append({"save_s": t1 - t0, "exit_s": t2 - t1, "spawn_and_join_s": t3 - t2, "load_s": t4 - t3})
        e, r = min(emu_s), min(restart_s)
        out[name] = {"emu_transition_s": e, "checkpoint_restart_s": r, "speedup": r / e,
                     "speedup_median": statistics.median(restart_s) / statistics.median(emu_s),
                     "restart_phases": phases, "emu_samples_s": emu_s,
                     "emu_with_warm_caches_s": min(warm_s), "speedup_with_warm_caches": r / min(warm_s)}
    return out


def speedup_reach(by_model: dict[str, dict[str, Any]], target: float = 100.0) -> dict[str, Any]:
    """Per change, restart and live time as lines in the state size (a least-squares fit over the
    models), and the state size per replica up to which the live transition is ``target`` x faster."""
    out: dict[str, Any] = {}
    names = {name for per_model in by_model.values() for name in per_model}
    for name in sorted(names):
        points = [(state_bytes(model), per_model[name]) for model, per_model in by_model.items() if name in per_model]
        if len({x for x, _ in points}) < 2:
            continue
        live = _line([(x, f["emu_transition_s"]) for x, f in points])
        restart = _line([(x, f["checkpoint_restart_s"]) for x, f in points])
        # restart(x) >= target * live(x)  <=>  x * (target * d_live - d_restart) <= c_restart - target * c_live
        slope = target * live[1] - restart[1]
        room = restart[0] - target * live[0]
        reach = room / slope if slope > 0 else (math.inf if room >= 0 else 0.0)
        out[name] = {"restart_s": {"fixed": restart[0], "per_GB": restart[1] * 1e9},
                     "live_s": {"fixed": live[0], "per_GB": live[1] * 1e9},
                     f"{target:.0f}x_up_to_state_bytes_per_replica": max(0.0, reach)}
    return out


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - slope * mx, slope


def state_bytes(model: str) -> int:
    """Bytes of one replica's training state: bf16 parameters, fp32 master weights, Adam m and v."""
    return sum(t.numel for t in model_preset(model).tensors()) * (2 + 3 * 4)


def restart_section(models: list[str], repeats: int, changes: tuple[str, ...],
                    live: LocalCoordinator | None = None) -> dict[str, Any]:
    by_model = {}
    for model in models:
        by_model[model] = emu_vs_restart(model, repeats, changes, live)
        print(f"{model}: " + ", ".join(f"{k} {v['speedup']:.0f}x" for k, v in by_model[model].items()),
              file=sys.stderr)
    return {"emu_vs_checkpoint_restart": {model: {"state_bytes_per_replica": state_bytes(model), **figures}
                                          for model, figures in by_model.items()},
            "speedup_vs_state_size": speedup_reach(by_model)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-25m", help="model of the throughput comparison")
    parser.add_argument("--restart-models", nargs="*", default=["tiny-3m", "tiny-25m"],
                        help="models of the EMU vs checkpoint/restart comparison")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-restart", action="store_true", help="throughput figures only")
    parser.add_argument("--bucket-mib", type=float, default=DEFAULT_BUCKET_BYTES / (1 << 20),
                        help="max bucket per pair per round")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: gloo; cuda: NCCL, needs one GPU per worker")
    parser.add_argument("--quick", action="store_true",
                        help="the same real workers and path: 1 repeat, tiny-3m, no fan-out, restart for the TP "
                             "change only, its live side in the throughput's workers")
    args = parser.parse_args()
    if args.quick:
        args.model, args.restart_models, args.repeats = "tiny-3m", ["tiny-3m"], 1
    BUCKET_BYTES[0] = int(args.bucket_mib * (1 << 20))
    DEVICE[0] = args.device
    if args.device == "cuda" and torch.cuda.device_count() < NUM_WORKERS:
        parser.error(f"--device cuda needs {NUM_WORKERS} GPUs (NCCL runs one rank per GPU), "
                     f"this machine has {torch.cuda.device_count()}")
    result: dict[str, Any] = {"ratio": RATIO, "quick": args.quick, "model": args.model, "state_bytes_per_replica": state_bytes(args.model),
                              "workers": NUM_WORKERS, "max_bucket_bytes": BUCKET_BYTES[0],
                              "backend": "nccl" if args.device == "cuda" else "gloo",
                              "torch": torch.__version__, "load_average_at_start": os.getloadavg()[0],
                              "cpus": os.cpu_count()}
    with LocalCoordinator(NUM_WORKERS, timeout_s=120, device=DEVICE[0]) as pool:
        pool.form_generation()
        result["throughput"] = throughput(pool, args.model, args.repeats, fan_out=not args.quick)
        if args.quick and not args.skip_restart:  # its live side in these workers: a spawn saved
            result |= restart_section(args.restart_models, args.repeats, tuple(CHANGES)[:1], live=pool)
    if not args.quick and not args.skip_restart:  # fresh workers, the throughput's gone
        result |= restart_section(args.restart_models, args.repeats, tuple(CHANGES))
    result["load_average_at_end"] = os.getloadavg()[0]
    json.dump(result, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
