"""Tables and plots of simulation runs (matplotlib is optional: ``pip install -e '.[sim]'``).

The plot has three panels sharing the step axis: step latency per policy (a 5-step rolling mean, with
each policy's transitions marked), the GPU pool, and the mean response length.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from nereusd.sim.runner import RunResult

COLUMNS = (("policy", "policy", "{}"), ("gamma", "gamma", "{}"), ("mean_step_s", "mean step s", "{:.2f}"),
           ("response_tokens_per_s", "resp tok/s", "{:.1f}"), ("transitions", "transitions", "{}"),
           ("transition_s", "in transitions s", "{:.1f}"), ("ooms", "OOMs", "{}"), ("lost_s", "lost s", "{:.0f}"))


def table(results: Sequence[RunResult]) -> str:
    rows = [[h for _, h, _ in COLUMNS]]
    for r in results:
        s = r.summary()
        rows.append([fmt.format(s[k]) if s[k] is not None else "-" for k, _, fmt in COLUMNS])
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows)


def label(r: RunResult) -> str:
    return f"{r.policy} (gamma {r.gamma:g})" if r.gamma is not None else r.policy


def plot(results: Sequence[RunResult], path: str | Path, title: str = "") -> Path | None:
    """Write the PNG; returns None (and writes nothing) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(10, 8), sharex=True,
                                        gridspec_kw={"height_ratios": [3, 1, 1]})
    for r in results:
        steps = [x.step for x in r.steps]
        total = [x.step_s + x.transition_s + x.lost_s for x in r.steps]
        smooth = [sum(total[max(0, i - 4):i + 1]) / len(total[max(0, i - 4):i + 1]) for i in range(len(total))]
        line, = ax1.plot(steps, smooth, lw=1.2, label=f"{label(r)}: {r.summary()['mean_step_s']:.1f} s/step")
        marks = [t["step"] for t in r.transitions]
        if marks and len(marks) <= 200:
            ax1.plot(marks, [smooth[min(m, len(smooth) - 1)] for m in marks], "v", color=line.get_color(), ms=5)
    ax1.set_ylabel("step latency, s (5-step mean)\n(v: transition)")
    ax1.set_yscale("log")
    ax1.legend(fontsize=7, loc="upper left")
    ax1.set_title(title)
    r0 = results[0]
    ax2.step([x.step for x in r0.steps], [x.gpus for x in r0.steps], where="post", color="k")
    ax2.set_ylabel("GPUs")
    ax3.plot([x.step for x in r0.steps], [x.response_tokens for x in r0.steps], color="tab:gray")
    ax3.set_ylabel("mean response\ntokens")
    ax3.set_xlabel("RL step")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
