"""The ground truth's own behaviour: long tail, hidden drift episodes, transitions, memory."""

from __future__ import annotations

import math

import pytest

from nereusd.planning import cluster_for, job_spec
from nereusd.sim.runner import SimJob, SimPort
from nereusd.sim.truth import GroundTruth, OutOfMemory, StepWorkload, TransitionTruth, lognormal_sigma

JOB = SimJob(model="llama-3.1-8b", algo="ppo", device="h200", prompts_per_step=256)
POOL = frozenset(range(8))


def _truth(seed: int = 0, drift: bool = True) -> tuple[GroundTruth, object]:
    spec = JOB.spec(800)
    plan = SimPort().search({**spec, "workload": {**spec["workload"], "max_response_tokens": 4000}}, POOL, 1).plan
    return GroundTruth(job_spec(spec), cluster_for(spec, POOL), seed=seed, steps=2000, drift=drift), plan


def test_lognormal_fit_reproduces_mean_and_p95() -> None:
    for mean, p95 in ((500.0, 1000.0), (3000.0, 5000.0)):
        s = lognormal_sigma(mean, p95)
        mu = math.log(mean) - s * s / 2
        assert math.exp(mu + 1.645 * s) == pytest.approx(p95, rel=1e-9)
    assert lognormal_sigma(500.0, 500.0) == 0.0


def test_generation_waits_for_the_longest_responses() -> None:
    truth, plan = _truth(drift=False)
    short_tail = truth.mean_latency(plan, 0, StepWorkload(mean_response_tokens=800, p95_response_tokens=900))
    long_tail = truth.mean_latency(plan, 0, StepWorkload(mean_response_tokens=800, p95_response_tokens=2400))
    assert long_tail > 1.1 * short_tail  # same mean length, longer tail: a slower step


def test_hidden_episodes_are_seeded_and_slow_the_step() -> None:
    a, plan = _truth(seed=5)
    b, _ = _truth(seed=5)
    w = StepWorkload(mean_response_tokens=800, p95_response_tokens=1600)
    factors = [a.factors(i, w) for i in range(2000)]
    assert factors == [b.factors(i, w) for i in range(2000)]
    congested = [i for i, (_, nf) in enumerate(factors) if nf < 1.0]
    assert 0 < len(congested) < 1000  # episodes, not a constant
    calm = next(i for i, (cf, nf) in enumerate(factors) if cf == nf == 1.0)
    worst = min(range(2000), key=lambda i: factors[i][0] * factors[i][1])
    assert a.mean_latency(plan, worst, w, seed=1) > a.mean_latency(plan, calm, w, seed=1)  # same draws
    halved = StepWorkload(mean_response_tokens=800, p95_response_tokens=1600, compute_factor=0.5)
    assert a.mean_latency(plan, calm, halved) > 1.3 * a.mean_latency(plan, calm, w)  # the trace's own factor


def test_memory_overflow_names_the_stage_and_the_bytes() -> None:
    truth, plan = _truth(drift=False)
    with pytest.raises(OutOfMemory) as info:
        truth.run_step(plan, 0, StepWorkload(mean_response_tokens=800, p95_response_tokens=12000))
    oom = info.value
    assert oom.need_bytes > oom.capacity_bytes and oom.longest_response_tokens > 4000
    assert oom.model_stage in {s.model_stage for s in plan.stages}


def test_transition_time_has_a_fixed_setup_and_grows_with_bytes_and_contention() -> None:
    cluster = cluster_for(JOB.spec(800), frozenset(range(64)))
    tt = TransitionTruth()
    one = {"kind": "transition", "nodes": [{"bytes_moved": 10**9}], "data_edges": [], "order": [0]}
    many = {"kind": "transition", "nodes": [{"bytes_moved": 10**9}] * 16, "data_edges": [], "order": list(range(16))}
    assert tt.seconds({"kind": "transition", "nodes": []}, cluster, 8) == tt.generation_setup_s
    t1, t16_wide, t16_narrow = tt.seconds(one, cluster, 16), tt.seconds(many, cluster, 64), tt.seconds(many, cluster, 8)
    assert tt.generation_setup_s < t1 < t16_wide < t16_narrow  # more bytes; fewer nodes share the fabric
