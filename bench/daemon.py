"""Benchmark of nereusd: cold start, and the control plane under 1,024 simulated agents. Prints JSON.

    .venv/bin/python bench/daemon.py [--agents 1024] [--seconds 30] [--jobs 8] [--quick]

1. Cold start: ``nereusd serve`` spawned several times; seconds from exec to READY=1 on $NOTIFY_SOCKET
   (what systemd waits for), median and max.
2. Scale: one daemon; admin queries (status, jobs, job-plan, decisions) in a loop, first with no
   agent (baseline), then while N simulated agents (real CURVE DEALER sockets, one process) register
   and heartbeat at 1 Hz each. Reported: daemon CPU share (fraction of one core), admin latency
   p50/p99 in both phases and their ratio, heartbeats acknowledged per second, daemon RSS over the
   run (start, max, end), and whether any node was wrongly marked lost.
3. Handshake storm: a NEW admin connection's first ``status`` (connect, CURVE handshake, request,
   reply) while N agent connections (another process) do their CURVE handshakes and register at once,
   interleaved with the same measurement on a quiet daemon; medians, maxima and their ratio.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# a bench script named like a package would shadow it: keep this script's folder off the path
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import psutil  # noqa: E402
import zmq  # noqa: E402

from nereusd.daemon import raise_fd_limit  # noqa: E402
from nereusd.wire import protocol  # noqa: E402
from nereusd.wire.client import CurveClient  # noqa: E402
from nereusd.wire.keys import KeyStore, load_bundle  # noqa: E402

BIN = Path(sys.executable).parent


def _config(path: Path, state: Path, interval_s: float, timeout_s: float) -> None:
    path.write_text(f"""
[daemon]
state_dir = "{state}"
log_format = "json"
log_level = "warning"
[control]
port = 0
admin_port = 0
heartbeat_interval_s = {interval_s}
heartbeat_timeout_s = {timeout_s}
[metrics]
port = 0
[slurm]
enabled = false
""")


def _spawn(cfg: Path, tmp: Path) -> tuple[subprocess.Popen[bytes], float]:
    notify = tmp / f"notify-{time.monotonic_ns()}.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(notify))
    sock.settimeout(30)
    t0 = time.perf_counter()
    with open(tmp / "nereusd.log", "ab") as log:
        proc = subprocess.Popen([str(BIN / "nereusd"), "serve", "--config", str(cfg)], stdout=subprocess.DEVNULL,
                                stderr=log, env={**os.environ, "NOTIFY_SOCKET": str(notify)})
    try:
        msg = sock.recv(4096).decode()
    finally:
        sock.close()
        notify.unlink()
    assert "READY=1" in msg, msg
    return proc, time.perf_counter() - t0


def cold_start(tmp: Path, runs: int) -> dict[str, Any]:
    times = []
    for i in range(runs):
        cfg = tmp / f"cold{i}.toml"
        _config(cfg, tmp / f"cold-state{i}", 1.0, 10.0)
        proc, ready_s = _spawn(cfg, tmp)
        times.append(ready_s)
        proc.terminate()
        proc.wait(30)
    # what the exec-to-READY time is made of: the interpreter itself, and importing the daemon
    def wall(code: str) -> float:
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        return time.perf_counter() - t

    bare = statistics.median(wall("pass") for _ in range(runs))
    imports = statistics.median(wall("import nereusd.cli, nereusd.daemon, nereusd.planning") for _ in range(runs))
    return {"runs": runs, "ready_s_median": round(statistics.median(times), 4), "ready_s_max": round(max(times), 4),
            "python_startup_s_median": round(bare, 4), "python_plus_imports_s_median": round(imports, 4)}


def _simulate(endpoint: str, keys: str, jobs: int, agents: int, seconds: float, ready: Any, out: Any) -> None:
    """N agents in one process: register, then one heartbeat per agent per second, spread evenly."""
    bundle = load_bundle(Path(keys))
    raise_fd_limit()
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 4 * agents + 64)
    clients = []
    for i in range(agents):
        c = CurveClient(endpoint, bundle, identity=f"sim-{i}".encode(), context=ctx, monitor=False)
        clients.append((c, f"job{i % jobs}", f"node{i:04d}"))
    devices = (protocol.Device(index=0, kind="gpu", name="sim", memory_bytes=141 << 30),)
    for c, job, node in clients:
        c.send(protocol.Register(job_id=job, node=node, incarnation="sim", devices=devices))
    welcomed, acks, errors = 0, 0, 0

    def drain() -> None:
        nonlocal welcomed, acks, errors
        for c, _, _ in clients:
            while c.sock.poll(0):
                msg = protocol.decode(c.sock.recv(), 1 << 20)
                if isinstance(msg, protocol.Welcome):
                    welcomed += 1
                elif isinstance(msg, protocol.Ack):
                    acks += 1
                elif isinstance(msg, protocol.ErrorReply):
                    errors += 1

    deadline = time.monotonic() + 120
    while welcomed < agents and time.monotonic() < deadline:
        drain()
        time.sleep(0.01)
    ready.set()
    start = time.monotonic()
    seq = 0
    while time.monotonic() - start < seconds:
        seq += 1
        tick = time.monotonic()
        for k, (c, job, node) in enumerate(clients):
            c.send(protocol.Heartbeat(job_id=job, node=node, seq=seq))
            if k % 64 == 63:  # spread the second's heartbeats evenly
                drain()
                lag = tick + (k + 1) / agents - time.monotonic()
                if lag > 0:
                    time.sleep(lag)
        drain()
    end = time.monotonic() + 2
    while time.monotonic() < end:
        drain()
        time.sleep(0.05)
    out.put({"welcomed": welcomed, "heartbeats_sent": seq * agents, "acks": acks, "errors": errors,
             "seconds": time.monotonic() - start - 2})
    for c, _, _ in clients:
        c.close()
    ctx.term()


def _admin_latencies(admin: CurveClient, seconds: float, jobs: int) -> list[float]:
    ops: list[tuple[str, dict[str, Any]]] = [("status", {}), ("jobs", {})] + [(op, {"job": f"job{j}"}) for j in range(min(jobs, 2))
                                            for op in ("job-plan", "decisions")]
    out = []
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        op, args = ops[i % len(ops)]
        i += 1
        t0 = time.perf_counter()
        reply = admin.request(protocol.AdminRequest(op=op, args=args), timeout_s=30)
        out.append(time.perf_counter() - t0)
        assert isinstance(reply, protocol.AdminReply) and reply.ok, reply
        time.sleep(0.05)
    return out


def _slow_handlers(log: Path) -> dict[str, float]:
    """Serve-loop handlers that took > 0.2 s (the daemon logs them), by handler: count and worst ms."""
    out: dict[str, float] = {}
    for line in log.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("event") in ("slow-handler", "slow-admin-op"):
            name = rec.get("handler") or "admin_op_" + rec["op"]
            out[name + "_count"] = out.get(name + "_count", 0) + 1
            out[name + "_max_ms"] = max(out.get(name + "_max_ms", 0), rec["ms"])
    return out


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _started(tmp: Path, name: str, timeout_s: float, admin: str, sim: str
             ) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    """A daemon of its own (state in ``tmp/NAME-state``) with an admin and a simulated agent key
    bundle in ``tmp/ADMIN`` and ``tmp/SIM``; returns the process and its endpoints."""
    state = tmp / f"{name}-state"
    cfg = tmp / f"{name}.toml"
    _config(cfg, state, 1.0, timeout_s)
    ks = KeyStore(state / "keys")
    ks.init()
    ks.create_client(name="admin", user="root", role="admin", out_dir=tmp / admin)
    ks.create_client(name="sim", user="sim", role="agent", out_dir=tmp / sim)
    proc, _ = _spawn(cfg, tmp)
    return proc, json.loads((state / "endpoints.json").read_text())


def scale(tmp: Path, agents: int, jobs: int, seconds: float) -> dict[str, Any]:
    proc, endpoints = _started(tmp, "scale", 10.0, "admin", "sim")
    daemon = psutil.Process(proc.pid)
    admin = CurveClient(endpoints["admin"], load_bundle(tmp / "admin"))
    try:
        for j in range(jobs):  # no planner spec: the control plane is measured, not the search
            reply = admin.request(protocol.AdminRequest(op="job-add", args={"job": f"job{j}", "user": "sim"}))
            assert reply.ok, reply
        rss = [daemon.memory_info().rss]
        idle = _admin_latencies(admin, 5, jobs)

        ready, out = mp.Event(), mp.Queue()  # type: ignore[var-annotated]
        sim = mp.Process(target=_simulate, args=(endpoints["control"], str(tmp / "sim"), jobs, agents, seconds,
                                                 ready, out))
        t_reg = time.perf_counter()
        sim.start()
        ready.wait(180)
        register_s = time.perf_counter() - t_reg
        cpu0, t0 = daemon.cpu_times(), time.perf_counter()
        loaded: list[float] = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            loaded += _admin_latencies(admin, 1.0, jobs)
            rss.append(daemon.memory_info().rss)
        cpu1, t1 = daemon.cpu_times(), time.perf_counter()
        result = out.get(timeout=120)
        sim.join(60)
        status = admin.request(protocol.AdminRequest(op="status")).data
        rss.append(daemon.memory_info().rss)
        cpu_share = ((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)) / (t1 - t0)
        return {
            "agents": agents, "jobs": jobs, "seconds": round(t1 - t0, 1),
            "register_all_s": round(register_s, 2), "welcomed": result["welcomed"],
            "heartbeats_per_s_acked": round(result["acks"] / result["seconds"], 1),
            "heartbeat_errors": result["errors"],
            "daemon_cpu_share_of_one_core": round(cpu_share, 3),
            "admin_p50_ms_idle": round(_pct(idle, 0.5) * 1e3, 2), "admin_p99_ms_idle": round(_pct(idle, 0.99) * 1e3, 2),
            "admin_p50_ms_loaded": round(_pct(loaded, 0.5) * 1e3, 2),
            "admin_p99_ms_loaded": round(_pct(loaded, 0.99) * 1e3, 2),
            "admin_p99_ratio_loaded_vs_idle": round(_pct(loaded, 0.99) / _pct(idle, 0.99), 2),
            "admin_queries": len(idle) + len(loaded),
            "rss_mib_start": round(rss[0] / 2**20, 1), "rss_mib_max": round(max(rss) / 2**20, 1),
            "rss_mib_end": round(rss[-1] / 2**20, 1),
            "nodes_lost": status["nodes"]["lost"], "nodes_alive_at_end": status["nodes"]["alive"],
            "slow_handlers": _slow_handlers(tmp / "nereusd.log"),
        }
    finally:
        admin.close()
        proc.terminate()
        proc.wait(30)


STORM_EXTRA_FRAMES = 20  # per storm connection after its register: more registrations (refused), as a flood


def _storm(endpoint: str, keys: str, agents: int, rounds: int, go: Any, started: Any, done: Any) -> None:
    """Per round: wait for ``go``, open N agent connections at once, each registers and sends
    STORM_EXTRA_FRAMES more; ``started`` is set once a tenth of them are connecting."""
    bundle = load_bundle(Path(keys))
    raise_fd_limit()
    for r in range(rounds):
        if not go.wait(120):
            return
        go.clear()
        ctx = zmq.Context()
        devices = (protocol.Device(index=0, kind="gpu", name="sim", memory_bytes=141 << 30),)
        clients = []
        for i in range(agents):
            c = CurveClient(endpoint, bundle, identity=f"storm-{r}-{i}".encode(), context=ctx, monitor=False)
            clients.append(c)
            for k in range(1 + STORM_EXTRA_FRAMES):
                c.send(protocol.Register(job_id="storm", node=f"s{r}-{i}-{k}", incarnation="sim", devices=devices))
            if i == agents // 10:
                started.set()
        for c in clients:  # every frame answered (a welcome, or refused: one node per connection)
            for _ in range(1 + STORM_EXTRA_FRAMES):
                c.recv(timeout_s=60)
        for c in clients:
            c.close()
        ctx.term()
        done.set()


def _first_request_s(endpoint: str, bundle: Any) -> float:
    """A fresh connection: connect, CURVE handshake, ``status``, reply."""
    t0 = time.perf_counter()
    c = CurveClient(endpoint, bundle)
    try:
        reply = c.request(protocol.AdminRequest(op="status"), timeout_s=60)
        assert isinstance(reply, protocol.AdminReply) and reply.ok, reply
        return time.perf_counter() - t0
    finally:
        c.close()


def handshake_storm(tmp: Path, agents: int, rounds: int) -> dict[str, Any]:
    proc, endpoints = _started(tmp, "storm", 30.0, "storm-admin", "storm-sim")
    bundle = load_bundle(tmp / "storm-admin")
    go, started, done = mp.Event(), mp.Event(), mp.Event()
    storm = mp.Process(target=_storm, args=(endpoints["control"], str(tmp / "storm-sim"), agents, rounds, go,
                                            started, done))
    storm.start()
    quiet: list[float] = []
    loaded: list[float] = []
    try:
        assert _first_request_s(endpoints["admin"], bundle) > 0
        c = CurveClient(endpoints["admin"], bundle)
        reply = c.request(protocol.AdminRequest(op="job-add", args={"job": "storm", "user": "sim"}), timeout_s=30)
        c.close()
        assert reply.ok, reply
        for _ in range(rounds):  # interleaved: quiet, then under the storm
            quiet.append(_first_request_s(endpoints["admin"], bundle))
            done.clear()
            started.clear()
            go.set()
            assert started.wait(60), "the storm did not start"
            loaded.append(_first_request_s(endpoints["admin"], bundle))
            assert done.wait(120), "the storm's connections were not all answered"
    finally:
        storm.terminate()
        storm.join(30)
        proc.terminate()
        proc.wait(30)
    return {"agents_per_storm": agents, "rounds": rounds,
            "first_request_ms_quiet_median": round(statistics.median(quiet) * 1e3, 1),
            "first_request_ms_quiet_max": round(max(quiet) * 1e3, 1),
            "first_request_ms_storm_median": round(statistics.median(loaded) * 1e3, 1),
            "first_request_ms_storm_max": round(max(loaded) * 1e3, 1),
            "storm_vs_quiet_median_ratio": round(statistics.median(loaded) / statistics.median(quiet), 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--agents", type=int, default=1024)
    p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--seconds", type=float, default=30)
    p.add_argument("--cold-runs", type=int, default=5)
    p.add_argument("--storm-agents", type=int, default=150)
    p.add_argument("--storm-rounds", type=int, default=7)
    p.add_argument("--only", choices=("cold-start", "scale", "handshake-storm"), default=None)
    p.add_argument("--quick", action="store_true",
                   help="all three parts, the 1,024 agents kept: 5 s of scale, 3 cold starts, 3 storm rounds")
    args = p.parse_args()
    if args.quick:
        args.seconds, args.cold_runs, args.storm_rounds = 5.0, 3, 3
    with tempfile.TemporaryDirectory(prefix="nereus-bench-") as d:
        tmp = Path(d)
        out: dict[str, Any] = {"benchmark": "daemon", "quick": args.quick, "cpu_count": os.cpu_count(),
                               "load_avg_1m_at_start": round(os.getloadavg()[0], 2)}
        if args.only in (None, "cold-start"):
            out["cold_start"] = cold_start(tmp, args.cold_runs)
        if args.only in (None, "scale"):
            out["scale"] = scale(tmp, args.agents, args.jobs, args.seconds)
        if args.only in (None, "handshake-storm"):
            out["handshake_storm"] = handshake_storm(tmp, args.storm_agents, args.storm_rounds)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
