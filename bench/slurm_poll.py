"""Benchmark of Slurm tracking: one batched poll for all jobs vs asking per job. Prints JSON.

    .venv/bin/python bench/slurm_poll.py [--jobs 32] [--repeats 5] [--synthetic 1024] [--quick]

1. On the real lab cluster (tests/slurm/lab.py; started or joined, needs root): ``--jobs`` jobs are
   submitted, then, side by side in one run, the wall time of
   - one SlurmPoller.refresh (one ``squeue --json`` for all jobs, parsed, filtered, + one sinfo),
   - one ``scontrol -o show job -d ID`` per job (the per-job alternative that honours filters),
   - one ``squeue --json`` per job (what a per-job poller costs when 22.05 ignores -j).
   Median over ``--repeats``; ratios per_job / batched.
2. Pure parsing at scale: ``--synthetic`` job entries built from a captured real entry
   (tests/slurm/reference/squeue.json), parsed and filtered by a poller watching all of them.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "slurm"))

from lab import LabUnavailable, SlurmLab  # noqa: E402

from nereusd.slurm.commands import SlurmCommands  # noqa: E402
from nereusd.slurm.poller import SlurmPoller, parse_squeue_job  # noqa: E402


def _median_s(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def real_cluster(n_jobs: int, repeats: int) -> dict[str, Any]:
    lab = SlurmLab.acquire(log=lambda _msg: None)
    try:
        with lab.exclusive():
            ids = [lab.sbatch("-N", "1", "-J", f"bench-{i}") for i in range(n_jobs)]
            cmds = SlurmCommands(timeout_s=30, env=lab.env)
            poller = SlurmPoller(cmds)
            for job in ids:
                poller.watch(job)
            poller.refresh(force=True)
            batched = _median_s(lambda: poller.refresh(force=True), repeats)
            per_job_scontrol = _median_s(lambda: [cmds.show_job(j) for j in ids], repeats)
            per_job_squeue = _median_s(lambda: [cmds.squeue_json() for _ in ids], repeats)
            known = sum(poller.info(j) is not None for j in ids)
    finally:
        lab.release()
    return {"jobs": n_jobs, "jobs_seen_by_poller": known, "batched_refresh_s": round(batched, 4),
            "per_job_scontrol_s": round(per_job_scontrol, 4), "per_job_squeue_s": round(per_job_squeue, 4),
            "ratio_scontrol_per_job_over_batched": round(per_job_scontrol / batched, 1),
            "ratio_squeue_per_job_over_batched": round(per_job_squeue / batched, 1)}


def synthetic(n_jobs: int, repeats: int) -> dict[str, Any]:
    sample = json.loads((ROOT / "tests" / "slurm" / "reference" / "squeue.json").read_text())
    template = next(j for j in sample["jobs"] if j["job_state"] == "RUNNING")
    jobs = []
    for i in range(n_jobs):
        entry = copy.deepcopy(template)
        entry["job_id"] = 100000 + i
        jobs.append(entry)
    payload = {"jobs": jobs}

    class _Canned(SlurmCommands):
        def squeue_json(self) -> dict[str, Any] | None:
            return payload

        def sinfo_json(self) -> dict[str, Any] | None:
            return {"nodes": []}

    poller = SlurmPoller(_Canned())
    for i in range(n_jobs):
        poller.watch(str(100000 + i))
    parse = _median_s(lambda: [parse_squeue_job(j) for j in jobs], repeats)
    refresh = _median_s(lambda: poller.refresh(force=True), repeats)
    return {"synthetic_jobs": n_jobs, "parse_all_s": round(parse, 4), "refresh_all_s": round(refresh, 4),
            "refresh_per_job_us": round(refresh / n_jobs * 1e6, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--synthetic", type=int, default=1024)
    p.add_argument("--quick", action="store_true", help="8 real jobs, 3 repeats; the 1,024 synthetic ones kept")
    args = p.parse_args()
    if args.quick:
        args.jobs, args.repeats = 8, 3
    out: dict[str, Any] = {"quick": args.quick, "synthetic": synthetic(args.synthetic, args.repeats)}
    try:
        out["real_cluster"] = real_cluster(args.jobs, args.repeats)
    except LabUnavailable as exc:
        out["real_cluster"] = {"skipped": str(exc)}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
