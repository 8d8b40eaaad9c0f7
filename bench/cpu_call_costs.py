"""Per-call costs of the engine's distributed calls on this machine's CPU workers (2 gloo ranks). JSON.

    .venv/bin/python bench/cpu_call_costs.py [--repeats 200] [--quick]

What the cost model's eager-device classes need and no FLOP or byte count sees (planner.cost,
CPU_CALL_S): a small gloo all-reduce over loopback (a TP all-reduce of one decode step), a
send/recv pair (one pipeline hop), a broadcast of decode logits over a replica, and the extra host
time of one tensor-parallel (DTensor) linear over a plain one. Medians of ``repeats`` calls, both
ranks timed, the slower reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from agent.engine.launch import run_local  # noqa: E402


def median_between_barriers(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    """The median seconds of ``fn`` over ``repeats`` calls, each started together on every rank (a
    barrier before each; 10 untimed calls first)."""
    for _ in range(10):
        fn()
    out = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _rank(rank: int, world: int, repeats: int) -> dict[str, float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    x = torch.randn(16, 256)
    out: dict[str, float] = {"all_reduce_16x256_s": median_between_barriers(lambda: dist.all_reduce(x), repeats)}
    big = torch.randn(16 * 28, 256)
    out["all_reduce_448x256_s"] = median_between_barriers(lambda: dist.all_reduce(big), repeats)
    buf = torch.randn(16, 1, 256)

    def hop() -> None:
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)

    out["send_recv_round_trip_s"] = median_between_barriers(hop, repeats)
    logits = torch.randn(16, 512)
    out["broadcast_16x512_s"] = median_between_barriers(lambda: dist.broadcast(logits, 0), repeats)
    # one column/row linear pair (an MLP) at a decode step's shape, DTensor TP2 vs plain
    mesh = init_device_mesh("cpu", (world,))
    plain = torch.nn.Sequential(torch.nn.Linear(256, 688, bias=False), torch.nn.Linear(688, 256, bias=False))
    tp = torch.nn.Sequential(torch.nn.Linear(256, 688, bias=False), torch.nn.Linear(688, 256, bias=False))
    parallelize_module(tp, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    h = torch.randn(16, 1, 256)
    with torch.no_grad():
        out["plain_linear_pair_s"] = median_between_barriers(lambda: plain(h), repeats)
        out["tp_linear_pair_s"] = median_between_barriers(lambda: tp(h), repeats)
        small = torch.randn(16, 256)
        out["plain_op_s"] = median_between_barriers(lambda: small.mul_(1.0), repeats)
        w = next(tp[0].parameters())  # a DTensor
        out["dtensor_op_s"] = median_between_barriers(lambda: w.mul_(1.0), repeats)
    out.update(_pipeline(rank, world, repeats))
    return out


def _pipeline(rank: int, world: int, repeats: int) -> dict[str, float]:
    """One forward-only GPipe step of one micro-batch over 2 stages (a decode step's hop), less the
    stage's own module time: the schedule's host work and its send/recv."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    mod = torch.nn.Linear(256, 256, bias=False)
    x = torch.randn(16, 1, 256)
    stage = PipelineStage(mod, rank, world, torch.device("cpu"), input_args=x, output_args=x)
    sched = ScheduleGPipe(stage, 1)
    with torch.no_grad():
        step = median_between_barriers(lambda: sched.step(x) if rank == 0 else sched.step(), repeats)
        alone = median_between_barriers(lambda: mod(x), repeats)
    return {"gpipe_step_2_stages_s": step, "gpipe_module_s": alone}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="50 repeats")
    args = ap.parse_args()
    if args.quick:
        args.repeats = 50
    per_rank = run_local(_rank, 2, args.repeats, timeout_s=300)
    res = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
    res["tp_linear_extra_per_linear_s"] = (res["tp_linear_pair_s"] - res["plain_linear_pair_s"]
                                           - res["all_reduce_16x256_s"]) / 2
    res["gpipe_overhead_s"] = res["gpipe_step_2_stages_s"] - 2 * res["gpipe_module_s"]
    print(json.dumps({"bench": "cpu_call_costs", "load": os.getloadavg(),
                      "us": {k: round(v * 1e6, 1) for k, v in res.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
