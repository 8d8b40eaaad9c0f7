"""The job driver's per-step RL figures through a real nereusd: validated on the wire, exported as
per-job Prometheus gauges, stored with the measurement and drawn by ``nereusctl plot``; and the
Grafana dashboard in etc/grafana names only metrics the daemon really exports."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest

from nereusd.plot import by_step, transition_steps
from nereusd.wire import protocol

from .conftest import DaemonHandle

pytestmark = pytest.mark.multiprocess
ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "etc" / "grafana" / "nereus-job.json"


def _rl(step: int, **over: object) -> dict:
    return {"reward_mean": 0.1 * step - 0.2, "reward_std": 0.3, "kl_ref": 0.01 * step, "entropy": 2.5,
            "clip_fraction": 0.05, "value_clip_fraction": None, "response_len_mean": 10.0 + step,
            "response_len_p95": 14.0 + step, "response_len_max": 16.0 + step, "tokens_per_s": 250.0,
            "pool_gpus": 2 + step % 2, **over}


def _measure(step: int, **rl: object) -> protocol.Measurement:
    return protocol.Measurement(job_id="j", node="n1", step=step, plan_version=1, step_latency_s=1.0 + step,
                                stage_times_s={"actor-gen": 0.5, "actor-train": 0.25}, response_tokens=10.0 + step,
                                rl=protocol.RLMetrics.model_validate(_rl(step, **rl)))


def _scrape(daemon: DaemonHandle) -> str:
    url = daemon.admin("status")["endpoints"]["metrics"]
    return urllib.request.urlopen(url, timeout=10).read().decode()


def _exported(text: str) -> set[str]:
    """Every sample name the endpoint can show: each TYPE line's metric with its type's suffixes."""
    names = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        names |= {name} | {name + s for s in {"counter": ("_total", "_created"),
                                              "histogram": ("_bucket", "_sum", "_count", "_created")}.get(kind, ())}
    return names


def _register(daemon: DaemonHandle):
    daemon.start()
    daemon.admin("job-add", job="j", user="alice")
    c = daemon.client("alice", identity=b"n1")
    reply = c.request(protocol.Register(job_id="j", node="n1", incarnation="t", devices=(
        protocol.Device(index=0, kind="cpu", name="cpu", memory_bytes=1),)), timeout_s=10)
    assert isinstance(reply, protocol.Welcome), reply
    return c


def test_rl_figures_become_gauges_rows_and_a_plot(daemon: DaemonHandle, tmp_path: Path) -> None:
    c = _register(daemon)
    for step in range(4):
        assert isinstance(c.request(_measure(step), timeout_s=10), protocol.Ack)
    text = _scrape(daemon)
    gauges = {m.group(1): float(m.group(2)) for m in re.finditer(r'^(nereus_rl_\S+?\{[^}]*\}) (\S+)$', text, re.M)}
    assert gauges['nereus_rl_kl_ref{job="j"}'] == pytest.approx(0.03)  # the latest step's (3)
    assert gauges['nereus_rl_reward_mean{job="j"}'] == pytest.approx(0.1)
    assert gauges['nereus_rl_response_tokens{job="j",stat="p95"}'] == 17.0
    assert gauges['nereus_rl_pool_gpus{job="j"}'] == 3.0
    assert gauges['nereus_rl_stage_seconds{job="j",stage="actor-gen"}'] == 0.5
    assert gauges['nereus_rl_step{job="j"}'] == 4.0
    assert 'nereus_rl_value_clip_fraction{job="j"}' not in gauges  # None (no critic) leaves the gauge unset
    rows = daemon.admin("measurements", job="j")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[2]["rl"]["response_len_max"] == 18.0 and rows[2]["rl"]["reward_std"] == 0.3
    out = tmp_path / "job.png"
    done = daemon.ctl("plot", "j", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    missing = daemon.ctl("plot", "nosuch", "--out", str(tmp_path / "x.png"))
    assert missing.returncode != 0 and "no job 'nosuch'" in missing.stderr and not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("bad", [{"reward_mean": float("nan")}, {"clip_fraction": 1.5}, {"kl_ref": -0.1},
                                 {"pool_gpus": -1}, {"entropy": float("inf")}, {"response_len_max": 1e9}])
def test_bad_rl_figures_are_refused_at_the_boundary(bad: dict) -> None:
    frame = json.loads(protocol.encode(_measure(1), "json"))
    frame["rl"].update(bad)
    raw = json.dumps(frame).replace("NaN", "1e400").replace("Infinity", "1e400").encode()
    with pytest.raises(protocol.ProtocolError) as exc:
        protocol.decode(raw, 1 << 20)
    assert exc.value.code == "invalid" and f"rl.{next(iter(bad))}" in str(exc.value)


def test_every_dashboard_query_names_an_exported_metric(daemon: DaemonHandle) -> None:
    c = _register(daemon)
    assert isinstance(c.request(_measure(0), timeout_s=10), protocol.Ack)
    exported = _exported(_scrape(daemon))
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if isinstance(v.get("query"), dict)]
    assert len(exprs) >= 15
    functions = {"increase", "rate", "sum", "by", "histogram_quantile", "label_values", "le", "kind", "job"}
    for expr in exprs:
        bare = re.sub(r'\{[^}]*\}|\[[^\]]*\]|"[^"]*"', "", expr)  # drop selectors, ranges and strings
        names = {n for n in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", bare) if n not in functions}
        assert names, expr
        assert names <= exported, (expr, names - exported)
    for needed in ("nereus_step_latency_seconds", "nereus_transitions_total", "nereus_gpus_held",
                   "nereus_rl_reward_mean", "nereus_rl_kl_ref"):
        assert any(needed in e for e in exprs), needed


def test_transitions_are_marked_between_the_steps_around_their_end() -> None:
    steps = by_step([{"step": s, "at": 10.0 * s} for s in range(5)] + [{"step": 2, "at": 41.0}])
    assert [(m["step"], m["at"]) for m in steps] == [(0, 0.0), (1, 10.0), (2, 41.0), (3, 30.0), (4, 40.0)]
    rows = [{"step": s, "at": 10.0 * s} for s in range(5)][::-1]  # any order: by time
    marks = transition_steps(rows, [{"state": "done", "updated_at": 15.0}, {"state": "failed", "updated_at": 31.0},
                                    {"state": "ordered", "updated_at": 12.0}, {"state": "done", "updated_at": 99.0}])
    assert marks == [(1.5, "done"), (3.5, "failed"), (4.5, "done")]


def test_plot_without_matplotlib_is_one_line_naming_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import sys

    from nereusd.plot import PlotError, plot_job

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.raises(PlotError) as exc:
        plot_job("j", [{"step": 0, "at": 0.0, "step_latency_s": 1.0}], [], tmp_path / "x.png")
    assert "nereus[sim]" in str(exc.value) and "\n" not in str(exc.value)
    assert not (tmp_path / "x.png").exists()


def test_an_ended_jobs_gauges_leave_the_export_and_the_others_stay() -> None:
    from nereusd.metrics import Metrics

    m = Metrics()
    for job in ("a", "b"):
        m.observe_step(_measure(2).model_copy(update={"job_id": job}))
        m.gpus_held.labels(job).set(4)
        m.nodes.labels(job, "alive").set(2)
        m.step_latency.labels(job, "measured").set(1.5)
        m.transitions.labels(job, "done").inc()
    m.forget_job("a")
    samples = [line for line in m.text().splitlines() if not line.startswith("#")]
    assert not [s for s in samples if 'job="a"' in s and "nereus_transitions" not in s]  # counters are totals
    kept = {s.split("{")[0] for s in samples if 'job="b"' in s}
    assert {"nereus_rl_kl_ref", "nereus_gpus_held", "nereus_nodes", "nereus_step_latency_seconds",
            "nereus_rl_response_tokens", "nereus_rl_stage_seconds"} <= kept
