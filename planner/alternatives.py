"""The next reachable plans: what admission tries when the best plan cannot be reached or does not pay.

The search returns the fastest plan that fits in memory, and a fast plan is a dense one: with a paged
KV budget it fills each GPU to the headroom. A transition to it may then not fit (its DAG holds old and
new state side by side on the GPUs they share: the transient state), or cost more than it saves. The
plans worth trying next are the fastest ones that leave room: the search again with each GPU's usable
memory capped at ROOM_FRACTIONS of itself, tightest last. They come best first (a tighter cap never
finds a faster plan), distinct (a cap that finds a plan already offered is skipped), and lazily (the
next search runs only when admission asks for it), each predicted on the real cluster.

Pure and fast: one search per alternative (milliseconds at a few hundred GPUs, tens at 1,024), run
only on the rare decision whose best plan failed.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from planner.cost import PRIORS, OpClass
from planner.errors import InfeasibleError
from planner.hardware import ClusterSpec
from planner.memory import HEADROOM_FRACTION, WORKSPACE_BYTES
from planner.plan import GlobalPlan
from planner.prediction import Prediction, predict
from planner.search import search, usable_bytes
from planner.workflow import JobSpec

# share of each GPU's usable memory (planner.search.usable_bytes) the alternatives may fill, in order
ROOM_FRACTIONS = (0.85, 0.7, 0.55)


@dataclass(frozen=True, kw_only=True, slots=True)
class Alternative:
    """A plan offered after the best one (an admission.CandidateLike), and what it was searched under."""

    plan: GlobalPlan
    prediction: Prediction
    note: str  # e.g. "within 85% of each GPU's usable memory"


def same_placement(a: GlobalPlan, b: GlobalPlan) -> bool:
    """Both plans place every model-stage identically (versions aside)."""
    def key(p: GlobalPlan) -> dict[str, Any]:
        return {s.model_stage: (s.layout, s.gpu_sets, s.micro_batch_size, s.grad_accum, s.recompute)
                for s in p.stages}
    return key(a) == key(b)


def with_room(cluster: ClusterSpec, fraction: float) -> ClusterSpec:
    """``cluster`` with each GPU's usable memory scaled by ``fraction`` (headroom and workspace kept)."""
    usable = usable_bytes(cluster) * fraction
    memory = int((usable + WORKSPACE_BYTES) * (1 + HEADROOM_FRACTION))
    return replace(cluster, device=replace(cluster.device, memory_bytes=memory))


def next_plans(job: JobSpec, cluster: ClusterSpec, pool: Sequence[int] | None, eff: Mapping[OpClass, float] = PRIORS,
               version: int = 1, offered: Sequence[GlobalPlan] = (),
               fractions: Sequence[float] = ROOM_FRACTIONS) -> Iterator[Alternative]:
    """Plans after those ``offered`` (the best one), fastest first, each leaving more memory free."""
    seen = list(offered)
    for f in fractions:
        try:
            res = search(job, with_room(cluster, f), pool, eff, version)
        except InfeasibleError:
            return  # a tighter cap fits nothing either
        if any(same_placement(res.plan, p) for p in seen):
            continue
        seen.append(res.plan)
        yield Alternative(plan=res.plan, prediction=predict(job, cluster, res.plan, eff),
                          note=f"within {f:.0%} of each GPU's usable memory")
