"""The job driver's per-step RL metrics: one record per step, written where users look for them.

- ``metrics.jsonl`` in the run's folder: one JSON object per step (reward mean/std, KL to the
  reference, entropy, response length mean/p95/max, clip fractions, per-stage times, tokens/s, plan
  version, pool size);
- TensorBoard event files under ``tb/`` in the same folder (``torch.utils.tensorboard``, offline; the
  ``tensorboard`` package writes them): ``tensorboard --logdir runs/``;
- the step's ``protocol.RLMetrics`` for the Measurement the driver sends to the daemon, which exports
  them as Prometheus gauges per job (``nereusd.metrics``).

A step re-run after a restore writes its record again (same step, later ``t``): readers keep the last.
``record_s`` in each record is what writing the previous step's record cost (the step path's overhead).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from nereusd.wire import protocol
from nereusd.wire.logs import get_logger

RL_FIELDS = ("reward_mean", "reward_std", "kl_ref", "entropy", "clip_fraction", "value_clip_fraction",
             "response_len_mean", "response_len_p95", "response_len_max")


def step_record(*, step: int, plan_version: int, pool_gpus: int, workers: list[int], seconds: float,
                stage_seconds: dict[str, float], stats: list[Any]) -> dict[str, Any]:
    """One step's record from every worker's ``LiveStep`` stats (``agent.engine.step_stats``)."""
    from agent.engine.step_stats import combine

    figures = combine(s for s in stats if s is not None) if any(s is not None for s in stats) else {}
    tokens = figures.pop("response_tokens", None) or 0.0
    return {"step": step, "t": time.time(), "plan_version": plan_version, "pool_gpus": pool_gpus,
            "workers": len(workers), "step_s": seconds, "stage_s": dict(stage_seconds),
            "response_tokens": tokens, "tokens_per_s": tokens / seconds if seconds > 0 else 0.0, **figures}


def rl_metrics(record: dict[str, Any]) -> protocol.RLMetrics | None:
    """The record's figures as the wire's RLMetrics (None without rollout stats: nothing to export)."""
    if record.get("reward_mean") is None:
        return None

    def val(name: str) -> float | None:
        v = record.get(name)
        return float(v) if v is not None and math.isfinite(v) else None

    return protocol.RLMetrics(**{k: val(k) for k in RL_FIELDS}, tokens_per_s=float(record["tokens_per_s"]),
                              pool_gpus=int(record["pool_gpus"]))


class MetricsLog:
    """metrics.jsonl and TensorBoard files of one run (``folder``); TensorBoard is skipped, with one
    warning, where the ``tensorboard`` package is missing."""

    def __init__(self, folder: Path, *, tensorboard: bool = True) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / "metrics.jsonl"
        self.log = get_logger("metrics")
        self.writer: Any = None
        self.last_record_s = 0.0
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                self.log.warning("tensorboard-off", error=f"{exc}: pip install tensorboard (metrics.jsonl only)")
            else:
                self.writer = SummaryWriter(log_dir=str(folder / "tb"), flush_secs=10)

    def write(self, record: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        record = {**record, "record_s": self.last_record_s}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            step, w = int(record["step"]), self.writer
            for name in RL_FIELDS + ("tokens_per_s", "response_tokens"):
                if record.get(name) is not None:
                    w.add_scalar(f"rl/{name}", float(record[name]), step)
            w.add_scalar("time/step_s", float(record["step_s"]), step)
            for stage, s in record["stage_s"].items():
                w.add_scalar(f"time/stage/{stage}", float(s), step)
            w.add_scalar("plan/version", float(record["plan_version"]), step)
            w.add_scalar("plan/pool_gpus", float(record["pool_gpus"]), step)
        self.last_record_s = time.perf_counter() - t0

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
