"""nereusctl subcommands that ask the running daemon (its admin endpoint, admin CURVE key).

    nereusctl status | jobs | keys                      daemon, jobs, authorised keys
    nereusctl job JOB                                   one job's nodes and their devices
    nereusctl job-plan JOB                              per model-stage layout, predicted vs measured
    nereusctl decisions JOB | transitions JOB           admitted and rejected replans; transitions
    nereusctl transition ID | explain ID                one transition (DAG summary); one decision
    nereusctl alloc [JOB] [--grow N | --shrink NODE..]  allocations; ask the allocation source
    nereusctl job-add JOB --user USER [--spec JSON]     register a job (local source, tests)
    nereusctl job-add JOB --user USER --job-file PATH   register a live job from its job file (nereusd/jobfile.py)
    nereusctl events [JOB]

Where the daemon is: --endpoint, else $NEREUS_CTL_ENDPOINT, else endpoints.json in --state-dir
($NEREUS_STATE_DIR, default /var/lib/nereus). The admin key bundle: --keys, else $NEREUS_CTL_KEYS,
else ~/.config/nereus/admin (make one with `nereusd keys create NAME --user $USER --role admin --out DIR`).
``nereusctl plan`` is the what-if planner (nereusd/whatif.py); the running job's plan is ``job-plan``.
Exit codes: 0 ok, 1 the daemon reports a failure (e.g. not found), 2 bad input, 3 daemon unreachable or
key refused.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from pathlib import Path
from typing import Any

from nereusd.wire import protocol

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3


def _endpoint(args: argparse.Namespace) -> str:
    if args.endpoint:
        return str(args.endpoint)
    if os.environ.get("NEREUS_CTL_ENDPOINT"):
        return os.environ["NEREUS_CTL_ENDPOINT"]
    state_dir = Path(args.state_dir or os.environ.get("NEREUS_STATE_DIR") or "/var/lib/nereus")
    try:
        return str(json.loads((state_dir / "endpoints.json").read_text())["admin"])
    except (OSError, ValueError, KeyError):
        raise _Fail(EXIT_UNREACHABLE, f"cannot find the daemon: no endpoints.json in {state_dir}; pass "
                    "--endpoint tcp://HOST:PORT or --state-dir DIR (is nereusd running?)") from None


def _keys_dir(args: argparse.Namespace) -> Path:
    return Path(args.keys or os.environ.get("NEREUS_CTL_KEYS") or Path.home() / ".config" / "nereus" / "admin")


class _Fail(Exception):
    def __init__(self, code: int, message: str) -> None:
        self.code = code
        super().__init__(message)


def ask(args: argparse.Namespace, op: str, **op_args: Any) -> Any:
    from nereusd.wire.client import AuthRefused, CurveClient, Unreachable
    from nereusd.wire.keys import load_bundle
    from planner.errors import SpecError

    try:
        bundle = load_bundle(_keys_dir(args))
    except SpecError as exc:
        raise _Fail(EXIT_USAGE, f"{exc}; pass --keys DIR") from None
    import zmq

    endpoint = _endpoint(args)
    try:
        client = CurveClient(endpoint, bundle)
    except zmq.ZMQError as exc:
        raise _Fail(EXIT_USAGE, f"bad endpoint {endpoint!r} ({exc}): give tcp://HOST:PORT") from None
    try:
        reply = client.request(protocol.AdminRequest(op=op, args=op_args), timeout_s=args.timeout)
    except AuthRefused as exc:
        raise _Fail(EXIT_UNREACHABLE, f"{exc}: this key is not an authorised admin key of this daemon "
                    "(nereusd keys list; create one with --role admin)") from None
    except Unreachable as exc:
        raise _Fail(EXIT_UNREACHABLE, str(exc)) from None
    finally:
        client.close()
    if isinstance(reply, protocol.ErrorReply):
        raise _Fail(EXIT_FAILED, f"{reply.code}: {reply.message}")
    if not reply.ok:
        raise _Fail(EXIT_USAGE if reply.code == "invalid" else EXIT_FAILED, f"{reply.code}: {reply.error}")
    return reply.data


# --- rendering ------------------------------------------------------------------------------------


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v > 1e9:  # a Unix time
            return dt.datetime.fromtimestamp(v, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return ",".join(_cell(x) for x in v) if len(v) <= 8 else f"{_cell(v[0])}..{_cell(v[-1])} ({len(v)})"
    return str(v)


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(columns, widths)).rstrip()]
    lines += ["  ".join(x.ljust(w) for x, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines)


def kv(data: dict[str, Any], keys: list[str] | None = None) -> str:
    keys = keys or list(data)
    width = max(len(k) for k in keys)
    return "\n".join(f"{k.ljust(width)}  {_cell(data.get(k)) if not isinstance(data.get(k), dict) else json.dumps(data.get(k))}"
                     for k in keys)


def _emit(args: argparse.Namespace, data: Any, render) -> int:
    print(json.dumps(data, indent=1, default=str) if args.json else render(data))
    return EXIT_OK


# --- subcommands ----------------------------------------------------------------------------------


def _status(args: argparse.Namespace) -> int:
    return _emit(args, ask(args, "status"), lambda d: kv(d, ["pid", "uptime_s", "jobs", "jobs_damaged",
                                                            "agents_connected", "nodes",
                                                            "allocation_source", "planner", "endpoints",
                                                            "state_dir"]))


def _jobs(args: argparse.Namespace) -> int:
    cols = ["job", "user", "state", "slurm_job_id", "nodes_alive", "nodes", "gpus", "members_pending", "plan_version",
            "updated_at"]

    def render(d: list[dict[str, Any]]) -> str:
        if not d:
            return "no jobs"
        rows = [{**r, "state": "DAMAGED" if r.get("damaged") else r["state"]} for r in d]
        notes = [f"{r['job']}: damaged: {r['damaged']}" for r in d if r.get("damaged")]
        return "\n".join([table(rows, cols), *notes])
    return _emit(args, ask(args, "jobs"), render)


def _job_plan(args: argparse.Namespace) -> int:
    def render(d: dict[str, Any]) -> str:
        head = (f"job {d['job']}  plan v{d['plan_version']}  step: predicted {_cell(d['predicted_step_s'])} s, "
                f"measured {_cell(d['measured_step_s'])} s (step {_cell(d['measured_at_step'])})")
        if not d["stages"]:
            return head + "\nno plan yet (no agent registered, or no feasible plan: see `nereusctl decisions`)"
        return head + "\n" + table(d["stages"], ["model_stage", "tp", "pp", "dp", "gpus", "micro_batch_size",
                                                 "grad_accum", "predicted_s", "measured_s"])
    return _emit(args, ask(args, "job-plan", job=args.job), render)


def _decisions(args: argparse.Namespace) -> int:
    cols = ["id", "at", "trigger", "admitted", "rule", "from_version", "to_version", "delta_l_s", "l_tran_s", "h_x",
            "gamma", "decision_ms", "reason"]
    return _emit(args, ask(args, "decisions", job=args.job), lambda d: table(d, cols) if d else "no decisions yet")


def _transitions(args: argparse.Namespace) -> int:
    cols = ["id", "decision_id", "state", "from_version", "to_version", "bytes_moved", "predicted_s", "measured_s",
            "parts_pending", "updated_at"]
    return _emit(args, ask(args, "transitions", job=args.job), lambda d: table(d, cols) if d else "no transitions")


def _transition(args: argparse.Namespace) -> int:
    def render(d: dict[str, Any]) -> str:
        top = kv(d, ["id", "job_id", "decision_id", "state", "from_version", "to_version", "bytes_moved",
                     "predicted_s", "measured_s", "parts_pending"])
        dag = d.get("dag") or {}
        summary = "\n".join(f"  {k}: {json.dumps(v) if not isinstance(v, str) else v}" for k, v in dag.items()
                            if not isinstance(v, list) or len(v) <= 8)
        return f"{top}\nDAG:\n{summary or '  (empty)'}\nhistory:\n" + table(d["history"], ["at", "from_state",
                                                                                      "to_state", "reason"])
    return _emit(args, ask(args, "transition", id=args.id), render)


def _explain(args: argparse.Namespace) -> int:
    def render(d: dict[str, Any]) -> str:
        verdict = "ADMITTED" if d["admitted"] else "REJECTED"
        lines = [f"decision {d['id']} for job {d['job_id']}: {verdict} by rule {d['rule']} "
                 f"({d['trigger']} trigger)", f"  why: {d['reason']}"]
        trig = (d.get("inputs") or {}).get("trigger") or {}
        for r in trig.get("reasons", []):
            lines.append(f"  trigger: {r}")
        lines.append(f"  dL = {_cell(d['delta_l_s'])} s/step, L_tran = {_cell(d['l_tran_s'])} s, "
                     f"H_x = {_cell(d['h_x'])} steps, gamma = {_cell(d['gamma'])}, decided in "
                     f"{_cell(d['decision_ms'])} ms")
        lines.append(f"  plan v{_cell(d['from_version'])} -> v{_cell(d['to_version'])}; transitions: "
                     f"{_cell(d['transitions']) if d['transitions'] else 'none'}")
        correction = l_tran_line((d.get("inputs") or {}).get("l_tran"))
        if correction:
            lines.append(correction)
        for r in (d.get("inputs") or {}).get("infeasible_reasons", []):
            lines.append(f"  infeasible: {r}")
        return "\n".join(lines)
    return _emit(args, ask(args, "explain", id=args.id), render)


def l_tran_line(l_tran: dict[str, Any] | None) -> str:
    """How L_tran was priced: the transition model's figure corrected by the job's measured transitions."""
    if not l_tran:
        return ""
    rate = l_tran.get("measured_bytes_per_s")
    seen = f", measured {rate / 1e9:.3g} GB/s" if rate else ""
    return (f"  L_tran = {_cell(l_tran.get('fixed_s'))} s + {_cell(l_tran.get('factor'))} x "
            f"{_cell(l_tran.get('model_s'))} s (model) = {_cell(l_tran.get('corrected_s'))} s, "
            f"from {l_tran.get('samples', 0)} measured transition(s){seen}")


def _alloc(args: argparse.Namespace) -> int:
    op_args: dict[str, Any] = {}
    if args.job:
        op_args["job"] = args.job
    if args.grow is not None or args.shrink:
        if not args.job:
            raise _Fail(EXIT_USAGE, "--grow/--shrink need a JOB")
        op_args.update({"action": "grow", "nodes": args.grow} if args.grow is not None
                       else {"action": "shrink", "names": args.shrink})
    cols = ["id", "job_id", "at", "gpus", "nodes", "source", "reason"]
    return _emit(args, ask(args, "alloc", **op_args),
                 lambda d: (f"source: {d['source']}" + (" (request queued)" if d["requested"] else "") + "\n"
                            + (f"draining (given back once their state has moved): {', '.join(d['draining'])}\n"
                               if d.get("draining") else "")
                            + (table(d["allocations"], cols) if d["allocations"] else "no allocations recorded")))


def _job(args: argparse.Namespace) -> int:
    def render(d: dict[str, Any]) -> str:
        nodes = [{"node": n["node"], "state": n["state"], "slurm_job_id": n.get("slurm_job_id"),
                  "devices": ",".join(f"{x['kind']}{x['index']}" for x in n.get("devices") or []),
                  "draining": n.get("draining") or ""} for n in d["nodes"]]
        return (f"job {d['job_id']} ({d['state']})\n"
                + (table(nodes, ["node", "state", "slurm_job_id", "devices", "draining"]) if nodes else "no nodes"))
    return _emit(args, ask(args, "job", job=args.job), render)


def _keys(args: argparse.Namespace) -> int:
    return _emit(args, ask(args, "keys"), lambda d: table(d, ["name", "user", "role", "public_key", "created_at"]))


def _job_add(args: argparse.Namespace) -> int:
    if args.agent_keys and not args.job_file:
        raise _Fail(EXIT_USAGE, "--agent-keys goes with --job-file")
    if args.job_file:
        from nereusd.jobfile import job_spec
        from planner.errors import SpecError

        try:
            spec = job_spec(args.job_file, anchor_job_id=args.slurm_job_id or f"local-{args.job}"[:64])
        except SpecError as exc:
            raise _Fail(EXIT_USAGE, str(exc)) from None
        if args.agent_keys:
            spec["elastic"]["extra"]["keys_dir"] = str(Path(args.agent_keys).resolve())
    else:
        try:
            spec = json.loads(args.spec) if args.spec else {}
        except ValueError as exc:
            raise _Fail(EXIT_USAGE, f"--spec is not JSON: {exc}") from None
    op_args: dict[str, Any] = {"job": args.job, "user": args.user, "spec": spec}
    if args.slurm_job_id:
        op_args["slurm_job_id"] = args.slurm_job_id
    return _emit(args, ask(args, "job-add", **op_args), lambda d: f"added job {d['job']} ({d['state']})")


def _events(args: argparse.Namespace) -> int:
    op_args = {"job": args.job} if args.job else {}
    return _emit(args, ask(args, "events", **op_args),
                 lambda d: table(d, ["id", "at", "job_id", "kind", "data"]) if d else "no events")


def _plot(args: argparse.Namespace) -> int:
    from nereusd.plot import PlotError, plot_job

    measurements = ask(args, "measurements", job=args.job, limit=args.limit)
    transitions = ask(args, "transitions", job=args.job)
    try:
        plot_job(args.job, measurements, transitions, Path(args.out))
    except PlotError as exc:
        raise _Fail(EXIT_USAGE, str(exc)) from None
    except OSError as exc:
        raise _Fail(EXIT_USAGE, f"cannot write {args.out}: {exc.strerror or exc}") from None
    print(f"{args.out}: {len(measurements)} measurements, {len(transitions)} transitions")
    return EXIT_OK


def _run(fn):
    def handler(args: argparse.Namespace) -> int:
        try:
            return int(fn(args))
        except _Fail as exc:
            print(f"nereusctl: {exc}", file=sys.stderr)
            return exc.code
    return handler


def job_plan(args: argparse.Namespace) -> int:
    """`nereusctl plan JOB` (the what-if command's form for a running job) and `job-plan JOB`."""
    return _run(_job_plan)(args)


def _timeout(text: str) -> float:
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"{text!r}: give seconds, more than 0 and at most 3600")
    return value


def add_parsers(sub: Any) -> None:
    def add(name: str, fn, help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_)
        p.add_argument("--endpoint", help="admin endpoint, tcp://HOST:PORT (default: endpoints.json)")
        p.add_argument("--state-dir", help="daemon state dir holding endpoints.json (default /var/lib/nereus)")
        p.add_argument("--keys", help="admin key bundle directory (default ~/.config/nereus/admin)")
        p.add_argument("--timeout", type=_timeout, default=5.0, help="seconds to wait for the daemon (0-3600)")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.set_defaults(handler=_run(fn))
        return p

    add("status", _status, "daemon status")
    add("jobs", _jobs, "jobs and their state")
    add("job", _job, "one job: its nodes, their devices and state").add_argument("job")
    add("job-plan", _job_plan, "a job's plan: layout per model-stage, predicted vs measured").add_argument("job")
    add("decisions", _decisions, "a job's replan decisions, admitted and rejected").add_argument("job")
    add("transitions", _transitions, "a job's transitions").add_argument("job")
    add("transition", _transition, "one transition: DAG summary, bytes, predicted vs measured").add_argument(
        "id", type=int)
    add("explain", _explain, "why a decision was taken").add_argument("id", type=int)
    p = add("alloc", _alloc, "allocations; --grow/--shrink ask the allocation source")
    p.add_argument("job", nargs="?")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--grow", type=int, metavar="NODES", help="ask for this many more nodes")
    g.add_argument("--shrink", nargs="+", metavar="NODE", help="give these nodes back")
    add("keys", _keys, "authorised client keys (no secrets)")
    p = add("job-add", _job_add, "register a job with the daemon")
    p.add_argument("job")
    p.add_argument("--user", required=True, help="the job's (Slurm) user: only their agents may act on it")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--spec", help="job spec as JSON (model, algo, device, gpus_per_node, workload, elastic)")
    g.add_argument("--job-file", help="the job's TOML job file (etc/jobs/live.toml): the spec and the driver's job")
    p.add_argument("--agent-keys", metavar="DIR", help="with --job-file: the agent key bundle the local source "
                   "starts the job's agents with (default <state_dir>/keys/agent-USER)")
    p.add_argument("--slurm-job-id")
    add("events", _events, "the daemon's event log").add_argument("job", nargs="?")
    p = add("plot", _plot, "a job's run as a PNG: step time measured vs predicted, transitions, pool, length, reward")
    p.add_argument("job")
    p.add_argument("--out", required=True, metavar="FILE.png", help="the picture to write")
    p.add_argument("--limit", type=int, default=5000, help="the latest steps to draw (1-100000)")
