"""What the per-step RL metrics cost on the step path (JSON on stdout).

Three pieces, each against what runs without it, in interleaved samples (medians):
- the losses' tallies (``agent.engine.losses.LossStats``: clip, entropy, KL under no_grad), as the
  actor loss's forward + backward with and without them, on logits of a tiny and of a 32k-vocabulary
  model's micro-batch;
- the driver's record (``agent.metrics``): merging the workers' stats, metrics.jsonl and TensorBoard,
  and the wire's RLMetrics;
- the whole RL step of the tiny-byte GRPO job, for scale.

Run: ``python bench/rl_metrics.py [--repeats 15]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from agent.engine.losses import ActorLoss, kl_k3, pack, policy_loss, token_logprobs  # noqa: E402
from agent.engine.step_stats import rollout_stats  # noqa: E402
from agent.metrics import MetricsLog, rl_metrics, step_record  # noqa: E402


class PlainActorLoss:
    """The actor loss without the tallies (what it was before them)."""

    def __init__(self, clip: float, kl_coef: float) -> None:
        self.clip, self.kl_coef = clip, kl_coef

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        next_token, old_logp, adv, ref_logp, weight = target.unbind(-1)
        logp = token_logprobs(logits, next_token.long())
        return policy_loss(logp, old_logp, adv, weight, self.clip) + self.kl_coef * (kl_k3(logp, ref_logp) * weight).sum()


def _loss_case(b: int, t: int, v: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(b, t, v, generator=g)
    nxt = torch.randint(0, v, (b, t), generator=g)
    old = torch.log_softmax(logits, -1).gather(-1, nxt[..., None])[..., 0] + 0.05 * torch.randn(b, t, generator=g)
    return logits, pack(nxt, old, torch.randn(b, t, generator=g), old - 0.01, torch.full((b, t), 1.0 / (b * t)))


def _time(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_loss(b: int, t: int, v: int, repeats: int) -> dict[str, Any]:
    logits, target = _loss_case(b, t, v)

    def run(loss: Any) -> None:
        x = logits.clone().requires_grad_(True)
        loss(x, target).backward()

    plain, tallied = [], []
    for _ in range(repeats):  # interleaved
        plain.append(_time(lambda: run(PlainActorLoss(0.2, 0.01))))
        tallied.append(_time(lambda: run(ActorLoss(clip=0.2, kl_coef=0.01))))
    p, q = statistics.median(plain), statistics.median(tallied)
    return {"shape": [b, t, v], "plain_ms": round(p * 1e3, 3), "tallied_ms": round(q * 1e3, 3),
            "ratio": round(q / p, 3), "extra_ms": round((q - p) * 1e3, 3),
            "ratio_of_minima": round(min(tallied) / min(plain), 3)}  # a loaded machine's noise is one-sided


def bench_record(repeats: int) -> dict[str, Any]:
    scores, mask = torch.rand(64), (torch.rand(64, 32) > 0.1).float()
    stats = [rollout_stats(scores, mask, actor={"weight": 0.5, "clipped": 0.01, "entropy": 1.2, "kl": 0.003})] * 4
    with tempfile.TemporaryDirectory() as d:
        log = MetricsLog(Path(d))
        samples = []
        for step in range(repeats * 4):
            def one(step: int = step) -> None:
                rec = step_record(step=step, plan_version=3, pool_gpus=4, workers=[0, 1, 2, 3], seconds=2.0,
                                  stage_seconds={"actor-gen": 1.0, "ref-inf": 0.3, "actor-train": 0.6}, stats=stats)
                log.write(rec)
                rl_metrics(rec)
            samples.append(_time(one))
        tensorboard = log.writer is not None
        log.close()
    return {"record_ms": round(statistics.median(samples) * 1e3, 3), "tensorboard": tensorboard}


def bench_step(repeats: int) -> dict[str, Any]:
    """The tiny-byte GRPO step with the tallies and with the plain loss, interleaved (two loops)."""
    import agent.engine.loop as loop_mod
    from agent.engine.loop import RLLoop, RunConfig, uniform_plan
    from planner.plan import Layout

    cfg = RunConfig(algo="grpo", prompts_per_step=8, train_mini_batches_per_step=2)
    tallied, plain = (RLLoop(cfg, uniform_plan(cfg, Layout(1, 1), (0,))) for _ in range(2))
    t_tallied, t_plain = [], []
    for s in range(repeats):
        t_tallied.append(tallied.step(s).seconds)
        real, loop_mod.ActorLoss = loop_mod.ActorLoss, _PlainWithStats  # type: ignore[misc,assignment]
        try:
            t_plain.append(plain.step(s).seconds)
        finally:
            loop_mod.ActorLoss = real  # type: ignore[misc]
    a, b = statistics.median(t_tallied[1:]), statistics.median(t_plain[1:])
    return {"tiny_byte_grpo_step_ms": {"tallied": round(a * 1e3, 1), "plain": round(b * 1e3, 1),
                                       "ratio": round(a / b, 3)}}


class _PlainWithStats(PlainActorLoss):
    """The plain loss where the loop expects ``stats`` (never added to)."""

    def __init__(self, *, clip: float, kl_coef: float, temperature: float = 1.0) -> None:
        from agent.engine.losses import ACTOR_STATS, LossStats

        super().__init__(clip, kl_coef)
        self.stats = LossStats(ACTOR_STATS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="5 repeats")
    args = ap.parse_args()
    if args.quick:
        args.repeats = 5
    torch.set_num_threads(1)
    torch.manual_seed(0)
    out = {"loss_tallies": [bench_loss(32, 9, 259, args.repeats), bench_loss(4, 256, 32_000, max(3, args.repeats // 3))],
           "driver_record": bench_record(args.repeats), **bench_step(args.repeats)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
