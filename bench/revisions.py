"""Run one benchmark on two revisions of this repository, interleaved, and compare them as ratios.

    .venv/bin/python bench/revisions.py --base 532e931 --rounds 2 \
        --keys 'throughput_ratio$|executor_s$|speedup$' -- bench/executor.py --repeats 3

Each round runs the benchmark once on the base revision (a detached git worktree made for the run)
and once on the working tree, alternating which goes first, so both see the same machine load. The
benchmark must print one JSON document; every numeric leaf whose dotted path matches ``--keys`` is
reported per revision (every sample, and the median) with the ratio ``head / base`` of the medians.
Both revisions run with this interpreter; each benchmark puts its own checkout first on sys.path, so
each runs its own code (the JSON says which files each imported). Prints JSON on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def leaves(doc: Any, prefix: str = "") -> dict[str, float]:
    """Every numeric leaf of a JSON document by its dotted path (list items by index)."""
    out: dict[str, float] = {}
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, bool):
            continue
        if isinstance(value, int | float):
            out[path] = float(value)
        else:
            out.update(leaves(value, path))
    return out


def run_bench(checkout: Path, argv: list[str], timeout_s: float) -> dict[str, Any]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *argv], cwd=checkout, capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, "PYTHONPATH": str(checkout)})
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed in {checkout} (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    doc = json.loads(proc.stdout)
    doc["_wall_s"] = time.perf_counter() - start
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="the revision to compare against (any git rev)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved runs per revision")
    ap.add_argument("--keys", default=".", help="regex over the dotted paths of the figures to compare")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="bound on one benchmark run")
    ap.add_argument("--quick", action="store_true", help="1 round per revision (give the benchmark its own --quick)")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- then the benchmark script and its arguments")
    args = ap.parse_args()
    if args.quick:
        args.rounds = 1
    argv = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    if not argv:
        ap.error("name the benchmark after --, e.g. -- bench/executor.py --repeats 3")
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    base_rev = subprocess.run(["git", "rev-parse", args.base], cwd=ROOT, capture_output=True, text=True)
    if base_rev.returncode != 0:
        ap.error(f"--base {args.base!r} is not a revision of this repository: {base_rev.stderr.strip()}")
    head_rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    pattern = re.compile(args.keys)
    samples: dict[str, dict[str, list[float]]] = {"base": {}, "head": {}}
    with tempfile.TemporaryDirectory(prefix="nereus-base-") as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base), base_rev.stdout.strip()],
                       cwd=ROOT, check=True)
        try:
            for i in range(args.rounds):
                order = [("base", base), ("head", ROOT)] if i % 2 == 0 else [("head", ROOT), ("base", base)]
                for label, checkout in order:
                    print(f"round {i + 1}/{args.rounds}: {label}", file=sys.stderr)
                    for path, value in leaves(run_bench(checkout, argv, args.timeout_s)).items():
                        if pattern.search(path):
                            samples[label].setdefault(path, []).append(value)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=False)
    figures = {}
    for path in sorted(set(samples["base"]) & set(samples["head"])):
        b, h = statistics.median(samples["base"][path]), statistics.median(samples["head"][path])
        figures[path] = {"base": samples["base"][path], "head": samples["head"][path],
                         "head_over_base": h / b if b else None}
    json.dump({"bench": argv, "base": base_rev.stdout.strip(), "head": head_rev, "rounds": args.rounds,
               "ratio": "head_over_base = median(head) / median(base)",
               "only_in_base": sorted(set(samples["base"]) - set(samples["head"])),
               "only_in_head": sorted(set(samples["head"]) - set(samples["base"])), "figures": figures},
              sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
