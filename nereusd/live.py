"""`make run`: the live elastic job on the embedded default (no Slurm, no GPU).

    python -m nereusd.live [--job-file etc/jobs/live.toml] [--steps 26] [--out runs/live-STAMP] [--acts none]

Starts nereusd as a child with the local allocation source (virtual nodes of 2 CPU worker slots),
registers a GRPO job of the tiny Llama-style model on a synthetic verifiable task, and lets the
daemon run it: the local source starts one node agent per granted node, the anchor's agent starts
the job driver, every agent starts its workers, the daemon orders the placement and the workers
train. While it trains, this script changes the job's world by step count (not by wall time, so a
loaded machine plays the same story):

    grow to 4 workers -> response-length jump (opportunistic replan) -> graceful shrink (drain)
    -> grow again -> preemption notice (SIGTERM, as Slurm sends it: drained, then gone)
    -> grow again -> abrupt loss of that node (SIGKILL of its agent and workers) -> recovery

It shows a line per step (reward, step time, plan, pool, transitions in flight) and ends with a
summary: reward curve, per-step time, each transition (trigger, dL, L_tran predicted vs measured,
bytes, verdict), written as report.json and report.png under the output folder, beside the
driver's metrics (metrics/metrics.jsonl, metrics/tb/ for TensorBoard), the daemon's /metrics text
(metrics.prom) and ``nereusctl plot``'s picture (job.png). Watch it with
nereusctl while it runs (the command is printed at start).

``--acts none`` plays nothing: the job file (yours, e.g. a ``[model] path`` HF directory) runs its steps
under the daemon on the first grant, with the same display, report and metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
JOB = "live"
USER = os.environ.get("USER") or "nereus"
SLOTS_PER_NODE = 2


TAIL_STEPS = 8  # steps run after the last change settled, before the run ends


@dataclass(slots=True)
class Act:
    """One change of the job's world, played once the driver has done ``at_step`` steps, the previous
    act has settled (a transition after it finished, or its ``settle_s`` passed) and none is in flight."""

    name: str
    at_step: int
    run: Callable[[LiveRun], str]
    done_at: int | None = None
    note: str = ""
    settle_s: float = 90.0  # longest wait for a transition after it (an act may lead to none: not worth it)
    played_at: float = 0.0
    wall_t: float = 0.0  # time.time() when played, to match the driver's events
    transitions_before: int = 0




@dataclass(slots=True)
class LiveRun:
    out: Path
    job_file: Path
    steps: int
    jump_tokens: int
    verify: bool = False
    heartbeat_timeout_s: float = 15.0
    daemon: subprocess.Popen[bytes] | None = None
    endpoints: dict[str, str] = field(default_factory=dict)
    events_seen: int = 0
    steps_done: list[dict[str, Any]] = field(default_factory=list)
    driver_events: list[dict[str, Any]] = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)

    @property
    def state(self) -> Path:
        return self.out / "state"

    @property
    def events_path(self) -> Path:
        return self.out / "driver-events.jsonl"

    # --- set-up -------------------------------------------------------------------------------------
    def setup(self) -> None:
        from nereusd.wire.keys import KeyStore

        self.out.mkdir(parents=True, exist_ok=True)
        ks = KeyStore(self.state / "keys")
        ks.init()
        ks.create_client(name="admin", user="root", role="admin", out_dir=self.out / "admin")
        ks.create_client(name=f"{USER}-agent", user=USER, role="agent", out_dir=self.state / "keys" / f"agent-{USER}")
        py = sys.executable
        driver = (f"{py} -m agent.driver --events {self.events_path} --checkpoint-every 4 "
                  f"--checkpoint-dir {self.out / 'checkpoints'} --workload-file {self.out / 'workload.json'}"
                  f" --metrics-dir {self.out / 'metrics'}"
                  f" --steps {10 * self.steps + 1000} --heal-after-s 15" + (" --verify" if self.verify else ""))
        (self.out / "nereusd.toml").write_text(f"""# written by python -m nereusd.live
[daemon]
state_dir = "{self.state}"
log_format = "json"
order_timeout_s = 180
[control]
port = 0
admin_port = 0
heartbeat_interval_s = 0.5
heartbeat_timeout_s = {self.heartbeat_timeout_s}
[metrics]
port = 0
[slurm]
enabled = false
[planner]
pool_settle_s = 1.0
[local]
num_nodes = 4
slots_per_node = {SLOTS_PER_NODE}
driver_cmd = "{driver}"
""")

    def start_daemon(self) -> None:
        log = (self.out / "nereusd.log").open("ab")
        self.daemon = subprocess.Popen([sys.executable, "-m", "nereusd.cli", "serve", "--config",
                                        str(self.out / "nereusd.toml")], stdout=log, stderr=subprocess.STDOUT,
                                       cwd=ROOT, start_new_session=True)
        deadline = time.monotonic() + 120
        path = self.state / "endpoints.json"
        while not path.exists():
            if self.daemon.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"nereusd did not start (see {self.out / 'nereusd.log'})")
            time.sleep(0.1)  # polling a file the daemon writes once it is bound; bounded above
        self.endpoints = json.loads(path.read_text())

    def admin(self, op: str, **args: Any) -> Any:
        from nereusd.wire import protocol
        from nereusd.wire.client import CurveClient
        from nereusd.wire.keys import load_bundle

        c = CurveClient(self.endpoints["admin"], load_bundle(self.out / "admin"))
        try:
            reply = c.request(protocol.AdminRequest(op=op, args=args), timeout_s=30)
        finally:
            c.close()
        if not isinstance(reply, protocol.AdminReply) or not reply.ok:
            raise RuntimeError(f"nereusd refused {op}: {getattr(reply, 'error', reply)}")
        return reply.data

    def add_job(self) -> None:
        from nereusd.jobfile import job_spec

        spec = job_spec(self.job_file, anchor_job_id=f"local-{JOB}")
        self.admin("job-add", job=JOB, user=USER, spec=spec)

    # --- world changes ------------------------------------------------------------------------------
    def nodes(self, state: str = "alive") -> list[str]:
        return [n["node"] for n in self.admin("job", job=JOB)["nodes"] if n["state"] == state]

    def grow(self) -> str:
        # a node that just left (preempted) is given back to the source when its agent is seen gone: until
        # then the job still holds it and a grow would pass max_gpus; ask again for a bounded while
        deadline = time.monotonic() + 60.0
        while True:
            try:
                self.admin("alloc", action="grow", job=JOB, nodes=1)
                return "asked the local source for one more node"
            except RuntimeError as exc:
                if "would pass max_gpus" not in str(exc) or time.monotonic() > deadline:
                    raise
            time.sleep(1.0)  # the source's poll period: it notices an exited agent on its next poll

    def shrink(self) -> str:
        node = self.nodes()[-1]
        self.admin("alloc", action="shrink", job=JOB, names=[node])
        return f"graceful release of {node} (drained first)"

    def workload(self, **data: int) -> None:
        """Tell the driver (it reads the file at its next safe point); written whole, then renamed."""
        path = self.out / "workload.json"
        old = json.loads(path.read_text()) if path.exists() else {}
        tmp = self.out / "workload.json.tmp"
        tmp.write_text(json.dumps({**old, **data}))
        tmp.replace(path)

    def response_jump(self) -> str:
        """The responses grow (as RL's do): the driver takes the new length at its next safe point."""
        self.workload(max_new_tokens=self.jump_tokens)
        return f"responses may now run to {self.jump_tokens} tokens (opportunistic replan if it pays)"

    def preempt(self) -> str:
        """What Slurm does at a preemption or a time limit: SIGTERM to every process of the node's step.
        The agent tells the daemon it is leaving, the daemon drains the node, then lets it go."""
        node = self.nodes()[-1]
        for pid in self._agents(node):
            os.killpg(pid, signal.SIGTERM)
        return f"SIGTERM to node {node} (a preemption notice: drained, then it goes)"

    def _agents(self, node: str) -> list[int]:
        import psutil

        out = []
        for p in psutil.process_iter(["pid", "cmdline"]):
            cmd = p.info["cmdline"] or []
            if "agent.node" in cmd and "--node" in cmd and cmd[cmd.index("--node") + 1] == node \
                    and "--endpoint" in cmd and cmd[cmd.index("--endpoint") + 1] == self.endpoints["control"]:
                out.append(p.info["pid"])  # this daemon's agent of that node (another run's have another endpoint)
        return out

    def kill_node(self) -> str:
        node = self.nodes()[-1]
        agents = self._agents(node)
        for pid in agents:
            os.killpg(pid, signal.SIGKILL)  # its agent and its workers, no goodbye
        return f"SIGKILL of node {node} ({len(agents)} agent process group)"

    # --- watching -----------------------------------------------------------------------------------
    def keep_records(self) -> None:
        """What the daemon exported and recorded, as a user would see it: its /metrics text
        (metrics.prom) and ``nereusctl plot``'s picture of the job (job.png)."""
        import urllib.request

        from nereusd.plot import PlotError, plot_job

        try:
            url = self.admin("status")["endpoints"]["metrics"]
            (self.out / "metrics.prom").write_bytes(urllib.request.urlopen(url, timeout=30).read())
            plot_job(JOB, self.admin("measurements", job=JOB), self.admin("transitions", job=JOB),
                     self.out / "job.png")
        except (OSError, RuntimeError, KeyError, PlotError) as exc:
            print(f"could not keep the daemon's records: {exc}", flush=True)

    def read_events(self) -> list[dict[str, Any]]:
        if not self.events_path.exists():
            return []
        lines = self.events_path.read_text().splitlines()
        new = [json.loads(x) for x in lines[self.events_seen:] if x.strip()]
        self.events_seen = len(lines)
        self.driver_events += new
        return new

    def transitions_done(self) -> int:
        return sum(1 for e in self.driver_events if e["event"] in ("transition-done", "transition-failed"))

    def settled(self, played: list[Act]) -> bool:
        """The last act's change went through (a transition ended after it), or it never will."""
        if not played:
            return True
        last = played[-1]
        return self.transitions_done() > last.transitions_before or time.monotonic() - last.played_at > last.settle_s

    def in_flight(self) -> int:
        return sum(1 for t in self.admin("transitions", job=JOB) if t["state"] in ("planned", "ordered"))

    def line(self, ev: dict[str, Any]) -> str:
        elapsed = time.monotonic() - self.t0
        if ev["event"] == "step":
            return (f"[{elapsed:6.1f}s] step {ev['step']:3d}  reward {ev['reward']:+.3f}  "
                    f"step {ev['seconds']:5.2f} s  resp {ev['response_tokens']:4.1f} tok  plan v{ev['plan_version']}  "
                    f"workers {ev['workers']}")
        if ev["event"] in ("transition-done", "transition-failed", "restored", "step-failed", "workload",
                           "transition-start", "gave-up", "driver-failed", "rebound", "rebind-failed"):
            rest = {k: v for k, v in ev.items() if k not in ("event", "t")}
            return f"[{elapsed:6.1f}s] {ev['event']}: {json.dumps(rest, default=str)[:160]}"
        return ""


def _plan_text(stages: list[dict[str, Any]]) -> str:
    return ", ".join(f"{s['model_stage']} {s['dp']}x(TP{s['tp']}PP{s['pp']})" for s in stages)


def summarise(run: LiveRun, acts: list[Act], wall_s: float) -> dict[str, Any]:
    transitions = run.admin("transitions", job=JOB)
    decisions = {d["id"]: d for d in run.admin("decisions", job=JOB)}
    done = {e.get("transition"): e for e in run.driver_events if e["event"] == "transition-done"}
    rows = []
    for t in transitions:
        d = decisions.get(t["decision_id"]) or {}
        rows.append({"id": t["id"], "from_version": t["from_version"], "to_version": t["to_version"],
                     "trigger": d.get("trigger"), "reason": d.get("reason"), "delta_l_s": d.get("delta_l_s"),
                     "l_tran_predicted_s": t["predicted_s"], "l_tran_measured_s": t["measured_s"],
                     "bytes_predicted": t["bytes_moved"],
                     "bytes_sent": (done.get(t["id"]) or {}).get("bytes_sent"), "state": t["state"],
                     "verdict": d.get("rule")})
    rejected = [{"id": d["id"], "trigger": d["trigger"], "rule": d["rule"], "reason": d["reason"],
                 "delta_l_s": d["delta_l_s"], "l_tran_s": d["l_tran_s"]}
                for d in decisions.values() if not d["admitted"]]
    return {"job": JOB, "wall_s": round(wall_s, 1), "steps": run.steps_done, "transitions": rows,
            "rejected_decisions": rejected,
            "acts": [{"name": a.name, "at_step": a.done_at, "what": a.note, "t": a.wall_t} for a in acts],
            "plan": run.admin("job-plan", job=JOB), "driver_events": run.driver_events}


def plot(report: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    steps = report["steps"]
    xs = [s["step"] for s in steps]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    ax1.plot(xs, [s["reward"] for s in steps], marker="o", ms=3)
    ax1.set_ylabel("mean reward")
    ax2.bar(xs, [s["seconds"] for s in steps], color=[f"C{s['plan_version'] % 10}" for s in steps])
    ax2.set_ylabel("step time (s), colour = plan")
    ax2.set_xlabel("RL step")
    for a in report["acts"]:
        if a["at_step"] is not None:
            for ax in (ax1, ax2):
                ax.axvline(a["at_step"] - 0.5, color="grey", ls="--", lw=0.8)
            ax1.annotate(a["name"], (a["at_step"] - 0.5, ax1.get_ylim()[1]), fontsize=7, rotation=90, va="top")
    fig.suptitle(f"nereus live job: {len(steps)} steps, {len(report['transitions'])} transitions, "
                 f"{report['wall_s']:.0f} s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def print_summary(report: dict[str, Any], out: Path) -> None:
    steps = report["steps"]
    bars = " ▁▂▃▄▅▆▇█"
    rewards = [s["reward"] for s in steps]
    lo, hi = (min(rewards), max(rewards)) if rewards else (0.0, 1.0)
    spark = "".join(bars[int((r - lo) / ((hi - lo) or 1) * 8)] for r in rewards)
    print("\n=== summary ===")
    print(f"steps: {len(steps)} in {report['wall_s']:.0f} s; reward {spark} ({rewards[0]:+.3f} -> {rewards[-1]:+.3f})"
          if steps else "no step ran")
    print("step time (s): " + " ".join(f"{s['seconds']:.1f}" for s in steps))
    print(f"\n{'id':>3} {'v':>7} {'trigger':<14} {'dL s/step':>9} {'L_tran pred':>11} {'measured':>9} "
          f"{'bytes':>10} {'state':<8} verdict")
    for t in report["transitions"]:
        dl = f"{t['delta_l_s']:.3f}" if t["delta_l_s"] is not None else "-"
        meas = f"{t['l_tran_measured_s']:.2f}" if t["l_tran_measured_s"] is not None else "-"
        sent = t["bytes_sent"] if t["bytes_sent"] is not None else "-"
        print(f"{t['id']:>3} {t['from_version']:>3}->{t['to_version']:<3} {str(t['trigger']):<14} {dl:>9} "
              f"{t['l_tran_predicted_s']:>11.3f} {meas:>9} {sent!s:>10} {t['state']:<8} {t['verdict']}")
    if report["rejected_decisions"]:
        print("\nnot admitted:")
        for d in report["rejected_decisions"]:
            print(f"  decision {d['id']} ({d['trigger']}): {d['rule']}: {d['reason']}")
    print(f"\nplan now: v{report['plan']['plan_version']}: {_plan_text(report['plan']['stages'])}")
    print(f"report: {out / 'report.json'}" + (f", plot: {out / 'report.png'}" if (out / "report.png").exists() else ""))
    if (out / "metrics" / "metrics.jsonl").exists():
        print(f"per-step metrics: {out / 'metrics' / 'metrics.jsonl'}  (tensorboard --logdir {out / 'metrics' / 'tb'})"
              + (f"; the daemon's view: {out / 'job.png'}" if (out / "job.png").exists() else ""))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nereusd.live", description=__doc__.split("\n\n")[0])
    p.add_argument("--job-file", type=Path, default=ROOT / "etc" / "jobs" / "live.toml")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--timeout-s", type=float, default=900.0, help="give up after this long")
    p.add_argument("--verify", action="store_true", help="hash every logical tensor around each transition")
    p.add_argument("--heartbeat-timeout-s", type=float, default=15.0, help="a silent node is lost after this")
    p.add_argument("--acts", choices=("story", "none"), default="story",
                   help="story: play growth, a response jump, a shrink, a preemption and a node loss; none: run "
                        "the job file on its first grant (your own job under the daemon, nothing scripted)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    out = args.out or ROOT / "runs" / time.strftime("live-%Y%m%d-%H%M%S")
    if out.exists():
        shutil.rmtree(out)
    run = LiveRun(out=out.resolve(), job_file=args.job_file.resolve(), steps=args.steps,
                  jump_tokens=16, verify=args.verify,
                  heartbeat_timeout_s=args.heartbeat_timeout_s)
    n = args.steps
    acts = [Act("grow", 3, LiveRun.grow), Act("response jump", round(n * 0.25), LiveRun.response_jump, settle_s=25.0),
            Act("shrink", round(n * 0.35), LiveRun.shrink),
            Act("grow", round(n * 0.45), LiveRun.grow), Act("preempt", round(n * 0.55), LiveRun.preempt),
            Act("grow", round(n * 0.65), LiveRun.grow), Act("node loss", round(n * 0.8), LiveRun.kill_node)]
    if args.acts == "none":
        acts = []
    run.setup()
    run.start_daemon()
    print(f"nereusd up ({socket.gethostname()}), state in {run.state}")
    print(f"watch it:  nereusctl --state-dir {run.state} --keys {out / 'admin'} job-plan {JOB}   "
          f"(also: transitions {JOB}, decisions {JOB}, events)")
    code = 1
    try:
        run.add_job()
        deadline = time.monotonic() + args.timeout_s
        pending = list(acts)
        played: list[Act] = []
        ending: int | None = None
        finished = False
        while time.monotonic() < deadline and not finished:
            for ev in run.read_events():
                text = run.line(ev)
                if text:
                    print(text, flush=True)
                if ev["event"] == "step":
                    run.steps_done = [s for s in run.steps_done if s["step"] < ev["step"]] + [ev]
                if ev["event"] == "driver-failed":
                    print(ev.get("traceback", ""), flush=True)
                finished = finished or ev["event"] in ("done", "gave-up", "driver-failed")
                code = 0 if ev["event"] == "done" else code
            done_steps = len(run.steps_done)
            if not pending and not ending and run.settled(played) and run.in_flight() == 0:
                ending = max(run.steps, done_steps + (TAIL_STEPS if acts else 0))  # the story is told: a few more, then end
                run.workload(steps=ending)
                print(f"[{time.monotonic() - run.t0:6.1f}s] >>> every change played: the run ends at step {ending}",
                      flush=True)
            if pending and done_steps >= pending[0].at_step and run.settled(played) and run.in_flight() == 0:
                act = pending.pop(0)
                act.transitions_before = run.transitions_done()
                act.played_at, act.wall_t = time.monotonic(), time.time()
                act.done_at, act.note = done_steps, act.run(run)
                played.append(act)
                print(f"[{time.monotonic() - run.t0:6.1f}s] >>> {act.name}: {act.note}", flush=True)
            time.sleep(0.5)  # the display's refresh period: the events file is polled, nothing waits on it
        if not finished:
            print(f"gave up after {args.timeout_s:g} s (see {out}/nereusd.log and the driver events)")
        run.keep_records()
        report = summarise(run, acts, time.monotonic() - run.t0)
        (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
        plot(report, out / "report.png")
        print_summary(report, out)
    finally:
        if run.daemon is not None and run.daemon.poll() is None:
            run.daemon.terminate()  # the local source stops every node's agent and workers with it
            try:
                run.daemon.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(run.daemon.pid, signal.SIGKILL)
    return code


if __name__ == "__main__":
    sys.exit(main())
