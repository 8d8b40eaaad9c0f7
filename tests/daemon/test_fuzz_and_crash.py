"""Property-based fuzzing of a real daemon, a full disk (a small tmpfs) and a read-only state dir.

After every fuzzed frame the daemon must answer it and answer ``status`` within a second; at the end
the store passes integrity_check, every acknowledged record is in it, and a restart succeeds.
``NEREUS_FUZZ_EXAMPLES`` sets the examples (default 150, cheap for CI; the closing figures used more).
kill -9 rounds are in test_crash_rounds.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nereusd.wire import protocol

from .conftest import DaemonHandle, store_rows, write_config

pytestmark = pytest.mark.multiprocess

FUZZ_EXAMPLES = int(os.environ.get("NEREUS_FUZZ_EXAMPLES", "150"))
DEV = (protocol.Device(index=0, kind="cpu", name="cpu", memory_bytes=1 << 30),)


def _good(job: str, node: str) -> dict[str, dict[str, Any]]:
    msgs = [protocol.Register(job_id=job, node=node, incarnation="t", devices=DEV),
            protocol.Heartbeat(job_id=job, node=node, seq=1,
                               workers=(protocol.WorkerState(device=0, pid=1, state="running"),)),
            protocol.Measurement(job_id=job, node=node, step=1, plan_version=0, step_latency_s=1.0,
                                 stage_times_s={"actor-gen": 0.5}, peak_memory_bytes={"0": 1}, response_tokens=3.0),
            protocol.TransitionReport(job_id=job, node=node, transition_id=1, ok=False, measured_s=0.1),
            protocol.Leaving(job_id=job, node=node, reason="preempt", grace_s=25.0),
            protocol.AdminRequest(op="status")]
    return {m.type: json.loads(protocol.encode(m, "json")) for m in msgs}


ADVERSARIAL = st.one_of(
    st.none(), st.booleans(), st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**64), max_value=2**64 - 1), st.text(max_size=40),
    st.sampled_from(["", "a/b", "x" * 100_000, "j/n1", "../..", "\x00", "n1", "j"]),
    st.lists(st.integers(-3, 3), max_size=3), st.dictionaries(st.text(max_size=4), st.floats(), max_size=3))


def _frame(raw: dict[str, Any], encoding: str) -> bytes | None:
    try:
        return json.dumps(raw).encode() if encoding == "json" else msgpack.packb(raw, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        return None


def test_fuzzed_frames_never_stop_the_daemon_or_lose_an_acknowledged_record(daemon: DaemonHandle) -> None:
    daemon.config.write_text(daemon.config.read_text().replace("max_message_bytes = 4096",
                                                               f"max_message_bytes = {1 << 20}"))
    daemon.start()
    daemon.admin("job-add", job="j", user="alice")
    agent = daemon.client("alice", identity=b"agent-fuzz")
    assert isinstance(agent.request(protocol.Register(job_id="j", node="n1", incarnation="t", devices=DEV),
                                    timeout_s=10), protocol.Welcome)
    admin = daemon.client("admin", "admin")
    good = _good("j", "n1")
    acked: list[int] = []
    slowest = [0.0]
    tally: dict[str, int] = {}  # "<message type> -> <reply code>": the figures of the closing note

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(kind=st.sampled_from(sorted(good)), data=st.data(), value=ADVERSARIAL,
           encoding=st.sampled_from(["json", "msgpack"]), split=st.integers(0, 11))
    def one(kind: str, data: st.DataObject, value: Any, encoding: str, split: int) -> None:
        base = good[kind]
        field = data.draw(st.sampled_from(sorted(base)))
        frame = _frame({**base, field: value}, encoding)
        if frame is None:
            return
        target = admin if kind == "admin" else agent
        split = max(0, split - 8)  # a quarter of the cases: the body cut into 2-4 frames, refused as malformed
        if split and len(frame) > split:
            cut = max(1, len(frame) // (split + 1))
            target.sock.send_multipart([frame[i:i + cut] for i in range(0, len(frame), cut)])
        else:
            target.send_raw(frame)
        reply = target.recv(timeout_s=10)
        assert reply is not None, f"no reply to {kind}.{field} = {str(value)[:60]}"
        answer = getattr(reply, "code", None) or ("ok" if getattr(reply, "ok", True) else "refused")
        tally[f"{kind} -> {answer}"] = tally.get(f"{kind} -> {answer}", 0) + 1
        # a valid measurement after each case: acknowledged, so it must survive everything
        step = len(acked) + 1
        ack = agent.request(protocol.Measurement(job_id="j", node="n1", step=step, plan_version=0,
                                                 step_latency_s=0.5), timeout_s=10)
        if isinstance(ack, protocol.ErrorReply) and ack.code == "unknown-session":
            # a fuzzed register for another node may not take this connection; it never does, so
            # this would be a bug: fail loudly
            raise AssertionError(f"the agent's session was lost after {kind}.{field}")
        assert isinstance(ack, protocol.Ack), ack
        acked.append(step)
        t0 = time.monotonic()
        status = admin.request(protocol.AdminRequest(op="status"), timeout_s=10)
        slowest[0] = max(slowest[0], time.monotonic() - t0)
        assert isinstance(status, protocol.AdminReply) and status.ok
        assert slowest[0] < 1.0, f"status took {slowest[0]:.2f} s"

    one()
    print(f"fuzzed frames: {sum(tally.values())}, slowest status {slowest[0]:.3f} s:", dict(sorted(tally.items())))
    assert daemon.proc is not None and daemon.proc.poll() is None
    assert store_rows(daemon.state_dir, "PRAGMA integrity_check") == [("ok",)]
    stored = {s for (s,) in store_rows(daemon.state_dir, "SELECT step FROM measurements WHERE job_id='j'")}
    assert set(acked) <= stored
    assert daemon.stop() == 0
    daemon.start()
    stored = {s for (s,) in store_rows(daemon.state_dir, "SELECT step FROM measurements WHERE job_id='j'")}
    assert set(acked) <= stored and len(acked) > FUZZ_EXAMPLES // 3
    assert daemon.admin("status")["jobs_damaged"] == {}


def _tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def _fill(path: Path) -> Path:
    """Fill the filesystem under ``path`` to the last byte (unbuffered: nothing is left to flush)."""
    filler = path / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for chunk in (65536, 512, 1):
            try:
                while True:
                    os.write(fd, b"\0" * chunk)
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler


def test_a_full_disk_is_refused_at_start_and_survived_while_serving(daemon: DaemonHandle) -> None:
    mnt = daemon.tmp / "small"
    if not _tmpfs(mnt, "4m"):
        pytest.skip("cannot mount a small tmpfs here (needs root and mount(8)): the full-disk cases need one")
    try:
        state = mnt / "state"
        from nereusd.wire.keys import KeyStore

        ks = KeyStore(state / "keys")
        ks.init()
        for name, user, role in (("admin", "root", "admin"), ("alice-agent", "alice", "agent")):
            ks.create_client(name=name, user=user, role=role, out_dir=daemon.tmp / name.split("-")[0])
        write_config(daemon.config, state, max_bytes=1 << 20)
        handle = DaemonHandle(tmp=daemon.tmp, config=daemon.config, state_dir=state)
        filler = _fill(mnt)
        proc = subprocess.run([str(Path(__import__("sys").executable).parent / "nereusd"), "serve", "--config",
                               str(daemon.config)], capture_output=True, text=True, timeout=60)
        lines = [ln for ln in proc.stderr.splitlines() if not ln.startswith("{")]
        assert proc.returncode == 3 and len(lines) == 1 and "No space left" in lines[0], proc.stderr[-1500:]
        filler.unlink()
        handle.start()
        daemon.proc = handle.proc  # the fixture stops it
        handle.admin("job-add", job="j", user="alice")
        agent = handle.client("alice", identity=b"agent-full")
        assert isinstance(agent.request(protocol.Register(job_id="j", node="n1", incarnation="t", devices=DEV),
                                        timeout_s=10), protocol.Welcome)
        acked = []
        for step in range(1, 6):
            reply = agent.request(protocol.Measurement(job_id="j", node="n1", step=step, plan_version=0,
                                                       step_latency_s=0.1, stage_times_s={"x": 1.0}), timeout_s=10)
            assert isinstance(reply, protocol.Ack)
            acked.append(step)
        filler = _fill(mnt)
        refused = 0
        for step in range(6, 400):  # enough rows to need a new page of the WAL
            reply = agent.request(protocol.Measurement(job_id="j", node="n1", step=step, plan_version=0,
                                                       step_latency_s=0.1, stage_times_s={"x" * 60: 1.0} | {
                                                           f"s{i}": 1.0 for i in range(40)}), timeout_s=10)
            assert reply is not None, "a full disk must not leave a message unanswered"
            if isinstance(reply, protocol.Ack):
                acked.append(step)
            else:
                assert reply.code == "internal", reply
                refused += 1
        assert refused > 0, "the disk never filled up: the test did not test anything"
        print(f"disk full while serving: {len(acked) + refused} writes, {len(acked)} acknowledged, {refused} refused")
        status = handle.admin("status")  # reads still work
        assert status["pid"] == handle.proc.pid  # type: ignore[union-attr]
        filler.unlink()
        reply = agent.request(protocol.Measurement(job_id="j", node="n1", step=1000, plan_version=0,
                                                   step_latency_s=0.1), timeout_s=10)
        assert isinstance(reply, protocol.Ack)  # with space back, writes go on without a restart
        acked.append(1000)
        assert handle.stop() == 0
        handle.start()
        daemon.proc = handle.proc
        stored = {s for (s,) in store_rows(state, "SELECT step FROM measurements")}
        assert set(acked) <= stored
        assert store_rows(state, "PRAGMA integrity_check") == [("ok",)]
        for c in handle.clients:
            c.close()
    finally:
        if daemon.proc is not None and daemon.proc.poll() is None:
            daemon.proc.kill()
            daemon.proc.wait(10)
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)




def test_a_read_only_state_dir_is_refused_in_one_line(daemon: DaemonHandle) -> None:
    mnt = daemon.tmp / "ro"
    if not _tmpfs(mnt, "4m"):
        pytest.skip("cannot mount a small tmpfs here (needs root and mount(8)); chmod does not stop root")
    try:
        state = mnt / "state"
        from nereusd.wire.keys import KeyStore

        KeyStore(state / "keys").init()
        write_config(daemon.config, state)
        assert subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True).returncode == 0
        proc = subprocess.run([str(Path(__import__("sys").executable).parent / "nereusd"), "serve", "--config",
                               str(daemon.config)], capture_output=True, text=True, timeout=60)
        lines = [ln for ln in proc.stderr.splitlines() if not ln.startswith("{")]
        assert proc.returncode == 3 and len(lines) == 1 and "not writable" in lines[0] \
            and "Read-only" in lines[0], proc.stderr[-1500:]
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


ELASTIC = {"anchor_job_id": "local-x", "min_gpus": 2, "max_gpus": 4, "gpus_per_node": 2}
ADMIN_GOOD: dict[str, dict[str, Any]] = {
    "status": {}, "jobs": {}, "keys": {}, "job": {"job": "j"}, "job-plan": {"job": "j"}, "decisions": {"job": "j"},
    "transitions": {"job": "j"}, "transition": {"id": 1}, "explain": {"id": 1}, "events": {"job": "j", "limit": 5},
    "alloc": {"job": "j", "action": "show"},
    "job-add": {"job": "new", "user": "alice", "spec": {"elastic": ELASTIC, "workload": {
        "prompts_per_step": 8, "prompt_tokens": 32, "response_tokens": 64}}},
}


def _paths(args: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every field of the arguments, nested ones too (spec.elastic.max_gpus), and one new key per level."""
    out = [(*prefix, "surplus")]
    for k, v in args.items():
        out.append((*prefix, k))
        if isinstance(v, dict):
            out += _paths(v, (*prefix, k))
    return out


def _set(args: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    if len(path) == 1:
        return {**args, path[0]: value}
    return {**args, path[0]: _set(dict(args.get(path[0]) or {}), path[1:], value)}


def test_fuzzed_admin_arguments_are_answered_and_store_only_valid_jobs(daemon: DaemonHandle) -> None:
    daemon.config.write_text(daemon.config.read_text().replace("max_message_bytes = 4096",
                                                               f"max_message_bytes = {1 << 20}"))
    daemon.start()
    daemon.admin("job-add", job="j", user="alice", spec={"elastic": {**ELASTIC, "anchor_job_id": "local-j"}})
    admin = daemon.client("admin", "admin")
    tally: dict[str, int] = {}
    added: list[str] = []

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(op=st.sampled_from(sorted(ADMIN_GOOD)), data=st.data(), value=ADVERSARIAL)
    def one(op: str, data: st.DataObject, value: Any) -> None:
        path = data.draw(st.sampled_from(_paths(ADMIN_GOOD[op])))
        args = _set(ADMIN_GOOD[op], path, value)
        if op == "job-add":
            args["job"] = args["job"] if path == ("job",) else f"new{len(tally)}"
        frame = _frame(json.loads(protocol.encode(protocol.AdminRequest(op=op), "json")) | {"args": args}, "msgpack")
        if frame is None:
            return
        admin.send_raw(frame)
        t0 = time.monotonic()
        reply = admin.recv(timeout_s=10)
        assert reply is not None, f"no reply to {op} {'.'.join(path)} = {str(value)[:60]}"
        assert time.monotonic() - t0 < 1.0 or op == "job-add", f"{op} took {time.monotonic() - t0:.2f} s"
        code = reply.code if isinstance(reply, protocol.ErrorReply) else ("ok" if reply.ok else reply.code)
        assert code in ("ok", *protocol.ERROR_CODES), reply
        assert code != "internal", reply  # a refusal names the field; a daemon failure is a bug
        tally[f"{op} -> {code}"] = tally.get(f"{op} -> {code}", 0) + 1
        if op == "job-add" and code == "ok":
            added.append(args["job"])

    one()
    print(f"fuzzed admin requests: {sum(tally.values())}:", dict(sorted(tally.items())))
    assert daemon.proc is not None and daemon.proc.poll() is None
    assert store_rows(daemon.state_dir, "PRAGMA integrity_check") == [("ok",)]
    stored = {j for (j,) in store_rows(daemon.state_dir, "SELECT job_id FROM jobs")}
    assert stored == {"j", *added}  # every job acknowledged, none refused
    assert daemon.stop() == 0
    daemon.start()  # whatever was stored, the next start serves it
    assert daemon.admin("status")["jobs_damaged"] == {}
