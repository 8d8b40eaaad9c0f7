"""Triggers and admission: when to replan, and whether a candidate plan is worth a transition.

Monitor -> replan -> admit, as in the paper (Eq. 2):
- a change of the GPU pool or a predicted memory violation is URGENT: always replan, admit any feasible
  plan (profitability is not asked), and fall back to checkpoint/restart when nothing fits;
- a drifting signal x (sequence length, compute or communication efficiency) is OPPORTUNISTIC when it
  moves more than its threshold from its value at the last replan; the reference resets after every
  replan, admitted or not;
- an opportunistic transition is admitted iff dL > 0 and L_tran / dL <= gamma * H_x, where dL is the
  predicted per-step saving, L_tran the predicted transition time and H_x an EMA of the number of steps
  between threshold crossings of the triggering signal (starts at 1; several signals -> smallest H_x);
- a best plan that no transition can reach (its DAG's transient state does not fit) or whose
  transition does not pay back is passed over for the next reachable plan (planner.alternatives), and
  the decision records which plans were passed over and why; checkpoint/restart only when none can be
  reached.

Everything here is pure: state is frozen and every function returns a new state or a record.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields, is_dataclass, replace
from enum import Enum
from types import MappingProxyType
from typing import Any, Protocol

from planner.errors import InfeasibleError, SpecError

DEFAULT_GAMMA = 0.5  # paper: best range 0.4-0.65
H_EMA_WEIGHT = 0.5  # weight of the newest interval in the H_x moving average


class Signal(str, Enum):
    SEQUENCE_LENGTH = "sequence_length"  # mean tokens per sequence (prompt + response)
    COMPUTE_EFFICIENCY = "compute_efficiency"  # achieved / peak FLOP/s
    COMMUNICATION_EFFICIENCY = "communication_efficiency"  # achieved / nominal link bandwidth


# Relative drift from the reference that triggers an opportunistic replan.
DEFAULT_THRESHOLDS: Mapping[Signal, float] = MappingProxyType({
    Signal.SEQUENCE_LENGTH: 0.30,  # the paper's delta for sequence length
    Signal.COMPUTE_EFFICIENCY: 0.20, Signal.COMMUNICATION_EFFICIENCY: 0.20,
})


class TriggerKind(str, Enum):
    URGENT = "urgent"
    OPPORTUNISTIC = "opportunistic"


class Rule(str, Enum):
    """Which rule produced a verdict (stored with every decision, shown by nereusctl)."""

    URGENT_FEASIBILITY = "urgent-feasibility"  # current plan infeasible: any feasible plan is taken
    CHECKPOINT_RESTART = "checkpoint-restart"  # nothing fits in memory: restart from a checkpoint
    SAME_PLAN = "same-plan"  # the search returned the plan already running
    NO_GAIN = "no-gain"  # dL <= 0
    PAYBACK = "payback"  # L_tran / dL <= gamma * H_x (admitted) or not (rejected)
    ANY_GAIN = "any-gain"  # comparison policy (DynaRL-style): admit whenever dL > 0


class Policy(str, Enum):
    PAYBACK = "payback"  # Nereus
    ANY_GAIN = "any-gain"  # baseline for the benchmarks: switch whenever the cost model predicts a gain


@dataclass(frozen=True, kw_only=True, slots=True)
class Observation:
    """What the monitor saw at the end of RL step ``step``."""

    step: int
    gpu_pool: frozenset[int]
    signals: Mapping[Signal, float]
    memory_violation: bool = False  # the running plan is predicted to exceed memory at the next step

    def __post_init__(self) -> None:
        if self.step < 0:
            raise SpecError("observation.step", f"must be >= 0, got {self.step}")
        for sig, value in self.signals.items():
            if not isinstance(sig, Signal):
                raise SpecError("observation.signals", f"unknown signal {sig!r}",
                                ", ".join(s.value for s in Signal))
            if not math.isfinite(value) or value <= 0:
                raise SpecError(f"observation.signals.{sig.value}", f"must be finite and > 0, got {value}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Trigger:
    kind: TriggerKind
    step: int
    reasons: tuple[str, ...]
    signals: tuple[Signal, ...] = ()  # the drifting signals that crossed (opportunistic)
    h_steps: float = 1.0  # H_x of the trigger: the smallest over its signals


@dataclass(frozen=True, kw_only=True, slots=True)
class TriggerState:
    """Monitor state between steps: references (value at the last replan), crossing history, H_x."""

    gpu_pool: frozenset[int]
    references: Mapping[Signal, float]
    thresholds: Mapping[Signal, float] = field(default_factory=lambda: dict(DEFAULT_THRESHOLDS))
    last_crossing_step: Mapping[Signal, int] = field(default_factory=dict)
    h_steps: Mapping[Signal, float] = field(default_factory=dict)  # EMA of steps between crossings
    start_step: int = 0

    def __post_init__(self) -> None:
        for sig, thr in self.thresholds.items():
            if not thr > 0:
                raise SpecError(f"thresholds.{sig.value}", f"must be > 0, got {thr}")

    def h(self, signal: Signal) -> float:
        return self.h_steps.get(signal, 1.0)


def initial_state(obs: Observation, thresholds: Mapping[Signal, float] = DEFAULT_THRESHOLDS) -> TriggerState:
    return TriggerState(gpu_pool=obs.gpu_pool, references=dict(obs.signals), thresholds=thresholds,
                        start_step=obs.step)


def relative_drift(value: float, reference: float) -> float:
    return abs(value - reference) / reference


def observe(state: TriggerState, obs: Observation) -> tuple[TriggerState, Trigger | None]:
    """One monitor pass. Returns the updated state and the trigger fired at this step, if any.

    Crossings update H_x here; the caller must call :func:`after_replan` once it replanned (admitted or
    not) so that the references reset.
    """
    reasons: list[str] = []
    urgent = False
    if obs.gpu_pool != state.gpu_pool:
        urgent = True
        gone, new = state.gpu_pool - obs.gpu_pool, obs.gpu_pool - state.gpu_pool
        reasons.append(f"GPU pool changed: {len(state.gpu_pool)} -> {len(obs.gpu_pool)} GPUs "
                       f"(-{len(gone)} +{len(new)})")
    if obs.memory_violation:
        urgent = True
        reasons.append("predicted memory violation of the running plan")

    crossed: list[Signal] = []
    h_steps = dict(state.h_steps)
    last = dict(state.last_crossing_step)
    references = dict(state.references)
    for sig, value in obs.signals.items():
        ref = references.get(sig)
        if ref is None:  # first sighting of this signal: it becomes its own reference
            references[sig] = value
            continue
        thr = state.thresholds.get(sig)
        if thr is None:
            continue
        drift = relative_drift(value, ref)
        if drift > thr:
            crossed.append(sig)
            interval = max(1, obs.step - last.get(sig, state.start_step))
            previous = h_steps.get(sig)
            h_steps[sig] = float(interval) if previous is None else (
                H_EMA_WEIGHT * interval + (1 - H_EMA_WEIGHT) * previous)
            last[sig] = obs.step
            reasons.append(f"{sig.value} drifted {drift:.0%} (> {thr:.0%}) from {ref:g} to {value:g}")

    new_state = replace(state, references=references, last_crossing_step=last, h_steps=h_steps)
    if urgent:
        trig = Trigger(kind=TriggerKind.URGENT, step=obs.step, reasons=tuple(reasons), signals=tuple(crossed),
                       h_steps=min((new_state.h(s) for s in crossed), default=1.0))
        return new_state, trig
    if crossed:
        trig = Trigger(kind=TriggerKind.OPPORTUNISTIC, step=obs.step, reasons=tuple(reasons),
                       signals=tuple(crossed), h_steps=min(new_state.h(s) for s in crossed))
        return new_state, trig
    return new_state, None


def after_replan(state: TriggerState, obs: Observation) -> TriggerState:
    """Reset the references to the current values (after every replan, admitted or not)."""
    return replace(state, references={**state.references, **obs.signals}, gpu_pool=obs.gpu_pool)


# --- admission ------------------------------------------------------------------------------------


class PredictionLike(Protocol):
    @property
    def step_latency_s(self) -> float: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class Verdict:
    admitted: bool
    rule: Rule
    reason: str
    saving_s_per_step: float | None  # dL
    transition_s: float | None  # L_tran
    h_steps: float
    gamma: float

    @property
    def payback_ratio(self) -> float | None:
        """L_tran / dL in steps (None when there is no gain)."""
        if not self.saving_s_per_step or self.saving_s_per_step <= 0 or self.transition_s is None:
            return None
        return self.transition_s / self.saving_s_per_step


def admit(*, trigger: Trigger, current_step_s: float | None, candidate_step_s: float, transition_s: float,
          same_plan: bool = False, gamma: float = DEFAULT_GAMMA, policy: Policy = Policy.PAYBACK) -> Verdict:
    """Eq. 2. ``current_step_s`` is None when the running plan is infeasible (urgent path)."""
    if gamma <= 0:
        raise SpecError("gamma", f"must be > 0, got {gamma}", "0.4-0.65 works best")
    if transition_s < 0 or candidate_step_s <= 0:
        raise SpecError("admission", "transition_s must be >= 0 and candidate_step_s > 0")
    h = trigger.h_steps
    if same_plan:
        return Verdict(admitted=False, rule=Rule.SAME_PLAN, reason="the best plan is the running plan",
                       saving_s_per_step=0.0, transition_s=0.0, h_steps=h, gamma=gamma)
    if current_step_s is None:
        return Verdict(admitted=True, rule=Rule.URGENT_FEASIBILITY,
                       reason="running plan is infeasible; the best feasible plan is taken without a payback "
                              "check",
                       saving_s_per_step=None, transition_s=transition_s, h_steps=h, gamma=gamma)
    d_l = current_step_s - candidate_step_s
    if trigger.kind is TriggerKind.URGENT:
        return Verdict(admitted=True, rule=Rule.URGENT_FEASIBILITY,
                       reason="urgent trigger (" + "; ".join(trigger.reasons) + "): feasibility only",
                       saving_s_per_step=d_l, transition_s=transition_s, h_steps=h, gamma=gamma)
    if d_l <= 0:
        return Verdict(admitted=False, rule=Rule.NO_GAIN,
                       reason=f"candidate is not faster ({candidate_step_s:.4g} s vs {current_step_s:.4g} s)",
                       saving_s_per_step=d_l, transition_s=transition_s, h_steps=h, gamma=gamma)
    if policy is Policy.ANY_GAIN:
        return Verdict(admitted=True, rule=Rule.ANY_GAIN, reason=f"saves {d_l:.4g} s/step",
                       saving_s_per_step=d_l, transition_s=transition_s, h_steps=h, gamma=gamma)
    ratio, bound = transition_s / d_l, gamma * h
    ok = ratio <= bound
    why = (f"L_tran/dL = {transition_s:.4g} s / {d_l:.4g} s = {ratio:.3g} steps "
           f"{'<=' if ok else '>'} gamma*H_x = {gamma:g}*{h:.3g} = {bound:.3g} steps")
    return Verdict(admitted=ok, rule=Rule.PAYBACK, reason=why, saving_s_per_step=d_l,
                   transition_s=transition_s, h_steps=h, gamma=gamma)


# --- decision records -----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Decision:
    """A frozen record of one replan: inputs, both predictions, the rule, the verdict and why."""

    step: int
    trigger: Trigger
    current_plan_version: int | None
    candidate_plan_version: int | None
    current_prediction: Any  # a planner Prediction (None when the running plan is infeasible)
    candidate_prediction: Any  # None when nothing fits
    verdict: Verdict
    candidate_plan: Any = None  # the GlobalPlan proposed (None when nothing fits)
    infeasible_reasons: tuple[str, ...] = ()
    passed_over: tuple[PassedOver, ...] = ()  # better-ranked plans not taken, and why

    def to_dict(self) -> dict[str, Any]:
        """Plain data for storage and nereusctl (enums as values)."""
        return _plain({
            "step": self.step, "trigger": self.trigger,
            "current_plan_version": self.current_plan_version,
            "candidate_plan_version": self.candidate_plan_version,
            "current_prediction": self.current_prediction,
            "candidate_prediction": self.candidate_prediction,
            "verdict": self.verdict,
            "payback_ratio": self.verdict.payback_ratio,
            "candidate_plan": self.candidate_plan,
            "infeasible_reasons": self.infeasible_reasons,
            "passed_over": self.passed_over,
        })


class PassOver(str, Enum):
    """Why a better-ranked plan was not taken."""

    TRANSITION_INFEASIBLE = "transition-infeasible"  # its DAG cannot run (transient memory, coverage)
    NO_PAYBACK = "no-payback"  # its transition costs more than it saves within gamma * H_x


@dataclass(frozen=True, kw_only=True, slots=True)
class PassedOver:
    """A plan admission ranked above the one it took (or above checkpoint/restart), and why not."""

    rank: int  # 1: the search's best plan, 2.. the next reachable plans (planner.alternatives)
    why: PassOver
    reason: str
    predicted_step_s: float
    transition_s: float | None  # L_tran when its DAG could be built
    note: str = ""  # how the plan was found (the alternative's memory cap)


class NoReachablePlan(InfeasibleError):
    """Neither the best plan nor any next one can be reached by a transition: ``cause`` is the best
    plan's own DAG error (a lost last copy, say), ``passed_over`` every plan tried."""

    def __init__(self, cause: InfeasibleError, passed_over: tuple[PassedOver, ...]) -> None:
        self.cause = cause
        self.passed_over = passed_over
        tried = f" ({len(passed_over)} plans tried)" if len(passed_over) > 1 else ""
        super().__init__(str(cause).splitlines()[0] + tried, cause.reasons)


_LEAVES = frozenset({int, str, bool, type(None)})  # what _plain gives back as it is (not their subclasses: enums)


def _plain(obj: Any, by_fields: bool = False) -> Any:
    """Plain data (enums as values, mapping keys as strings, sets sorted, non-finite floats as None). A
    dataclass goes through its ``to_dict`` if it has one, else field by field, and so does everything
    inside it (as ``_plain(dataclasses.asdict(obj))`` gave, without asdict's deep copy of every leaf)."""
    if (kind := type(obj)) in _LEAVES:  # most leaves (GPU ids): no class checks
        return obj
    if kind is float:  # a prediction's seconds
        return obj if math.isfinite(obj) else None
    if kind is tuple or kind is list:  # a plan's GPU sets, straight to their items (no class checks)
        return [v if type(v) in _LEAVES else _plain(v, by_fields) for v in obj]
    if is_dataclass(obj) and not isinstance(obj, type):
        if not by_fields and hasattr(obj, "to_dict"):
            return _plain(obj.to_dict())
        return {f.name: _plain(getattr(obj, f.name), True) for f in fields(obj)}
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, Mapping):
        return {(_plain(k, by_fields) if isinstance(k, Enum) else str(k)):
                v if type(v) in _LEAVES else _plain(v, by_fields) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):  # leaves kept as they are, without a call each
        items = [v if type(v) in _LEAVES else _plain(v, by_fields) for v in obj]
        return sorted(items) if isinstance(obj, (set, frozenset)) else items
    return None if isinstance(obj, float) and not math.isfinite(obj) else obj  # float subclasses (numpy's)


class CandidateLike(Protocol):
    """What a replan returns: a plan and its prediction (planner.search.SearchResult is one)."""

    @property
    def plan(self) -> Any: ...

    @property
    def prediction(self) -> PredictionLike: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """A plain CandidateLike, for callers that have a plan and a prediction but no SearchResult."""

    plan: Any
    prediction: PredictionLike
    note: str = ""  # how it was found (the next reachable plans say which memory cap)


# ``alternatives(error)``: the next plans after the best one, best first, lazily (planner.alternatives);
# ``error`` is the best plan's DAG error, or None when its transition was only not worth it.
Alternatives = Callable[[InfeasibleError | None], Iterable[CandidateLike]]


def decide(*, trigger: Trigger, current_plan: Any, current_prediction: PredictionLike | None,
           replan: Callable[[], CandidateLike], transition_s: Callable[[Any, Any], float],
           gamma: float = DEFAULT_GAMMA, policy: Policy = Policy.PAYBACK,
           alternatives: Alternatives | None = None) -> Decision:
    """Replan and judge the candidate. ``replan`` runs the search (raising InfeasibleError when nothing
    fits, smaller micro-batches and recomputation included); ``transition_s(old, new)`` predicts L_tran,
    raising InfeasibleError when no DAG can reach ``new``. ``current_prediction`` is None when the
    running plan is infeasible on the new pool or memory.

    When the best plan's DAG cannot run, or its transition does not pay back, the next reachable plans
    (``alternatives``) are judged in turn: the first admitted is taken, and the plans passed over are
    recorded with why. A plan no faster than the running one ends the walk (those after it are slower).
    If no plan can be reached at all, NoReachablePlan (an InfeasibleError) carries the best plan's DAG
    error and every plan tried: the caller falls back to checkpoint/restart."""
    cur_version = getattr(current_plan, "version", None)
    try:
        cand = replan()
    except InfeasibleError as exc:
        verdict = Verdict(admitted=False, rule=Rule.CHECKPOINT_RESTART,
                          reason="no plan fits in memory on the available GPUs: fall back to "
                                 "checkpoint/restart (" + str(exc).splitlines()[0] + ")",
                          saving_s_per_step=None, transition_s=None, h_steps=trigger.h_steps, gamma=gamma)
        return Decision(step=trigger.step, trigger=trigger, current_plan_version=cur_version,
                        candidate_plan_version=None, current_prediction=current_prediction,
                        candidate_prediction=None, verdict=verdict, infeasible_reasons=exc.reasons)
    current_s = None if current_prediction is None else current_prediction.step_latency_s
    passed: list[PassedOver] = []
    first: tuple[CandidateLike, Verdict, int] | None = None  # the best-ranked plan whose DAG could be built
    error: list[InfeasibleError] = []  # the best plan's DAG error, if any

    def ranked() -> Iterator[CandidateLike]:
        yield cand
        if alternatives is not None:  # asked only once the best plan was not taken
            yield from alternatives(error[0] if error else None)

    for rank, c in enumerate(ranked(), start=1):
        same = current_plan is not None and _same_layout(current_plan, c.plan)
        try:
            l_tran = 0.0 if same or current_plan is None else transition_s(current_plan, c.plan)
        except InfeasibleError as exc:
            if rank == 1:
                error.append(exc)
            passed.append(_passed(rank, c, PassOver.TRANSITION_INFEASIBLE, str(exc).splitlines()[0], None))
            continue
        verdict = admit(trigger=trigger, current_step_s=current_s, candidate_step_s=c.prediction.step_latency_s,
                        transition_s=l_tran, same_plan=same, gamma=gamma, policy=policy)
        if verdict.admitted or (verdict.rule is not Rule.PAYBACK and first is None):
            return _decision(trigger, cur_version, current_prediction, c, verdict, rank, passed)
        if verdict.rule is not Rule.PAYBACK:
            break  # no faster than the running plan (or it is the running plan): the rest are slower still
        first = first or (c, verdict, rank)
        passed.append(_passed(rank, c, PassOver.NO_PAYBACK, verdict.reason, l_tran))
    if first is None:  # no plan's DAG could be built, the best-ranked one's included: its error is kept
        raise NoReachablePlan(error[0], tuple(passed))
    c, verdict, rank = first
    return _decision(trigger, cur_version, current_prediction, c, verdict, rank, passed)


def _passed(rank: int, c: CandidateLike, why: PassOver, reason: str, l_tran: float | None) -> PassedOver:
    return PassedOver(rank=rank, why=why, reason=reason, predicted_step_s=c.prediction.step_latency_s,
                      transition_s=l_tran, note=str(getattr(c, "note", "")))


def _decision(trigger: Trigger, cur_version: int | None, current_prediction: PredictionLike | None,
              c: CandidateLike, verdict: Verdict, rank: int, passed: list[PassedOver]) -> Decision:
    """The decision for candidate ``c`` (ranked ``rank``); the plans passed over above it are named."""
    others = [p for p in passed if p.rank != rank]
    if others:
        why = "; ".join(f"#{p.rank} {p.why.value}: {p.reason}" for p in others)
        note = getattr(c, "note", "")
        plan = f"plan #{rank}{f' ({note})' if note else ''}"
        reason = (f"{plan} taken, passed over {why}; {verdict.reason}" if verdict.admitted
                  else f"{plan}: {verdict.reason}; also tried {why}")
        verdict = replace(verdict, reason=reason)
    return Decision(step=trigger.step, trigger=trigger, current_plan_version=cur_version,
                    candidate_plan_version=getattr(c.plan, "version", None),
                    current_prediction=current_prediction, candidate_prediction=c.prediction,
                    verdict=verdict, candidate_plan=c.plan, passed_over=tuple(passed))


def _same_layout(a: Any, b: Any) -> bool:
    """Two GlobalPlans place every model-stage identically (versions aside)."""
    try:
        sa = {s.model_stage: (s.layout, s.gpu_sets, s.micro_batch_size, s.grad_accum, s.recompute)
              for s in a.stages}
        sb = {s.model_stage: (s.layout, s.gpu_sets, s.micro_batch_size, s.grad_accum, s.recompute)
              for s in b.stages}
    except AttributeError:
        return False
    return sa == sb
