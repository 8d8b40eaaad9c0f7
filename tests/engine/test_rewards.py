"""Reward functions from the job file: loaded by name (module or file), called on a batch in a child
process with a timeout; exceptions and non-finite scores named by sample index, never silent."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from agent.engine.rewards import RewardConfig, RewardError, RewardFn
from agent.engine.tasks import ByteTokenizer, Problem, rule_reward, rule_scores
from planner.errors import SpecError

USER_MODULE = '''
import math, time

def length_reward(prompts, responses, ground_truths, finished, **kwargs):
    return [len(r) / 10 + (1.0 if f else 0.0) for r, f in zip(responses, finished)]

def picky(prompts, responses, ground_truths, finished, **kwargs):
    return [1.0 / (len(r) - 3) for r in responses]  # ZeroDivisionError on a 3-character response

def nan_at_one(prompts, responses, ground_truths, finished, **kwargs):
    return [math.nan if i == 1 else 0.5 for i in range(len(responses))]

def too_few(prompts, responses, ground_truths, finished, **kwargs):
    return [0.0]

def sleepy(prompts, responses, ground_truths, finished, **kwargs):
    time.sleep(60)
    return [0.0] * len(responses)

def no_kwargs(prompts):
    return [0.0] * len(prompts)
'''


def _batch(responses: list[str]) -> dict[str, list]:
    n = len(responses)
    return {"prompts": ["p"] * n, "responses": responses, "ground_truths": [None] * n, "finished": [True] * n}


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("job")
    (d / "my_rewards.py").write_text(USER_MODULE)
    return d


@pytest.fixture(scope="module")
def picky_fn(user_dir: Path):
    fn = RewardFn(RewardConfig(function="my_rewards:picky", base_dir=str(user_dir), on_error="score",
                               error_score=-5.0))
    yield fn
    fn.close()


def test_user_function_by_file_and_by_module_scores_the_batch(user_dir: Path) -> None:
    for name in ("my_rewards.py:length_reward", "my_rewards:length_reward"):
        fn = RewardFn(RewardConfig(function=name, base_dir=str(user_dir)))
        try:
            rep = fn(**_batch(["ab", "abcd"]))
        finally:
            fn.close()
        assert rep.scores == pytest.approx([1.2, 1.4]) and rep.errors == []


def test_exception_is_named_by_sample_index(user_dir: Path, picky_fn: RewardFn) -> None:
    rep = picky_fn(**_batch(["abcdef", "ab", "abc", "abcd"]))  # sample 2 divides by zero
    assert rep.scores == pytest.approx([1 / 3, -1.0, -5.0, 1.0])
    assert [i for i, _ in rep.errors] == [2] and "ZeroDivisionError" in rep.errors[0][1]
    strict = RewardFn(RewardConfig(function="my_rewards:picky", base_dir=str(user_dir)))
    try:
        with pytest.raises(RewardError, match="my_rewards:picky failed on sample 1: ZeroDivisionError") as e:
            strict(**_batch(["abcdef", "abc"]))
        assert e.value.index == 1
    finally:
        strict.close()


def test_non_finite_and_missing_scores_are_errors(user_dir: Path) -> None:
    fn = RewardFn(RewardConfig(function="my_rewards:nan_at_one", base_dir=str(user_dir)))
    try:
        with pytest.raises(RewardError, match="sample 1: score nan is not finite"):
            fn(**_batch(["a", "b", "c"]))
    finally:
        fn.close()
    fn = RewardFn(RewardConfig(function="my_rewards:too_few", base_dir=str(user_dir)))
    try:
        with pytest.raises(RewardError, match="the batch: returned 1 scores for 3 samples"):
            fn(**_batch(["a", "b", "c"]))
    finally:
        fn.close()


def test_a_hung_function_times_out_and_the_next_call_gets_a_fresh_child(user_dir: Path, picky_fn: RewardFn) -> None:
    fn = RewardFn(RewardConfig(function="my_rewards:sleepy", base_dir=str(user_dir), timeout_s=2.0,
                               on_error="score"))
    t0 = time.monotonic()
    rep = fn(**_batch(["a", "b"]))
    assert time.monotonic() - t0 < 20
    assert rep.scores == [0.0, 0.0] and all("timed out after 2.0 s" in r for _, r in rep.errors)
    assert fn._child is None  # the stuck child was killed
    fn.close()
    strict = RewardFn(RewardConfig(function="my_rewards:sleepy", base_dir=str(user_dir), timeout_s=1.0))
    with pytest.raises(RewardError, match="failed on the batch: timed out after 1.0 s$") as e:
        strict(**_batch(["a", "b"]))
    assert e.value.index is None and strict._child is None


def test_bad_names_and_signatures_fail_at_load(user_dir: Path) -> None:
    with pytest.raises(SpecError, match="not 'module:function'"):
        RewardConfig(function="my_rewards")
    with pytest.raises(SpecError, match="cannot import 'no_such_module'"):
        RewardFn(RewardConfig(function="no_such_module:f", base_dir=str(user_dir)))
    with pytest.raises(SpecError, match="has no function 'absent'"):
        RewardFn(RewardConfig(function="my_rewards:absent", base_dir=str(user_dir)))
    with pytest.raises(SpecError, match="must accept the keyword arguments prompts, responses"):
        RewardFn(RewardConfig(function="my_rewards:no_kwargs", base_dir=str(user_dir)))
    with pytest.raises(SpecError, match="does not exist"):
        RewardFn(RewardConfig(function="missing.py:f", base_dir=str(user_dir)))


def test_synthetic_rule_reward_is_a_builtin_of_the_same_interface() -> None:
    tok = ByteTokenizer()
    p = Problem("312>", "123")
    cases = [tok.encode("123", bos=False) + [tok.eos_id], tok.encode("123", bos=False), tok.encode("129", bos=False),
             tok.encode("9a", bos=False) + [tok.eos_id, 5]]
    fn = RewardFn(RewardConfig(function="agent.engine.tasks:rule_scores"))
    assert fn.cfg.inline
    rep = fn(prompts=[p.prompt] * 4, responses=[tok.decode(c) for c in cases], ground_truths=["123"] * 4,
             finished=[tok.terminated(c) for c in cases])
    assert rep.scores == [rule_reward(p, c, tok) for c in cases]
    with pytest.raises(RewardError, match="sample 0 has no ground truth"):
        fn(prompts=["x"], responses=["1"], ground_truths=[None], finished=[True])
    assert rule_scores(["x"], ["12"], ["12"], [True]) == [pytest.approx(1.0)]
