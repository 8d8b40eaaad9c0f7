"""The prompt file's position (prompts consumed) travels in the unit counters (counter 3): a live
transition and a checkpoint restore read on exactly where the run stopped, and the position is the
counter's, not one derived from the step count. Real spawned workers (agent.coordinator)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.coordinator import LocalCoordinator
from agent.engine.data import DataConfig, PromptDataset
from agent.engine.grpo import GRPOConfig
from agent.engine.live import (
    DATA_POSITION,
    RL_STEPS,
    bind,
    live_cluster,
    live_dag,
    live_units,
    release,
    train_step,
)
from agent.engine.loop import RunConfig, uniform_plan
from agent.engine.rewards import RewardConfig
from agent.engine.tasks import SortDigits, problems_for_step
from planner.plan import Layout

pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("live-data-position")]
MEMBERS = (0, 1)
ROWS = 7  # not a multiple of the 2 prompts per step: epochs wrap mid-step


def _cfg(folder: Path) -> RunConfig:
    syn = SortDigits(num_digits=3)
    rows = [{"q": p.prompt, "a": p.answer} for p in problems_for_step(syn, 1, 0, ROWS)]
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return RunConfig(algo="grpo", task=syn, prompts_per_step=2, grpo=GRPOConfig(samples_per_prompt=2), seed=4,
                     data=DataConfig(path=str(path), prompt_field="q", ground_truth_field="a"),
                     reward=RewardConfig(function="agent.engine.tasks:rule_scores"),
                     max_prompt_tokens=syn.max_prompt_chars + 1, max_new_tokens=syn.max_answer_chars + 1)


def _plan(cfg: RunConfig, layout: Layout, version: int) -> Any:
    return dataclasses.replace(uniform_plan(cfg, layout, MEMBERS), version=version)


# --- run inside the workers ---------------------------------------------------------------------------
def forget(ctx: Any) -> int:
    ctx.engine = None
    ctx.units.clear()
    return 0


def counters(ctx: Any) -> list[tuple[int, int]]:
    return sorted({(int(s.counters[RL_STEPS]), int(s.counters[DATA_POSITION])) for s in ctx.units.values()})


def set_position(ctx: Any, *, position: int) -> int:
    for s in ctx.units.values():
        s.counters[DATA_POSITION] = position
    return len(ctx.units)


def next_prompts(ctx: Any) -> list[str]:
    loop = ctx.engine.loop
    return [p.prompt for p in loop._problems(ctx.engine.rl_steps)]


@pytest.fixture(scope="module")
def pool() -> Iterator[LocalCoordinator]:
    with LocalCoordinator(2, timeout_s=60) as coord:
        coord.form_generation(MEMBERS)
        yield coord


def test_the_data_position_moves_with_the_units_and_comes_back_from_a_checkpoint(pool: LocalCoordinator,
                                                                                    tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    data = PromptDataset(cfg.data, seed=cfg.seed)  # type: ignore[arg-type]
    a, b = _plan(cfg, Layout(1, 1), 1), _plan(cfg, Layout(2, 1), 2)  # DP2 -> TP2
    pool.call(forget)
    assert {r["data_position"] for r in pool.call(bind, cfg=cfg, plan=a).values()} == {0}
    for step in range(3):
        out = pool.call(train_step, step=step)
        assert {r.data_position for r in out.values()} == {2 * (step + 1)}
    assert set(map(tuple, pool.call(counters).values())) == {((3, 6),)}
    url = str(tmp_path / "ckpt")
    pool.save_checkpoint(url, "at6")

    # a live transition: the position arrives with the units, and the next batch is the file's next rows
    pool.call(release)
    outcome = pool.run_dag(live_dag(cfg, a, b), live_cluster(cfg, a, b))
    assert outcome.committed, outcome.errors
    assert {r["data_position"] for r in pool.call(bind, cfg=cfg, plan=b).values()} == {6}
    want = [p.prompt for p in data.rows(6, 2)]  # rows 6 and 0 of the next epoch's order
    assert set(map(tuple, pool.call(next_prompts).values())) == {tuple(want)}
    live_step = pool.call(train_step, step=3)[0]
    assert live_step.data_position == 8

    # a restore into the new layout from the checkpoint: the same position, the same step, bit for bit
    pool.call(forget)
    pool.load_checkpoint(url, "at6", live_units(cfg, b))
    assert {r["data_position"] for r in pool.call(bind, cfg=cfg, plan=b).values()} == {6}
    restored = pool.call(train_step, step=3)[0]
    assert restored.rollout_sha256 == live_step.rollout_sha256 and restored.data_position == 8

    # the counter is the position, not a function of the steps (a run whose prompts per step changed)
    pool.call(release)
    pool.call(set_position, position=3)
    assert {r["data_position"] for r in pool.call(bind, cfg=cfg, plan=b).values()} == {3}
    assert set(map(tuple, pool.call(next_prompts).values())) == {tuple(p.prompt for p in data.rows(3, 2))}
    assert data.rows(3, 2) != data.rows(8, 2)  # what steps x prompts per step would have given
    # units written before the position was counted (0 there after steps) read the steps' position
    pool.call(release)
    pool.call(set_position, position=0)
    assert {r["data_position"] for r in pool.call(bind, cfg=cfg, plan=b).values()} == {8}
