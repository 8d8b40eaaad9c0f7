"""The live elastic job end to end (what `make run` runs), on the local source: nereusd as a child,
node agents and CPU workers as real processes, the daemon's orders run by the job driver on the
workers' live state.

One short run plays every kind of change by step count: growth 2 -> 4 workers, a response-length jump
(opportunistic replan), a graceful shrink (drain), growth again, a preemption notice (SIGTERM to a
node's processes, as Slurm sends it), growth again, and an abrupt node loss (SIGKILL of a node's agent
and workers). It asserts, from the driver's events and the daemon's store:
- after every transition each logical tensor (weights, AdamW moments, counters) of every stateful
  model-stage equals what the old layout held, by content hash (the driver's --verify);
- every transition moved exactly the bytes of its DAG's messages and reported a measured time > 0,
  and the daemon holds it done with that time;
- growth extended state onto the new node (bytes sent > 0), the drain and the preemption notice moved
  state off the leaving node before it went, the loss was recovered (replicas or the checkpoint);
- reward improves over the run;
- the driver's per-step metrics (metrics.jsonl, TensorBoard files), the daemon's nereus_rl_* gauges on
  /metrics and ``nereusctl plot``'s picture exist and say what the run did (pool sizes, plan versions).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# one run for the whole module: its tests go to one xdist worker (a second would play its own run)
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.xdist_group("live-job")]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("live") / "run"
    proc = subprocess.run([sys.executable, "-m", "nereusd.live", "--steps", "60", "--verify", "--out", str(out),
                           "--timeout-s", "600"], cwd=ROOT, capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    report = json.loads((out / "report.json").read_text())
    report["stdout"] = proc.stdout
    report["png"] = (out / "report.png").exists()
    report["out"] = out
    return report


def _done(report: dict) -> list[dict]:
    return [e for e in report["driver_events"] if e["event"] == "transition-done"]


def test_every_act_played_and_the_job_finished(run: dict) -> None:
    assert [a["name"] for a in run["acts"]] == ["grow", "response jump", "shrink", "grow", "preempt", "grow",
                                                "node loss"]
    assert all(a["at_step"] is not None for a in run["acts"]), run["acts"]
    steps = [s["step"] for s in run["steps"]]
    assert steps == list(range(len(steps))) and len(steps) >= 60  # every step once (re-runs after a restore replace)
    assert any(e["event"] == "done" for e in run["driver_events"])
    assert run["png"] and "=== summary ===" in run["stdout"]


def test_transitions_keep_every_logical_tensor(run: dict) -> None:
    moved = [e for e in _done(run) if e["verified"] is not None]
    # a node killed just after a step leaves no snapshot of that step (the driver says so): the transition
    # that recovers from it has nothing to be compared with; every other one is compared, and equal
    skipped = {e["step"] for e in run["driver_events"] if e["event"] == "snapshot-skipped"}
    compared = [e for e in moved if e["verified"]["equal"] is not None]
    assert len(compared) >= 4, _done(run)
    for e in compared:
        assert e["verified"]["equal"] is True, e
        assert e["verified"]["tensors"] > 0
    for e in moved:
        if e["verified"]["equal"] is None:
            assert skipped and "no snapshot" in e["verified"]["why"], (e, skipped)


def test_transitions_move_exactly_the_dags_bytes_and_are_measured(run: dict) -> None:
    for e in _done(run):
        assert e["bytes_sent"] == e["dag_bytes"], e
        assert e["measured_s"] > 0, e
    done = [t for t in run["transitions"] if t["state"] == "done"]
    driver_done = {e["transition"] for e in _done(run)}
    assert {t["id"] for t in done} <= driver_done  # the daemon holds done only what the driver ran
    for t in run["transitions"]:
        if t["id"] in driver_done and t["state"] != "done":
            # the driver ran it late (a step blocked on a dead peer outlasted daemon.order_timeout_s): the
            # daemon failed it at its bound, and a later transition (the replan) was done
            assert t["state"] == "failed" and any(d["id"] > t["id"] for d in done), t
    for t in done:
        assert t["l_tran_measured_s"] and t["l_tran_measured_s"] > 0, t


def test_growth_extends_the_drain_moves_off_and_the_loss_recovers(run: dict) -> None:
    done = _done(run)
    grown = [e for e in done if len(e["workers"]) == 4 and e["bytes_sent"] > 0]
    assert grown, "no transition extended state onto 4 workers"
    lost = [e for e in done if e["lost"]]
    assert lost and all(len(e["workers"]) == 2 for e in lost), lost
    assert not any(e["event"] == "gave-up" for e in run["driver_events"])
    # the drain: the first transition after the shrink was asked moves state off the leaving node
    # (4 workers -> 2, bytes sent) while it is still there (its workers take part: no worker lost)
    shrink_t = run["acts"][2]["t"]
    drain = next(e for e in done if e["t"] > shrink_t)  # bytes only where no replica is on the staying node
    assert len(drain["workers"]) == 2 and not drain["lost"], drain
    starts = [e for e in run["driver_events"] if e["event"] == "transition-start" and e["t"] > shrink_t]
    assert len(starts[0]["workers"]) == 4, starts[0]  # the leaving node's workers are sources
    # the preemption notice (SIGTERM to the node's processes, as Slurm sends it) drains the same way
    preempt_t = run["acts"][4]["t"]
    left = next(e for e in done if e["t"] > preempt_t)
    assert len(left["workers"]) == 2 and not left["lost"], left


def test_the_response_jump_is_seen_by_the_daemon(run: dict) -> None:
    triggers = [t["trigger"] for t in run["transitions"]] + [d["trigger"] for d in run["rejected_decisions"]]
    assert "opportunistic" in triggers, triggers


def test_reward_improves(run: dict) -> None:
    rewards = [s["reward"] for s in run["steps"]]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.05, (first, last)


def test_per_step_metrics_reach_jsonl_tensorboard_prometheus_and_the_plot(run: dict) -> None:
    import math
    import re

    out = run["out"]
    rows: dict[int, dict] = {}
    for line in (out / "metrics" / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        rows[r["step"]] = r  # a step re-run after a restore: the last record is the step's
    assert sorted(rows) == [s["step"] for s in run["steps"]]
    for r in rows.values():
        for k in ("reward_mean", "reward_std", "kl_ref", "entropy", "clip_fraction", "response_len_mean",
                  "response_len_p95", "response_len_max", "tokens_per_s", "step_s"):
            assert r[k] is not None and math.isfinite(r[k]), (k, r)
        assert r["response_len_mean"] <= r["response_len_p95"] <= r["response_len_max"], r
        assert r["entropy"] > 0 and r["kl_ref"] >= 0 and 0 <= r["clip_fraction"] <= 1
        assert set(r["stage_s"]) >= {"actor-gen", "actor-train"}
        assert r["value_clip_fraction"] is None  # GRPO: no critic
    by_step = {s["step"]: s for s in run["steps"]}
    assert all(rows[k]["reward_mean"] == pytest.approx(by_step[k]["reward"]) for k in rows)
    assert {2, 4} <= {r["pool_gpus"] for r in rows.values()}  # the run grew and shrank
    assert len({r["plan_version"] for r in rows.values()}) >= 4
    before_jump = [rows[k]["response_len_max"] for k in rows if k < run["acts"][1]["at_step"]]
    assert max(before_jump) <= 4  # 3 digits + EOS: the cap before the response-length jump
    # the cost of writing a record (JSONL + TensorBoard) beside the step it records
    cost = sorted(r["record_s"] for r in rows.values())[len(rows) // 2]
    step_s = sorted(r["step_s"] for r in rows.values())[len(rows) // 2]
    print(f"metrics record: median {cost * 1e3:.2f} ms per step, {100 * cost / step_s:.3f}% of the median step")
    assert cost < 0.05 * step_s
    assert list((out / "metrics" / "tb").glob("events.out.tfevents.*"))
    prom = (out / "metrics.prom").read_text()
    last = max(rows)
    gauge = re.search(r'^nereus_rl_step\{job="live"\} (\S+)$', prom, re.M)
    assert gauge and float(gauge.group(1)) == last + 1
    for name in ("reward_mean", "kl_ref", "entropy", "clip_fraction", "tokens_per_s", "pool_gpus"):
        assert re.search(rf'^nereus_rl_{name}\{{job="live"\}} ', prom, re.M), name
    assert re.search(r'^nereus_step_latency_seconds\{job="live",kind="predicted"\} ', prom, re.M)
    png = out / "job.png"
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 20_000
