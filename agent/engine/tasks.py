"""Synthetic verifiable tasks with a byte-level tokenizer, and their rule-based rewards.

Prompts for RL step ``s`` derive only from ``(seed, s)``, so every layout sees the same global batch
in the same order; a DP replica takes its rows by rank (``StageEngine.replica_rows``), exactly as for
a user's prompt file (``agent.engine.data``). The rule reward is a built-in reward function of the
job file's interface (``agent.engine.rewards``): ``agent.engine.tasks:rule_scores``.

Run: ``python -m agent.engine.tasks`` prints a few problems.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from planner.errors import SpecError


@dataclass(frozen=True, kw_only=True, slots=True)
class ByteTokenizer:
    """Bytes 0..255 are their own ids; three specials follow. Needs ``vocab_size >= 259``."""

    pad_id: int = 256
    bos_id: int = 257
    eos_id: int = 258

    @property
    def min_vocab_size(self) -> int:
        return 259

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return ([self.bos_id] if bos else []) + list(text.encode())

    def decode(self, ids: list[int]) -> str:
        """Bytes up to the first EOS; other specials are dropped."""
        out = bytearray()
        for i in ids:
            if i == self.eos_id:
                break
            if i < 256:
                out.append(i)
        return out.decode(errors="replace")

    def terminated(self, ids: list[int]) -> bool:
        return self.eos_id in ids

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (self.eos_id,)


@dataclass(frozen=True, slots=True)
class Problem:
    """One prompt of a step's batch: text (or chat messages, from a user's file) and its ground truth
    (None where a user's file names no ground-truth field)."""

    prompt: str | tuple[dict[str, str], ...]
    answer: str | None


@dataclass(frozen=True, kw_only=True, slots=True)
class SortDigits:
    """``"3142>"`` -> ``"1234"`` then EOS."""

    num_digits: int = 3

    def __post_init__(self) -> None:
        if not 1 <= self.num_digits <= 16:
            raise SpecError("task.num_digits", f"must be in 1..16, got {self.num_digits}")

    def make(self, rng: random.Random) -> Problem:
        digits = [rng.choice("0123456789") for _ in range(self.num_digits)]
        return Problem("".join(digits) + ">", "".join(sorted(digits)))

    @property
    def max_prompt_chars(self) -> int:
        return self.num_digits + 1

    @property
    def max_answer_chars(self) -> int:
        return self.num_digits


@dataclass(frozen=True, kw_only=True, slots=True)
class AddNumbers:
    """``"12+7="`` -> ``"19"`` then EOS."""

    max_operand: int = 99

    def __post_init__(self) -> None:
        if self.max_operand < 1:
            raise SpecError("task.max_operand", f"must be >= 1, got {self.max_operand}")

    def make(self, rng: random.Random) -> Problem:
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        return Problem(f"{a}+{b}=", str(a + b))

    @property
    def max_prompt_chars(self) -> int:
        return 2 * len(str(self.max_operand)) + 2

    @property
    def max_answer_chars(self) -> int:
        return len(str(2 * self.max_operand))


Task = SortDigits | AddNumbers


def problems_for_step(task: Task, seed: int, step: int, count: int) -> list[Problem]:
    """The global prompt batch of RL step ``step``: a pure function of (seed, step)."""
    rng = random.Random(seed * 1_000_003 + step)
    return [task.make(rng) for _ in range(count)]


def score_text(answer: str, text: str, stopped: bool) -> float:
    """Format (0.2: share of answer-alphabet characters), accuracy (0.7: right characters in place) and
    the exact, stopped answer (0.1).

    The format term is the usual verifiable-RL shaping: it gives a randomly initialised policy a dense
    signal; accuracy then needs the task solved, and the optimum is the verifiable answer.
    """
    alphabet = set("0123456789")
    fmt = sum(1 for ch in text if ch in alphabet) / max(len(text), len(answer), 1)
    right = sum(1 for a, b in zip(text, answer) if a == b) / max(len(answer), len(text), 1)
    exact = text == answer and stopped
    return 0.2 * fmt + 0.7 * right + (0.1 if exact else 0.0)


def rule_reward(problem: Problem, response_ids: list[int], tok: ByteTokenizer) -> float:
    """``score_text`` of one response given as token ids."""
    assert problem.answer is not None
    return score_text(problem.answer, tok.decode(response_ids), tok.terminated(response_ids))


def rule_scores(prompts: list[str], responses: list[str], ground_truths: list[str | None],
                finished: list[bool], **kwargs: object) -> list[float]:
    """The synthetic tasks' reward as a reward function of the job file's interface."""
    out = []
    for i, (text, answer, stopped) in enumerate(zip(responses, ground_truths, finished)):
        if answer is None:
            raise ValueError(f"sample {i} has no ground truth; the rule reward needs one")
        out.append(score_text(answer, text, stopped))
    return out


def accuracy(problem: Problem, response_ids: list[int], tok: ByteTokenizer) -> float:
    """Share of answer characters right in place (the task part of the reward, without format)."""
    assert problem.answer is not None
    text = tok.decode(response_ids)
    return sum(1 for a, b in zip(text, problem.answer) if a == b) / max(len(problem.answer), len(text), 1)


if __name__ == "__main__":
    for p in problems_for_step(SortDigits(), seed=0, step=0, count=3) + problems_for_step(
            AddNumbers(), seed=0, step=0, count=3):
        print(p)
