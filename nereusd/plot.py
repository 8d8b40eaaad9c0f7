"""`nereusctl plot JOB --out FILE.png`: a job's run as the daemon recorded it, in one picture.

Four panels over the RL step: step time measured vs predicted (the plan's prediction at that step)
with the transitions marked where they finished (done solid, failed dotted); the GPU pool of the
driver at each step; the response length (mean, p95, max); the reward (mean, +- one std). Drawn from
the admin API's ``measurements`` and ``transitions`` (the store's records), with matplotlib
(the ``sim`` or ``dev`` extra); without it the command fails with one line naming the extra.
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any

MISSING = "nereusctl plot needs matplotlib: pip install 'nereus[sim]' (or pip install matplotlib)"


class PlotError(Exception):
    """Nothing to draw, or no matplotlib (the message is the one line to print)."""


def by_step(measurements: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One measurement per step, the last one (a step re-run after a restore replaces the earlier)."""
    last: dict[int, dict[str, Any]] = {}
    for m in measurements:
        last[int(m["step"])] = m
    return [last[s] for s in sorted(last)]


def transition_steps(measurements: list[dict[str, Any]], transitions: list[dict[str, Any]]) -> list[tuple[float, str]]:
    """(x, state) for every finished transition: just after the last step measured before it ended."""
    steps = sorted(measurements, key=lambda m: float(m["at"]))
    times = [float(m["at"]) for m in steps]
    out = []
    for t in transitions:
        if t.get("state") not in ("done", "failed"):
            continue
        i = bisect.bisect_left(times, float(t["updated_at"]))
        if 0 < i <= len(steps):
            out.append((float(steps[i - 1]["step"]) + 0.5, str(t["state"])))
    return out


def plot_job(job: str, measurements: list[dict[str, Any]], transitions: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError(MISSING) from None
    steps = by_step(measurements)
    if not steps:
        raise PlotError(f"job {job} has no step measurements yet: nothing to plot")
    xs = [int(m["step"]) for m in steps]
    rl = [m.get("rl") or {} for m in steps]

    def col(name: str) -> list[float]:
        return [float("nan") if r.get(name) is None else float(r[name]) for r in rl]

    fig, axes = plt.subplots(4, 1, figsize=(10, 10), sharex=True)
    ax = axes[0]
    ax.plot(xs, [m["step_latency_s"] for m in steps], lw=1.2, label="measured")
    ax.plot(xs, [float("nan") if m.get("predicted_step_s") is None else m["predicted_step_s"] for m in steps],
            lw=1.2, ls="--", label="predicted")
    ax.set_ylabel("step time (s)")
    marks = transition_steps(measurements, transitions)
    for x, state in marks:
        for a in axes:
            a.axvline(x, color="grey" if state == "done" else "red", ls="-" if state == "done" else ":", lw=0.8)
    ax.plot([], [], color="grey", lw=0.8, label="transition")
    ax.legend(loc="upper right", fontsize=8)
    axes[1].step(xs, col("pool_gpus"), where="mid")
    axes[1].set_ylabel("GPU pool")
    for stat, style in (("response_len_mean", "-"), ("response_len_p95", "--"), ("response_len_max", ":")):
        axes[2].plot(xs, col(stat), ls=style, label=stat.rsplit("_", 1)[1])
    axes[2].set_ylabel("response tokens")
    axes[2].legend(loc="upper right", fontsize=8)
    mean, std = col("reward_mean"), col("reward_std")
    axes[3].plot(xs, mean)
    axes[3].fill_between(xs, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.25)
    axes[3].set_ylabel("reward (mean +- std)")
    axes[3].set_xlabel("RL step")
    fig.suptitle(f"nereus job {job}: {len(steps)} steps, {len(marks)} transitions")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
