"""Hashes of what transition planning outputs, to show a speed change leaves every output identical.

    .venv/bin/python bench/transition_identity.py [--scenarios 60] [--quick] > hashes.json

Run it on two revisions and compare the JSON (equal documents: identical outputs). Hashed per case:
every DAG node's footprint (bytes allocated, freed, bucket memory, local and per-pair traffic), the
peak bytes, the order and per-GPU node lists, and the DAG's dict form (``TransitionDAG.to_dict``).
Cases: random scenarios (transitions.scenarios, seeded, node losses included) built one after another
on ONE planning cache, as a daemon builds them, so memos filled by earlier cases serve later ones;
bench/transition_dag.py's 8B and 70B plan changes at 1,024 GPUs; and the daemon's decisions of
bench/daemon_path.py (8B and 70B, 120 nodes: new response lengths, node losses, new GPU counts), whose
stored DAG summaries and every node's order part are hashed. ``--quick``: the scenarios only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.errors import InfeasibleError  # noqa: E402
from transitions.global_dag import build_transition  # noqa: E402
from transitions.planning_cache import PlanningCache  # noqa: E402
from transitions.primitives import Footprint  # noqa: E402
from transitions.scenarios import h200_cluster, ppo_plan, random_scenario, stage_states  # noqa: E402


def _digest(doc: Any) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _fp(fp: Footprint) -> list[Any]:
    return [sorted(fp.alloc_bytes.items()), sorted(fp.free_bytes.items()), sorted(fp.buffer_bytes.items()),
            sorted(fp.local_bytes.items()), sorted(fp.pair_bytes.items())]


def dag_hashes(dag: Any) -> dict[str, str]:
    return {"footprints": _digest([_fp(fp) for fp in dag.footprints]),
            "buffers": _digest([sorted(fp.buffer_bytes.items()) for fp in dag.footprints]),
            "peaks": _digest(sorted(dag.peak_bytes.items())), "order": _digest(list(dag.order)),
            "gpu_nodes": _digest(sorted(dag.gpu_nodes.items())), "dict": _digest(dag.to_dict())}


def scenarios(count: int) -> dict[str, Any]:
    cache = PlanningCache()
    out: dict[str, Any] = {}
    for seed in range(count):
        sc = random_scenario(random.Random(seed), loss_probability=0.3)
        try:
            dag = build_transition(sc.states, sc.cluster, sc.old, sc.new, lost_gpus=sc.lost_gpus, cache=cache)
            out[str(seed)] = dag_hashes(dag)
        except (InfeasibleError, ValueError) as e:
            out[str(seed)] = {"error": type(e).__name__, "message": str(e)}
    return out


def bench_changes() -> dict[str, Any]:
    from bench.transition_dag import CHANGES

    out = {}
    for name, (model, old_layouts, new_layouts) in CHANGES.items():
        cache = PlanningCache()
        dag = build_transition(stage_states(model), h200_cluster(1024), ppo_plan(1, 1024, old_layouts),
                               ppo_plan(2, 1024, new_layouts), cache=cache)
        out[name] = dag_hashes(dag)
    return out


def daemon_decisions(model: str, rounds: int) -> dict[str, Any]:
    from bench.daemon_path import DaemonJob
    from nereusd.planning import PlannerBinding

    job = DaemonJob(model, 120, PlannerBinding())
    seen: list[Any] = []

    def record(row: dict[str, Any]) -> None:
        seen.append({"case": row["case"], "admitted": row["admitted"], "orders": row["orders"]})

    orders: list[Any] = []
    sent = job.ctl.send_order

    def send(node: str, order: Any) -> bool:
        orders.append([node, order.model_dump()])
        return sent(node, order)

    job.ctl.send_order = send  # type: ignore[method-assign]
    record(job.place())
    for k in range(rounds):
        record(job.new_length((5200 if k % 2 == 0 else 3000) + 16 * k))
        record(job.lose(f"n{k:04d}"))
        record(job.grow(3))
    rows = [{k: t[k] for k in ("from_version", "to_version", "predicted_s", "bytes_moved", "dag") if k in t}
            for t in job.store.transitions("j", detail=True)]
    return {"decisions": _digest(seen), "orders": _digest(orders), "transitions": _digest(rows),
            "count": len(rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenarios", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="the random scenarios only")
    args = ap.parse_args()
    doc: dict[str, Any] = {"scenarios": scenarios(args.scenarios)}
    if not args.quick:
        doc["bench_changes"] = bench_changes()
        doc["daemon"] = {m: daemon_decisions(m, args.rounds) for m in ("llama-3.1-8b", "llama-3.3-70b")}
    print(json.dumps(doc, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
