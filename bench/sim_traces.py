"""Write the simulation traces in etc/traces/ from the paper's descriptions (seeded: same output every run).

    .venv/bin/python bench/sim_traces.py [--out etc/traces]

- drift_8_32.csv: the drift trace (PAPER.md): mean response 1,147 -> 3,722 tokens while the pool grows
  8 -> 16 -> 32 GPUs (H200 nodes of 8), 240 steps;
- growth_1024.csv: 1,000 steps reaching 1,024 GPUs (MI250X GCDs, 8 per node): the pool doubles from 64
  every 150 steps and responses grow 500 -> 8,000 tokens (PAPER.md: "500 -> 8,000 within 1,000 steps");
- spot_16.csv: a 16-GPU job (A100, 4 per node) on spot capacity for ~10 h with 12 availability changes
  (PAPER.md: "> 10 availability changes for a 16-GPU job in 10 h") among 8, 12 and 16 GPUs, and 2 abrupt
  node losses;
- smoke.csv: 30 steps on 8 -> 16 GPUs, for tests.

Response lengths: the mean follows the description with 3% step-to-step noise; p95 = 2x the mean (RL
rollouts are right-skewed; DAPO and verl length histograms put p95 at ~1.7-2.5x the mean).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the packages first: a bench script named like one must not shadow it

from nereusd.sim.trace import TraceRow, format_trace  # noqa: E402

P95_OVER_MEAN = 2.0


def _rows(gpus: list[int], mean: np.ndarray, rng: np.random.Generator,
          losses: frozenset[int] | set[int] = frozenset()) -> list[TraceRow]:
    noisy = mean * np.exp(rng.normal(0.0, 0.03, len(mean)))
    return [TraceRow(step=i, gpus=g, mean_response_tokens=float(m), p95_response_tokens=float(m * P95_OVER_MEAN),
                     node_loss=i in losses) for i, (g, m) in enumerate(zip(gpus, noisy))]


def drift(rng: np.random.Generator) -> list[TraceRow]:
    n = 240
    gpus = [8 if i < 80 else 16 if i < 160 else 32 for i in range(n)]
    return _rows(gpus, np.linspace(1147, 3722, n), rng)


def growth(rng: np.random.Generator) -> list[TraceRow]:
    n = 1000
    gpus = [min(1024, 64 * 2 ** (i // 150)) for i in range(n)]
    # length grows fastest early on (as RL length curves do), 500 -> 8,000
    mean = 500 + 7500 * (1 - np.exp(-np.arange(n) / 350)) / (1 - np.exp(-(n - 1) / 350))
    return _rows(gpus, mean, rng)


def spot(rng: np.random.Generator) -> list[TraceRow]:
    n = 600  # ~60 s per step -> ~10 h
    levels = [16, 12, 16, 8, 12, 16, 12, 8, 16, 12, 16, 8, 16]
    cuts = sorted(rng.choice(np.arange(20, n - 20), size=len(levels) - 1, replace=False))
    gpus = []
    for i in range(n):
        gpus.append(levels[int(np.searchsorted(cuts, i, side="right"))])
    # abrupt losses only where a node can be spared (the job needs 8 GPUs to fit at all)
    spare = np.array([i for i in range(30, n - 30) if gpus[i] >= 12])
    losses = {int(x) for x in rng.choice(spare, size=2, replace=False)}
    for s in sorted(losses):  # an abrupt loss leaves one node fewer until the next change
        end = next((c for c in cuts if c > s), n)
        for i in range(s + 1, end):
            gpus[i] = gpus[s] - 4
    return _rows(gpus, np.linspace(1000, 2000, n), rng, losses)


def smoke(rng: np.random.Generator) -> list[TraceRow]:
    n = 30
    gpus = [8 if i < 15 else 16 for i in range(n)]
    return _rows(gpus, np.linspace(400, 900, n), rng)


TRACES = {
    "drift_8_32.csv": (drift, "drift trace: mean response 1,147 -> 3,722 tokens, 8 -> 32 GPUs (PAPER.md)"),
    "growth_1024.csv": (growth, "1,000 steps reaching 1,024 GPUs, responses 500 -> 8,000 tokens (PAPER.md)"),
    "spot_16.csv": (spot, "16-GPU job on spot capacity, ~10 h, 12 changes + 2 abrupt node losses (PAPER.md)"),
    "smoke.csv": (smoke, "30 steps, 8 -> 16 GPUs, for tests"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="etc/traces")
    ap.add_argument("--quick", action="store_true", help="the same traces (writing them takes under a second)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for i, (name, (make, what)) in enumerate(TRACES.items()):
        rows = make(np.random.default_rng(1000 + i))
        (out / name).write_text(format_trace(rows, (what, "written by bench/sim_traces.py (seeded); p95 = 2 x mean")))
        print(f"{out / name}: {len(rows)} rows")


if __name__ == "__main__":
    main()
