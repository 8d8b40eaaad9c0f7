"""The controller feeds measured transition times back into L_tran (real PlannerBinding, tiny model,
CPU "GPUs"): the next transition is priced at the measured slow-down, a payback decision that the
model's own figure would admit is rejected, the correction survives a restart, and a port without the
feedback method still drives the job."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from nereusd.controller import JobController, TransitionObserver, plan_from_dict
from nereusd.metrics import Metrics
from nereusd.planning import PlannerBinding
from nereusd.store import Store
from nereusd.wire import protocol
from nereusd.wire.logs import get_logger
from planner import admission

# One GPU per node: on 4 GPUs the planner gives the reference GPUs 0-1 and the reward model GPUs 2-3
# (tiny-3m, 64 tokens), so a node loss leaves a copy of every model to rebuild from (with two 2-GPU nodes
# each frozen model sits on one node, and a loss is a checkpoint restore: test_live_orders.py).
SPEC = {"model": "tiny-3m", "algo": "grpo", "device": "cpu", "gpus_per_node": 1,
        "workload": {"prompts_per_step": 8, "prompt_tokens": 32, "response_tokens": 64}}
SLOW_DOWN = 2.5  # what bench/executor.py measured on the CPU box against the model


def _controller(store: Store, planner: Any, orders: list[tuple[str, protocol.TransitionOrder]],
                gamma: float = 0.5) -> JobController:
    return JobController(job_id="j", store=store, metrics=Metrics(), planner=planner, gamma=gamma,
                         thresholds=dict(admission.DEFAULT_THRESHOLDS), log=get_logger("test"),
                         send_order=lambda node, order: orders.append((node, order)) is None)


def _join(ctl: JobController, store: Store, node: str) -> None:
    devices = [{"index": 0, "kind": "cpu", "name": "cpu", "memory_bytes": 1 << 33}]
    store.register_node(job_id="j", node=node, devices=devices, slurm_job_id=None, host="h", incarnation=node)
    ctl.on_node_joined(node, "new")


def _finish(ctl: JobController, store: Store, orders: list[tuple[str, protocol.TransitionOrder]],
            slow_down: float) -> dict[str, Any]:
    """Every part reports ``slow_down`` x the model's own L_tran (0.05 s where the model says 0)."""
    t = store.transitions("j")[-1]
    model_s = (t["dag"].get("l_tran") or {}).get("model_s", t["predicted_s"])
    measured = slow_down * model_s if model_s > 0 else 0.05
    for node, order in orders:
        ctl.on_transition_report(protocol.TransitionReport(job_id="j", node=node, transition_id=order.transition_id,
                                                           ok=True, measured_s=measured, bytes_moved=0))
    orders.clear()
    done = store.transition(t["id"])
    assert done is not None and done["state"] == "done"
    return done


def _history(tmp_path: Path, name: str, planner: Any, slow_down: float,
             gamma: float = 0.5) -> tuple[JobController, Store, list[dict[str, Any]]]:
    """Initial placement on n1-n4, n4 is lost (4 -> 3 GPUs), n5 joins (3 -> 4), n5 is lost, n6 joins: five
    transitions, every one measured at ``slow_down`` x the model. Returns the transition rows as ordered."""
    store = Store(tmp_path / f"{name}.db")
    store.add_job(job_id="j", user="alice", spec=SPEC)
    orders: list[tuple[str, protocol.TransitionOrder]] = []
    ctl = _controller(store, planner, orders, gamma)
    rows = []
    for node in ("n1", "n2", "n3", "n4"):
        _join(ctl, store, node)
    for event in ("place", "lose n4", "join n5", "lose n5", "join n6"):
        verb, _, node = event.partition(" ")
        if verb == "join":
            _join(ctl, store, node)
        elif verb == "lose":
            store.set_node_state("j", node, "lost", "test")
            ctl.on_node_lost(node, "test")
        assert ctl.step() is not None, event
        rows.append(store.transitions("j")[-1])
        _finish(ctl, store, orders, slow_down)
    return ctl, store, rows


def _drift(ctl: JobController, store: Store) -> dict[str, Any]:
    """Responses grow 64 -> 400 tokens: an opportunistic replan judged by the payback rule (no stage
    times: the step moves the length signal only, not the step-time fit)."""
    assert ctl.plan is not None
    ctl.on_measurement(protocol.Measurement(job_id="j", node="n1", step=5, plan_version=ctl.plan.version,
                                            step_latency_s=0.4, response_tokens=400))
    did = ctl.step()
    assert did is not None
    dec = store.decision(did)
    assert dec is not None and dec["trigger"] == "opportunistic" and dec["rule"] == "payback", dec
    return dec


def test_measured_slow_down_prices_the_next_transition_and_flips_admission(tmp_path: Path) -> None:
    slow, slow_store, slow_rows = _history(tmp_path, "slow", PlannerBinding(), SLOW_DOWN)
    grow = slow_rows[2]["dag"]["l_tran"]  # 3 -> 4 GPUs, after the shrink was measured 2.5x slower
    assert grow["factor"] == pytest.approx(SLOW_DOWN) and grow["samples"] == 1
    shrink = slow_rows[1]["dag"]["l_tran"]
    assert shrink["factor"] == 1.0 and shrink["samples"] == 0  # nothing measured yet (placement teaches nothing)
    assert slow_rows[1]["predicted_s"] == pytest.approx(shrink["model_s"]) and shrink["model_s"] > 0
    regrow = slow_rows[4]["dag"]["l_tran"]  # the same move again, after three measured 2.5x slower
    assert regrow["model_s"] == pytest.approx(grow["model_s"]) and grow["model_s"] > 0
    assert regrow["factor"] == pytest.approx(SLOW_DOWN) and regrow["samples"] == 3
    assert slow_rows[4]["predicted_s"] == pytest.approx(SLOW_DOWN * grow["model_s"])
    assert slow_rows[4]["dag"]["cost"]["seconds"] == pytest.approx(grow["model_s"])  # the raw model, kept

    # A twin job measured exactly as predicted keeps the model's figure: a probe gives dL, H_x and L_tran.
    probe_ctl, probe_store, _ = _history(tmp_path, "probe", PlannerBinding(), 1.0)
    assert probe_store.transitions("j")[-1]["dag"]["l_tran"]["factor"] == 1.0
    probe = _drift(probe_ctl, probe_store)
    raw_l, d_l, h = probe["l_tran_s"], probe["delta_l_s"], probe["h_x"]
    assert raw_l > 0 and d_l > 0 and h >= 1
    # gamma such that the model's L_tran pays back and 2.5x of it does not: raw/dL <= gamma*H < 2.5*raw/dL
    gamma = 1.6 * raw_l / (d_l * h)

    honest = _drift(*_history(tmp_path, "honest", PlannerBinding(), 1.0, gamma)[:2])
    assert honest["admitted"] and honest["l_tran_s"] == pytest.approx(raw_l)
    slow.gamma = gamma
    judged = _drift(slow, slow_store)
    assert judged["delta_l_s"] == pytest.approx(d_l) and judged["h_x"] == pytest.approx(h)
    assert judged["l_tran_s"] == pytest.approx(SLOW_DOWN * raw_l)
    assert not judged["admitted"], judged["reason"]
    # explain shows why: the model's figure and the correction, though no transition row was made
    assert judged["inputs"]["l_tran"]["model_s"] == pytest.approx(raw_l)
    assert judged["inputs"]["l_tran"]["factor"] == pytest.approx(SLOW_DOWN)
    assert honest["inputs"]["l_tran"]["factor"] == 1.0


def test_correction_survives_a_daemon_restart(tmp_path: Path) -> None:
    _, store, rows = _history(tmp_path, "slow", PlannerBinding(), SLOW_DOWN)
    old, new = (plan_from_dict(store.plan("j", v)["plan"]) for v in (1, 2))  # type: ignore[index]
    pool = frozenset(range(4))

    def price(binding: PlannerBinding) -> float:
        return binding.transition(SPEC, old, new, pool, lambda gpu: f"n{gpu + 1}").predicted_s

    model_s = price(PlannerBinding())  # a binding that never saw this job: the raw model
    assert model_s == pytest.approx(rows[1]["dag"]["l_tran"]["model_s"])
    restarted = PlannerBinding()
    _controller(store, restarted, [])  # a restarted daemon's controller replays the completed transitions
    assert price(restarted) == pytest.approx(SLOW_DOWN * model_s)
    _controller(store, restarted, [])  # and a second controller over the same store counts them once
    key = next(iter(restarted.transition_calibration))
    assert len(restarted.transition_calibration[key].samples) == 4  # the four moves (placement moves nothing)


class _PortWithoutFeedback:
    """A planner port that predates transition feedback (delegates everything else to the binding)."""

    def __init__(self) -> None:
        self.binding = PlannerBinding()
        self.search, self.predict = self.binding.search, self.binding.predict
        self.calibrate, self.transition = self.binding.calibrate, self.binding.transition


def test_a_port_without_feedback_still_drives_the_job(tmp_path: Path) -> None:
    port = _PortWithoutFeedback()
    assert not isinstance(port, TransitionObserver) and isinstance(PlannerBinding(), TransitionObserver)
    _, store, rows = _history(tmp_path, "fake", port, SLOW_DOWN)
    assert [t["state"] for t in store.transitions("j")] == ["done"] * 5
    assert rows[4]["dag"]["l_tran"]["factor"] == 1.0  # nothing fed back, nothing corrected
    assert port.binding.transition_calibration == {}


def test_explain_shows_how_l_tran_was_priced() -> None:
    from nereusd.admin_cli import l_tran_line

    line = l_tran_line({"model_s": 0.109, "fixed_s": 0.0, "factor": 2.5, "corrected_s": 0.2725, "samples": 4,
                        "measured_bytes_per_s": 1.4e9})
    assert "2.5 x 0.109 s (model) = 0.2725 s" in line and "4 measured" in line and "1.4 GB/s" in line
    assert l_tran_line(None) == "" and l_tran_line({}) == ""
