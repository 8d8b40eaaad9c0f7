"""The per-step RL figures: what the losses tally while training, merged over ranks, written as
metrics.jsonl and TensorBoard files, turned into the wire's RLMetrics; and the CLI's progress line."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
import torch

from agent.engine.losses import ActorLoss, CriticLoss, kl_k3, pack
from agent.engine.progress import Progress
from agent.engine.step_stats import StepStats, combine, rollout_stats
from agent.metrics import MetricsLog, rl_metrics, step_record


def _batch(b: int = 6, t: int = 5, v: int = 11, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=g)
    nxt = torch.randint(0, v, (b, t), generator=g)
    old = torch.log_softmax(logits + 0.5 * torch.randn(b, t, v, generator=g), -1).gather(-1, nxt[..., None])[..., 0]
    ref = old - 0.1 * torch.rand(b, t, generator=g)
    adv = torch.randn(b, t, generator=g)
    mask = (torch.rand(b, t, generator=g) > 0.2).float()
    return logits, nxt, old, ref, adv, mask


def test_the_actor_loss_tallies_clip_entropy_and_kl_as_token_means() -> None:
    logits, nxt, old, ref, adv, mask = _batch()
    weight = mask / mask.sum()
    loss = ActorLoss(clip=0.2, kl_coef=0.0)
    loss(logits, pack(nxt, old, adv, ref, weight))
    got = loss.stats.as_dict()
    logp = torch.log_softmax(logits, -1).gather(-1, nxt[..., None])[..., 0]
    ratio = (logp - old).exp()
    clipped = ((ratio > 1.2) & (adv > 0)) | ((ratio < 0.8) & (adv < 0))
    entropy = torch.distributions.Categorical(logits=logits).entropy()
    n = mask.sum()
    assert got["weight"] == pytest.approx(1.0)
    assert 0 < got["clipped"] < 1  # the case has clipped and unclipped tokens: the check can fail both ways
    assert got["clipped"] == pytest.approx(float((clipped.float() * mask).sum() / n))
    assert got["entropy"] == pytest.approx(float((entropy * mask).sum() / n), rel=1e-5)
    assert got["kl"] == pytest.approx(float((kl_k3(logp, ref) * mask).sum() / n), rel=1e-5)


def test_ranks_sums_merge_into_the_whole_batchs_figures() -> None:
    """Two DP replicas (each with two TP ranks repeating its sums) give what one rank on the whole batch gives."""
    logits, nxt, old, ref, adv, mask = _batch(b=8)
    weight = mask / mask.sum()  # normalised over the whole mini-batch, as the loop does
    scores = torch.linspace(-1, 1, 8)
    whole = ActorLoss(clip=0.2)
    whole(logits, pack(nxt, old, adv, ref, weight))
    ranks = []
    for rows in (slice(0, 4), slice(4, 8)):
        part = ActorLoss(clip=0.2)
        for mb in (slice(rows.start, rows.start + 2), slice(rows.start + 2, rows.stop)):  # micro-batches
            part(logits[mb], pack(nxt[mb], old[mb], adv[mb], ref[mb], weight[mb]))
        ranks += [rollout_stats(scores, mask, actor=part.stats.as_dict())] * 2
    ranks.append(rollout_stats(scores, mask, actor=ActorLoss(clip=0.2).stats.as_dict()))  # a rank with no loss
    merged, one = combine(ranks), combine([rollout_stats(scores, mask, actor=whole.stats.as_dict())])
    for k in ("clip_fraction", "entropy", "kl_ref", "reward_mean", "reward_std", "response_len_p95"):
        assert merged[k] == pytest.approx(one[k], rel=1e-6), k
    assert merged["value_clip_fraction"] is None  # no critic
    lengths = mask.sum(1)
    assert one["response_len_max"] == float(lengths.max())
    assert one["response_len_p95"] == pytest.approx(float(torch.quantile(lengths, 0.95)))
    assert one["reward_std"] == pytest.approx(float(scores.std(correction=0)))


def test_the_critic_loss_tallies_the_value_clip() -> None:
    g = torch.Generator().manual_seed(1)
    old_v, ret = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    values, weight = old_v + torch.randn(4, 6, generator=g), torch.full((4, 6), 1 / 24)
    loss = CriticLoss(clip=0.2)
    loss(values, pack(old_v, ret, weight))
    clipped_v = old_v + (values - old_v).clamp(-0.2, 0.2)
    want = float(((clipped_v - ret) ** 2 > (values - ret) ** 2).float().mean())
    assert 0 < want < 1
    assert loss.stats.as_dict()["clipped"] == pytest.approx(want)


def _stats(**actor: float) -> StepStats:
    return StepStats(reward_mean=0.5, reward_std=0.1, response_len_mean=8, response_len_p95=12, response_len_max=16,
                     response_tokens=256, actor=actor)


def test_records_go_to_jsonl_tensorboard_and_the_wire(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLog(tmp_path / "run")
    for step in range(3):
        rec = step_record(step=step, plan_version=2, pool_gpus=4, workers=[0, 1], seconds=2.0,
                          stage_seconds={"actor-gen": 1.5}, stats=[_stats(weight=1.0, clipped=0.1 * step,
                                                                          entropy=2.0, kl=0.02), None])
        log.write(rec)
        wire = rl_metrics(rec)
        assert wire is not None and wire.tokens_per_s == 128.0 and wire.clip_fraction == pytest.approx(0.1 * step)
        assert wire.value_clip_fraction is None and wire.pool_gpus == 4
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[2]["kl_ref"] == 0.02 and rows[2]["stage_s"] == {"actor-gen": 1.5} and rows[1]["record_s"] > 0
    acc = EventAccumulator(str(tmp_path / "run" / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for tag in ("rl/reward_mean", "rl/kl_ref", "rl/entropy", "rl/clip_fraction", "rl/response_len_p95",
                "rl/tokens_per_s", "time/step_s", "time/stage/actor-gen", "plan/version", "plan/pool_gpus"):
        assert tag in tags, tag
    assert [e.value for e in acc.Scalars("rl/clip_fraction")] == pytest.approx([0.0, 0.1, 0.2])
    # a step without rollout stats (no worker sent them) exports nothing; a NaN figure travels as None
    assert rl_metrics(step_record(step=0, plan_version=0, pool_gpus=1, workers=[0], seconds=1.0, stage_seconds={},
                                  stats=[None])) is None
    nan = step_record(step=0, plan_version=0, pool_gpus=1, workers=[0], seconds=1.0, stage_seconds={},
                      stats=[_stats(weight=1.0, clipped=0.0, entropy=math.nan, kl=0.0)])
    assert nan["entropy"] is None and rl_metrics(nan).entropy is None  # type: ignore[union-attr]


def test_the_progress_line_shows_step_reward_and_time() -> None:
    out = io.StringIO()
    p = Progress(10, out)

    class R:
        mean_score, mean_response_tokens, seconds = 0.25, 7.0, 1.5
        stats = _stats(weight=1.0, clipped=0.0, entropy=1.0, kl=0.05)

    p.update(2, R())
    line = out.getvalue()
    assert line.endswith("\n") and "step  3/10" in line and "reward +0.2500" in line and "kl 0.0500" in line
    assert "1.50 s/step" in line
