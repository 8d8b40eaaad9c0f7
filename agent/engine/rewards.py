"""Reward functions named in the job file, called on a batch with a timeout (verl's custom reward,
batched).

A reward function is ``module:function`` (importable from ``PYTHONPATH`` or the job file's folder)
or ``path/to/file.py:function`` (relative to the job file's folder). It is called with keyword
arguments, one list entry per sample, and returns one finite float per sample::

    def my_reward(prompts: list[str], responses: list[str], ground_truths: list[str | None],
                  finished: list[bool], **kwargs) -> list[float]: ...

A prompt is passed as the prompt file holds it (text, or its list of chat messages); a response is
the decoded text up to EOS. ``finished`` says whether the response ended with the tokenizer's EOS
(not cut at the length limit);
``**kwargs`` keeps a function working when later versions pass more fields. The synthetic tasks'
rewards are built-ins of the same interface (``agent.engine.tasks:rule_scores``); a learned reward
model is the reward-inf model-stage instead (``RunConfig.reward_model``).

A user function runs in a child process (started once, reused across steps), so a timeout can kill
it; the built-ins run inline. When the batch call raises, each sample is retried alone in the child
to name the failing ones. A failure (exception, non-finite or missing score, timeout) is never
silent: ``on_error="raise"`` (default) raises ``RewardError`` naming the function and the first
failing sample's index; ``on_error="score"`` gives failing samples ``error_score`` and lists them in
``RewardReport.errors`` for the step's log.

Run: ``python -m agent.engine.rewards agent.engine.tasks:rule_scores`` checks that a function loads.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from planner.errors import SpecError

REWARD_ARGS = ("prompts", "responses", "ground_truths", "finished")
BUILTIN_PREFIX = "agent.engine."  # the engine's own functions are trusted and run inline


@dataclass(frozen=True, kw_only=True, slots=True)
class RewardConfig:
    function: str  # "module:function" or "path/file.py:function"
    timeout_s: float = 60.0  # per batch call, in the child process
    on_error: str = "raise"  # "raise", or "score": failing samples get error_score and are reported
    error_score: float = 0.0
    base_dir: str = "."  # the job file's folder: relative paths and importable modules start here

    def __post_init__(self) -> None:
        if ":" not in self.function:
            raise SpecError("reward.function", f"{self.function!r} is not 'module:function' or 'file.py:function'")
        if self.on_error not in ("raise", "score"):
            raise SpecError("reward.on_error", f"unknown {self.on_error!r}", "raise, score")
        if not self.timeout_s > 0:
            raise SpecError("reward.timeout_s", f"must be > 0, got {self.timeout_s}")
        if not math.isfinite(self.error_score):
            raise SpecError("reward.error_score", f"must be finite, got {self.error_score}")

    @property
    def inline(self) -> bool:
        return self.function.startswith(BUILTIN_PREFIX)


class RewardError(RuntimeError):
    """A reward function failed on a sample (``index`` into the step's batch; None: the whole batch)."""

    def __init__(self, function: str, index: int | None, reason: str) -> None:
        where = f"sample {index}" if index is not None else "the batch"
        super().__init__(f"reward {function} failed on {where}: {reason}")
        self.function, self.index, self.reason = function, index, reason


@dataclass(frozen=True, slots=True)
class RewardReport:
    scores: list[float]
    errors: list[tuple[int, str]] = field(default_factory=list)  # (sample index, reason)


def resolve(function: str, base_dir: str | Path = ".") -> Callable[..., Any]:
    """The callable named by ``function``; ``SpecError`` saying what is wrong otherwise."""
    target, _, name = function.rpartition(":")
    where = "reward.function"
    base = Path(base_dir)
    try:
        if target.endswith(".py"):
            path = (base / target).resolve()
            if not path.is_file():
                raise SpecError(where, f"{path} does not exist")
            spec = importlib.util.spec_from_file_location(f"nereus_reward_{path.stem}", path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            if str(base.resolve()) not in sys.path:
                sys.path.append(str(base.resolve()))
            module = importlib.import_module(target)
    except SpecError:
        raise
    except Exception as e:
        raise SpecError(where, f"cannot import {target!r}: {type(e).__name__}: {e}") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise SpecError(where, f"{target!r} has no function {name!r}")
    try:
        inspect.signature(fn).bind(**{a: [] for a in REWARD_ARGS})
    except TypeError:
        raise SpecError(where, f"{function} must accept the keyword arguments {', '.join(REWARD_ARGS)} "
                        "(add **kwargs to ignore some)") from None
    except ValueError:
        pass  # no signature to inspect (a builtin or C function): the call itself will tell
    return fn  # type: ignore[no-any-return]


def _failure(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(e), e)).strip()


def _scores_of(out: Any, n: int) -> tuple[list[float | None], list[tuple[int, str]]]:
    """Floats from a function's result, and the samples whose score is missing or not finite."""
    try:
        values = list(out)
    except TypeError:
        raise ValueError(f"returned {type(out).__name__}, not a sequence of {n} floats") from None
    if len(values) != n:
        raise ValueError(f"returned {len(values)} scores for {n} samples")
    scores: list[float | None] = []
    errors = []
    for i, v in enumerate(values):
        try:
            f = float(v)
        except (TypeError, ValueError):
            scores.append(None)
            errors.append((i, f"score {v!r} is not a number"))
            continue
        if math.isfinite(f):
            scores.append(f)
        else:
            scores.append(None)
            errors.append((i, f"score {f} is not finite"))
    return scores, errors


_CHILD_FNS: dict[tuple[str, str], Callable[..., Any]] = {}


def evaluate(function: str, base_dir: str, batch: dict[str, list[Any]]) -> tuple[list[float | None], list[tuple[int, str]]]:
    """Run one batch; where the batch call raises, each sample alone, to name the ones that fail.
    Runs in the child process for user functions (module-level, so it pickles)."""
    key = (function, base_dir)
    if key not in _CHILD_FNS:
        _CHILD_FNS[key] = resolve(function, base_dir)
    fn = _CHILD_FNS[key]
    n = len(batch["prompts"])
    try:
        out = fn(**batch)
    except Exception as batch_error:
        if n == 1:
            return [None], [(0, _failure(batch_error))]
        scores: list[float | None] = []
        errors: list[tuple[int, str]] = []
        for i in range(n):
            try:
                one, bad = _scores_of(fn(**{k: v[i:i + 1] for k, v in batch.items()}), 1)
            except Exception as e:
                scores.append(None)
                errors.append((i, _failure(e)))
                continue
            scores.append(one[0])
            errors += [(i, reason) for _, reason in bad]
        if not errors:  # fails on the batch only: not one sample's fault
            return [None] * n, [(i, f"batch call failed: {_failure(batch_error)}") for i in range(n)]
        return scores, errors
    return _scores_of(out, n)  # a malformed result (length, type) raises ValueError: the whole batch


class RewardChild:
    """One child process that runs ``evaluate`` on request: started with ``subprocess`` (it works from
    daemonic processes, where multiprocessing may not start children), spoken to over a socket pair
    with ``multiprocessing.connection`` (pickled messages), killed on timeout."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"from agent.engine.rewards import serve; serve({theirs.fileno()})"],
            pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        self.conn = Connection(ours.detach())

    def call(self, request: tuple[str, str, dict[str, list[Any]]], timeout_s: float) -> Any:
        """``evaluate(*request)`` in the child; raises TimeoutError, or the child's own exception."""
        self.conn.send(request)
        if not self.conn.poll(timeout_s):
            raise TimeoutError
        try:
            status, value = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"the reward process died (exit code {self.proc.wait()})") from None
        if status == "ok":
            return value
        raise (ValueError if status == "value-error" else RuntimeError)(value)

    def kill(self) -> None:
        self.conn.close()
        self.proc.kill()
        self.proc.wait()


def serve(fd: int) -> None:
    """The child's loop: one ``evaluate`` per request until the parent closes the socket. User code's
    prints go to stderr (stdout is the job's progress)."""
    sys.stdout = sys.stderr
    conn = Connection(fd)
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        try:
            conn.send(("ok", evaluate(*request)))
        except Exception as e:  # as text: not every exception pickles back
            conn.send(("value-error", str(e)) if isinstance(e, ValueError) else ("error", _failure(e)))


class RewardFn:
    """A loaded reward function; resolves it at construction, so a bad name fails at job start."""

    def __init__(self, cfg: RewardConfig) -> None:
        self.cfg = cfg
        resolve(cfg.function, cfg.base_dir)  # in this process too: errors at start, not at step 1
        self._child: RewardChild | None = None

    def __call__(self, *, prompts: Sequence[Any], responses: Sequence[str],
                 ground_truths: Sequence[str | None], finished: Sequence[bool]) -> RewardReport:
        c = self.cfg
        batch: dict[str, list[Any]] = {"prompts": list(prompts), "responses": list(responses),
                                       "ground_truths": list(ground_truths), "finished": [bool(f) for f in finished]}
        n = len(batch["prompts"])
        if any(len(v) != n for v in batch.values()):
            raise ValueError(f"reward inputs differ in length: { {k: len(v) for k, v in batch.items()} }")
        try:
            if c.inline:
                scores, errors = evaluate(c.function, c.base_dir, batch)
            else:
                if self._child is None:
                    self._child = RewardChild()
                scores, errors = self._child.call((c.function, c.base_dir, batch), c.timeout_s)
        except TimeoutError:
            self.close()  # the child may be stuck in user code: kill it, the next call starts a fresh one
            scores, errors = [None] * n, [(i, f"timed out after {c.timeout_s} s") for i in range(n)]
        except (ValueError, RuntimeError) as e:  # a malformed result (length, type), a dead child: the batch
            if c.on_error == "raise":
                raise RewardError(c.function, None, str(e)) from None
            scores, errors = [None] * n, [(i, str(e)) for i in range(n)]
        if errors and c.on_error == "raise":
            index, reason = errors[0]
            if n > 1 and len(errors) == n and all(r == reason for _, r in errors):
                raise RewardError(c.function, None, reason)  # the batch failed, not a sample (a timeout)
            more = f" ({len(errors) - 1} more samples failed)" if len(errors) > 1 else ""
            raise RewardError(c.function, index, reason + more)
        return RewardReport(scores=[c.error_score if s is None else s for s in scores], errors=errors)

    def close(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child = None

    def __del__(self) -> None:
        if getattr(self, "_child", None) is not None:
            self.close()


if __name__ == "__main__":
    print(resolve(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "."))
