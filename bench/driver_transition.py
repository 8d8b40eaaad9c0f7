"""The live transition as the driver sees it, TP change on tiny-3m, for ``bench/revisions.py``.

    .venv/bin/python bench/revisions.py --base 532e931 --rounds 4 -- $PWD/bench/driver_transition.py

Runs bench/executor.py's "tp1xdp2->tp2xdp2" change on 4 CPU workers again and again, each time once
with the workers' caches emptied ("cold") and once warm, as bench/executor.py's restart section does,
and prints the medians as one JSON document: ``seconds`` (warm, ``TransitionOutcome.seconds``),
``cold_s``, ``node_s`` (the slowest worker's summed node times) and ``outside_nodes_s`` (the rest:
command, derivation, barrier, reply). It imports bench.executor and the library from the current
directory, so given by absolute path it measures whichever checkout it is run in.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.getcwd())  # the checkout being measured, not this file's

from agent.coordinator import LocalCoordinator  # noqa: E402
from bench import executor as be  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15, help="warm (and as many cold) transitions")
    ap.add_argument("--change", default="tp1xdp2->tp2xdp2", choices=sorted(be.CHANGES))
    ap.add_argument("--quick", action="store_true", help="3 warm and 3 cold transitions")
    args = ap.parse_args()
    if args.quick:
        args.runs = 3
    change = be.Change("tiny-3m", args.change)
    out: dict[str, list[float]] = {"seconds": [], "cold_s": [], "node_s": [], "outside_nodes_s": []}
    with LocalCoordinator(4, timeout_s=120) as pool:
        pool.form_generation()
        for i in range(args.runs + 2):  # the first two pairs warm the processes up
            cold = change.run(pool, "dag", cold=True)
            warm = change.run(pool, "dag")
            assert cold.committed and warm.committed, (cold.errors, warm.errors)
            if i < 2:
                continue
            node_s = max(sum(r.measured_s for r in rs) for rs in warm.reports.values())
            out["seconds"].append(warm.seconds)
            out["cold_s"].append(cold.seconds)
            out["node_s"].append(node_s)
            out["outside_nodes_s"].append(warm.seconds - node_s)
    json.dump({k: statistics.median(v) for k, v in out.items()} | {"runs": args.runs}, sys.stdout)
    print()


if __name__ == "__main__":
    main()
