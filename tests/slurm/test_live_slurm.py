"""The live job on the real cluster: submitted with etc/submit_elastic.py (through submitit) from a job
file, it trains under nereusd's Slurm source on the GPUs Slurm grants (fake: counted from GRES). The
daemon grows it by itself (growth policy, no alloc --grow) with a member job and the live state extends
onto the member's workers; a grow past max_gpus is refused; Slurm requeues the anchor (``scontrol
requeue``): its driver goes, the member's workers keep their state and dial the requeued anchor's new
driver, which adopts them at the step reached (the member's replicas hold every logical tensor the old
driver's --verify digests said) and extends the state back onto the anchor; the member's node is set DOWN (Slurm ends
the member, NODE_FAIL) and the job recovers from the replicas left on the anchor; the daemon grows it
again on another node; the user scancels that member: its node leaves at once from Slurm's state (not
by the heartbeat time-out) and the job goes on (drained while the agent's Leaving lasts, else from
replicas or the checkpoint, as the plan allows; the run prints which).

Why this order: after the first growth the planner replicates the actor's training state per node
(DP 2 x TP 2), so losing a node leaves a copy. By the second growth calibration may prefer one copy
across both nodes (TP 2 x PP 2), where an abrupt loss needs the checkpoint restore (covered on the
local source by tests/live).

The story is read from the driver's events (``--events``, a JSON line per step and transition, in the
job folder), the cluster's side from nereusctl. Every wait names what it waits for; the bounds hold on
a loaded 2-core machine (agents, workers and the driver all import torch on the same two cores).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from lab import SlurmLab, wait_for

from nereusd.wire.keys import KeyStore

# the story has many acts (a requeue waits on Slurm): its bound is the sum of theirs, not the 300 s default
pytestmark = [pytest.mark.slurm, pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.xdist_group("slurm"),
              pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
JOB = "live"
WAIT_S = 180.0  # one act of the story (a member starting, its workers importing torch, a transition)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def nereusd(lab: SlurmLab, tmp_path: Path) -> Iterator[dict[str, Any]]:
    state = tmp_path / "state"
    keys = KeyStore(state / "keys")
    keys.init()
    keys.create_client(name="admin", user="root", role="admin", out_dir=tmp_path / "admin")
    keys.create_client(name="root-agent", user="root", role="agent", out_dir=tmp_path / "agent")
    cfg = tmp_path / "nereusd.toml"
    cfg.write_text(f"""
[daemon]
state_dir = "{state}"
log_format = "json"
order_timeout_s = 180
[control]
port = {_free_port()}
admin_port = {_free_port()}
heartbeat_interval_s = 0.5
heartbeat_timeout_s = 15.0
[metrics]
enabled = false
[planner]
pool_settle_s = 1.0
[slurm]
poll_interval_s = 0.5
poll_backoff_max_s = 2.0
command_timeout_s = 10.0
""")
    log = open(tmp_path / "nereusd.log", "ab")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen([str(BIN / "nereusd"), "serve", "--config", str(cfg)], stdout=log,
                            stderr=subprocess.STDOUT, env=lab.env)
    try:
        wait_for(lambda: (state / "endpoints.json").exists() or proc.poll() is not None, 30, "nereusd to start")
        assert proc.poll() is None, (tmp_path / "nereusd.log").read_text()
        endpoints = json.loads((state / "endpoints.json").read_text())
        yield {"state": state, "tmp": tmp_path, "endpoints": endpoints, "proc": proc}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


def _ctl(d: dict[str, Any], *argv: str) -> Any:
    proc = subprocess.run([str(BIN / "nereusctl"), *argv, "--state-dir", str(d["state"]), "--keys",
                           str(d["tmp"] / "admin")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"nereusctl {argv} exited {proc.returncode}: {proc.stderr}"
    return json.loads(proc.stdout) if "--json" in argv else proc.stdout


def _grown(d: dict[str, Any]) -> list[dict[str, Any]]:
    """The job's member jobs that started, in order: {"slurm_job_id", "node"}."""
    out = []
    for row in _ctl(d, "events", JOB, "--json"):
        data = row["data"] if isinstance(row["data"], dict) else json.loads(row["data"])
        if row["kind"] == "allocation" and data["kind"] == "grown":
            nodes = data["nodes"]
            out.append({"slurm_job_id": data["slurm_job_id"], "node": nodes[0]["node"] if isinstance(nodes[0], dict)
                        else nodes[0]})
    return out


def _decisions(d: dict[str, Any]) -> list[dict[str, Any]]:
    return list(_ctl(d, "decisions", JOB, "--json"))


def _refused(d: dict[str, Any], since: int) -> str:
    """Why the daemon will order no recovery: it found the last copy of some state gone (the plan had no
    replica off the lost node), which the live job cannot take back from a checkpoint yet."""
    bad = [x for x in _decisions(d)[since:] if x["rule"] == "checkpoint-restart" and not x["admitted"]]
    return f"the daemon decided {bad[0]['reason']!r}" if bad else ""


class DriverEvents:
    """The driver's JSON lines, read as they grow."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen: list[dict[str, Any]] = []

    def read(self) -> list[dict[str, Any]]:
        if self.path.exists():
            lines = [x for x in self.path.read_text().splitlines() if x.strip()]
            self.seen = [json.loads(x) for x in lines if x.endswith("}")]  # a line being written is skipped
        return self.seen

    def after(self, index: int, kind: str) -> list[tuple[int, dict[str, Any]]]:
        return [(i, e) for i, e in enumerate(self.read()) if i > index and e["event"] == kind]

    def wait(self, kind: str, what: str, since: int = -1, ok: Callable[[dict[str, Any]], bool] = lambda e: True,
             timeout_s: float = WAIT_S, stuck: Callable[[], str] = lambda: "",
             ends: tuple[str, ...] = ("driver-failed", "gave-up", "done", "stopped")) -> tuple[int, dict[str, Any]]:
        def found() -> tuple[int, dict[str, Any]] | None:
            fatal = [e for k in ends for _, e in self.after(since, k)]
            assert not fatal, f"the driver stopped while waiting for {what}: {fatal}"
            why = stuck()
            assert not why, f"no {what} will come: {why}"
            return next(((i, e) for i, e in self.after(since, kind) if ok(e)), None)

        try:
            return wait_for(found, timeout_s, what, 0.5)  # type: ignore[return-value]
        except TimeoutError:
            tail = [{k: v for k, v in e.items() if k not in ("traceback", "stage_seconds")} for e in self.read()[-12:]]
            raise TimeoutError(f"no {what} within {timeout_s:.0f} s; the driver's last events: {tail}") from None

    def steps_after(self, index: int, count: int, what: str) -> int:
        """Wait for ``count`` steps after event ``index``; returns the index of the last of them."""
        i, _ = self.wait("step", f"{what} (step 1 of {count})", since=index)
        for n in range(1, count):
            i, _ = self.wait("step", f"{what} (step {n + 1} of {count})", since=i)
        return i


def _kill_leftovers(marker: str) -> None:
    """Agents, workers and drivers of this test that outlived their Slurm job (a DOWN node's processes are
    not cleaned up by a slurmd that never heard of the failure): found by this test's own tmp path."""
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if any(marker in a for a in cmd) and p.info["pid"] != os.getpid():
            with contextlib.suppress(psutil.Error):
                p.kill()


def _event_at(d: dict[str, Any], kind: str, ok: Callable[[dict[str, Any]], bool]) -> float | None:
    """The daemon's time of its latest ``kind`` event whose data passes ``ok``."""
    return _event_at_of(d, JOB, kind, ok)


def _event_at_of(d: dict[str, Any], job: str, kind: str, ok: Callable[[dict[str, Any]], bool] = lambda x: True
                 ) -> float | None:
    rows = [r for r in _ctl(d, "events", job, "--json") if r["kind"] == kind]
    data = [(r["at"], r["data"] if isinstance(r["data"], dict) else json.loads(r["data"])) for r in rows]
    return next((at for at, x in reversed(data) if ok(x)), None)


def _joined_after_start_s(d: dict[str, Any], member: dict[str, Any]) -> float:
    """Member start (its GROWN allocation event) to its agent joined (node-registered), daemon clock."""
    started = _event_at(d, "allocation", lambda x: x["kind"] == "grown" and x["slurm_job_id"] == member["slurm_job_id"])
    joined = _event_at(d, "node-registered", lambda x: x["node"] == member["node"])
    assert started is not None and joined is not None, (started, joined)
    return float(joined) - float(started)


def _anchor_requeue(lab: SlurmLab, d: dict[str, Any], ev: DriverEvents, anchor_job_id: str, since: int,
                    member_workers: set[int]) -> dict[str, Any]:
    """``scontrol requeue`` of the anchor; returns once the new driver adopted the member's workers and
    stepped: the adoption's step is the old driver's, and every logical tensor the member's replicas hold
    equals the old driver's digests at that step (--verify)."""
    lab.run("scontrol", "requeue", anchor_job_id)
    # the old driver goes (stopped by its agent at a safe point, or killed with its node): not an end here
    n, _ = ev.wait("driver-started", "the requeued anchor's new driver", since=since, timeout_s=2 * WAIT_S, ends=())
    i, adopted = ev.wait("adopted", "the new driver adopting the member's workers", since=n)
    old = ev.seen[:n]
    done = max(e["step"] for e in old if e["event"] == "step") + 1
    assert adopted["workers"] == sorted(member_workers), adopted
    # from the step reached, not 0: the old driver's, or one more the member finished after it went unlogged
    assert not adopted["torn"] and adopted["step"] in (done, done + 1), (adopted, done)
    _, kept = ev.wait("snapshot", "the adopted state's snapshot", since=i)  # the survivors' logical state
    before = [e for e in old if e["event"] == "snapshot" and e["step"] == adopted["step"]]
    if before:  # absent only where the old driver was killed before it logged that step
        assert kept["digests"] == before[-1]["digests"], "the member's replicas changed across the requeue"
    j, moved = ev.wait("transition-done", "the adopting driver's first transition", since=i)
    assert moved["verified"]["equal"] is True and moved["restored_from"] is None, moved
    k, first = ev.wait("step", "a step after the requeue", since=j)
    assert first["step"] == adopted["step"], first
    return {"adopted": i, "step": adopted["step"], "compared": bool(before)}


def test_live_job_grows_by_itself_survives_node_down_and_member_scancel(lab: SlurmLab, nereusd: dict[str, Any],
                                                                       tmp_path: Path) -> None:
    d = nereusd
    t0 = time.monotonic()
    folder = tmp_path / "submitit"
    events_path = folder / "driver-events.jsonl"
    job_file = tmp_path / "live.toml"
    # a run long enough for the story, with enough prompts per step that 4 GPUs are predicted faster than 2
    job_file.write_text((ROOT / "etc" / "jobs" / "live.toml").read_text().replace("steps = 20", "steps = 5000")
                        .replace("prompts_per_step = 8", "prompts_per_step = 32"))
    driver_args = f"--events {events_path} --verify --checkpoint-every 4 --checkpoint-dir {tmp_path / 'ckpt'} --heal-after-s 15"
    submit = subprocess.run(  # no --cpu-slots: the agents count the GPUs Slurm grants (fake ones, from GRES)
        [sys.executable, str(ROOT / "etc" / "submit_elastic.py"), JOB, "--job-file", str(job_file),
         "--folder", str(folder), "--keys", str(tmp_path / "agent"), "--partition", lab.partition,
         "--agent-args", "--log-format json", "--driver-args", driver_args, "--ctl-keys", str(tmp_path / "admin"),
         "--state-dir", str(d["state"])], capture_output=True, text=True, timeout=120, env=lab.env, cwd=ROOT)
    assert submit.returncode == 0, f"submit_elastic.py exited {submit.returncode}: {submit.stderr}"
    record = json.loads(submit.stdout)
    assert record["extra"]["job_file"] == str(job_file) and record["max_gpus"] == 4
    ev = DriverEvents(events_path)
    try:
        # the anchor starts: its agent runs the driver, the initial placement is done, steps run
        first, placed = ev.wait("transition-done", "the initial placement on the anchor's workers")
        anchor_workers = set(placed["workers"])
        assert len(anchor_workers) == 2 and not placed["lost"]  # gpu:2 granted: two workers
        published = json.loads((folder / f"driver-{JOB}.json").read_text())
        assert published["anchor_job_id"] == record["anchor_job_id"], published
        at = ev.steps_after(first, 1, "a step on the anchor")
        first_step_s = time.monotonic() - t0

        # growth by the daemon itself (no alloc --grow): a member job starts, joins, the state extends
        try:
            i, grew = ev.wait("transition-done", "a live Extend onto a member the daemon grew by itself", since=at,
                              ok=lambda e: bool(set(e["workers"]) - anchor_workers) and e["bytes_sent"] > 0)
        except TimeoutError as exc:
            growth = [(r["kind"], r["data"]) for r in _ctl(d, "events", JOB, "--json") if r["kind"].startswith("growth")]
            raise TimeoutError(f"{exc}; the growth policy said: {growth[-3:]}") from None
        member_workers = set(grew["workers"]) - anchor_workers
        member = wait_for(lambda: _grown(d), 30, "the member in the daemon's events", 0.5)[0]  # type: ignore[index]
        assert _event_at(d, "growth-requested", lambda x: x["gpus_after"] == 4) is not None
        assert member["node"] != lab.job_field(record["anchor_job_id"], "BatchHost")
        joined_s = _joined_after_start_s(d, member)
        over = subprocess.run([str(BIN / "nereusctl"), "alloc", JOB, "--grow", "1", "--state-dir", str(d["state"]),
                               "--keys", str(tmp_path / "admin")], capture_output=True, text=True, timeout=60)
        assert over.returncode == 2 and "max_gpus=4" in over.stderr, over  # past the maximum: refused
        at = ev.steps_after(i, 2, "steps on anchor and member")
        assert set(ev.seen[at]["workers"]) == set(grew["workers"])

        # Slurm requeues the anchor: its driver and workers go, the member's workers keep their state and
        # dial the requeued anchor's new driver, which adopts them and goes on from the step reached
        requeue_at = time.monotonic()
        requeue = _anchor_requeue(lab, d, ev, record["anchor_job_id"], at, member_workers)
        requeue_s = time.monotonic() - requeue_at
        # (the adopting driver's first transition, or a later one where that one was onto the member alone)
        i, back = ev.wait("transition-done", "the live Extend back onto the requeued anchor", since=requeue["adopted"],
                          ok=lambda e: bool(set(e["workers"]) - member_workers) and e["bytes_sent"] > 0)
        anchor_workers = set(back["workers"]) - member_workers
        at = ev.steps_after(i, 2, "steps on the requeued anchor and the member")

        # Slurm takes the member's node (DOWN): the job goes on from the replicas left on the anchor
        down_decisions = len(_decisions(d))
        down_at = time.monotonic()
        lab.run("scontrol", "update", f"NodeName={member['node']}", "State=DOWN", "Reason=live-down")
        i, recovered = ev.wait("transition-done", "a recovery transition after the node DOWN", since=at,
                               ok=lambda e: bool(e["lost"]) and not set(e["workers"]) & member_workers,
                               stuck=lambda: _refused(d, down_decisions))
        recovered_s = time.monotonic() - down_at
        # from the anchor's replicas, or, where the plan kept a stage's last copy on the member, from the
        # latest committed checkpoint (the planner's placement decides which; both keep every tensor)
        assert set(recovered["lost"]) == member_workers, recovered
        assert recovered["restored_from"] is None or str(recovered["restored_from"]).startswith("step"), recovered
        at = ev.steps_after(i, 2, "steps after the recovery")

        # the daemon grows the job again by itself, on another node (the DOWN one stays down)
        i, regrew = ev.wait("transition-done", "a live Extend onto the second member the daemon grew", since=at,
                            ok=lambda e: bool(set(e["workers"]) - anchor_workers) and e["bytes_sent"] > 0)
        second_workers = set(regrew["workers"]) - anchor_workers
        second = wait_for(lambda: _grown(d)[1:], 30, "the second member in the daemon's events", 0.5)[0]  # type: ignore[index]
        assert second["node"] not in (member["node"], lab.job_field(record["anchor_job_id"], "BatchHost"))
        at = ev.steps_after(i, 1, "a step on anchor and second member")

        # the user cancels the second member (scancel: SIGTERM, then SIGKILL after KillWait): its node
        # leaves the job at once from Slurm's state (no heartbeat time-out), and the job goes on
        lab.run("scancel", second["slurm_job_id"])
        i, left = ev.wait("transition-done", "a transition without the cancelled member's workers", since=at,
                          ok=lambda e: not set(e["workers"]) & second_workers)
        gone = wait_for(lambda: _event_at(d, "allocation", lambda x: x["slurm_job_id"] == second["slurm_job_id"]
                                          and x["kind"] == "cancelled"), 60, "the member's cancel in events", 0.5)
        lost_by_heartbeat = _event_at(d, "node-lost", lambda x: x["node"] == second["node"])
        assert gone is not None and lost_by_heartbeat is None, "the cancelled member went by heartbeat time-out"
        ev.steps_after(i, 2, "steps after the member's scancel")
        assert d["proc"].poll() is None  # the daemon kept serving throughout
        how = "drained" if not left["lost"] else f"restored from {left['restored_from'] or 'replicas'}"
        print(f"live on Slurm: {time.monotonic() - t0:.0f} s; submission to first step {first_step_s:.1f} s; member "
              f"start to joined {joined_s:.1f} s; anchor requeue to training again {requeue_s:.1f} s (adopted at step "
              f"{requeue['step']}, digests compared: {requeue['compared']}); node DOWN to recovered {recovered_s:.1f} s; extend "
              f"{grew['bytes_sent']} B; recovery {recovered['bytes_sent']} B from "
              f"{recovered['restored_from'] or 'replicas'}; scancel: {how}")
    finally:
        lab.cancel_all()
        _kill_leftovers(str(tmp_path))


def _readme_submit_command() -> str:
    lines = [x.strip() for x in (ROOT / "README.md").read_text().splitlines() if "etc/submit_elastic.py" in x]
    commands = [x for x in lines if x.startswith("python3 etc/submit_elastic.py")]
    assert len(commands) == 1, f"the README's Slurm section shows one submit command: {lines}"
    return commands[0]


def test_readme_submit_command_verbatim_from_a_clean_environment(lab: SlurmLab, nereusd: dict[str, Any],
                                                                 tmp_path: Path) -> None:
    """The README's submit command, as written, under the system python with nothing set but HOME, PATH,
    the cluster's SLURM_CONF and the daemon's state dir: keys and endpoints from the documented defaults;
    the job trains, on the GPUs Slurm granted (fake ones: no NVML, counted from GRES)."""
    d = nereusd
    home = tmp_path / "home"
    keys = KeyStore(d["state"] / "keys")
    keys.create_client(name="readme-admin", user="root", role="admin", out_dir=home / ".config" / "nereus" / "admin")
    keys.create_client(name="readme-agent", user="root", role="agent", out_dir=home / ".config" / "nereus" / "agent")
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "SLURM_CONF": lab.env["SLURM_CONF"],
           "NEREUS_STATE_DIR": str(d["state"])}
    if not (ROOT / ".venv" / "bin" / "python").exists():  # a worktree without its own venv: name the project's
        env["NEREUS_PYTHON"] = sys.executable
    t0 = time.monotonic()
    submit = subprocess.run(["/bin/sh", "-c", _readme_submit_command()], capture_output=True, text=True, timeout=120,
                            env=env, cwd=ROOT)
    assert submit.returncode == 0, f"the README's command exited {submit.returncode}: {submit.stderr}"
    record = json.loads(submit.stdout)
    try:
        plan = wait_for(lambda: (p := _ctl(d, "job-plan", "live", "--json"))["measured_step_s"] and p, WAIT_S,
                        "the README job's first step measured by the daemon", 1.0)
        first_step_s = time.monotonic() - t0
        job = next(j for j in _ctl(d, "jobs", "--json") if j["job"] == "live")
        granted = lab.job_field(record["anchor_job_id"], "TresPerNode")
        assert granted == "gres:gpu:2" and job["gpus"] == 2, (granted, job)  # what Slurm granted, not CPU slots
        devices = _ctl(d, "job", "live", "--json")["nodes"][0]["devices"]
        assert [x["kind"] for x in devices] == ["gpu", "gpu"], devices
        assert plan["measured_at_step"] is not None
        # the user cancels the job: it ends, and a grow of the ended job is refused (exit 2, an event)
        lab.run("scancel", record["anchor_job_id"])
        wait_for(lambda: next(j for j in _ctl(d, "jobs", "--json") if j["job"] == "live")["state"] == "cancelled", 60,
                 "the cancelled job's end in the daemon", 0.5)
        grow = subprocess.run([str(BIN / "nereusctl"), "alloc", "live", "--grow", "1", "--state-dir", str(d["state"]),
                               "--keys", str(tmp_path / "admin")], capture_output=True, text=True, timeout=60)
        assert grow.returncode == 2 and "cancelled" in grow.stderr, grow
        assert _event_at_of(d, "live", "alloc-refused") is not None
        print(f"README submit: submission to first step {first_step_s:.1f} s")
    finally:
        lab.cancel_all()
        _kill_leftovers(str(tmp_path))
