"""The daemon's durable store: SQLite in WAL mode, schema versioned with ordered migrations (nereusd.schema).

Tables: jobs, nodes, allocations, plans, decisions, transitions, measurements, events, and one
``status_history`` that keeps every state change of a job, node or transition with its time and
reason. Allowed state changes are the tables ``JOB_EDGES``, ``NODE_EDGES`` and ``TRANSITION_EDGES``;
an edge not listed raises ``StateError`` (a logged, typed error, never an assert).

Every write commits before the call returns, so after ``kill -9`` and a restart every record is
back: in WAL mode with synchronous=NORMAL a commit is in the WAL file before the call returns, which a
process crash cannot undo; only an OS crash or power cut may lose the last commits before the next
checkpoint. FULL would fsync on every commit and stall the single-threaded serve loop for the length
of an fsync (hundreds of ms on a busy disk), so ``durable=True`` is left for those who need it.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from nereusd.schema import (  # re-exported: callers import them from the store
    _MIGRATIONS,
    JOB_EDGES,
    NODE_EDGES,
    SCHEMA_VERSION,
    TERMINAL_JOB_STATES,
    TRANSITION_EDGES,
)
from planner.errors import NereusError, SpecError


class StateError(NereusError):
    """A state change that the edge table does not allow."""


_JSON_COLUMNS = frozenset({"spec", "snapshot", "devices", "nodes", "plan", "prediction", "inputs", "dag", "parts_pending",
                           "stage_times", "peak_memory", "data", "rl", "detail"})
# a transition row with its DAG body (transition_details.detail), merged by _whole
_TRANSITION_WHOLE = "SELECT t.*, d.detail FROM transitions t LEFT JOIN transition_details d ON d.transition_id = t.id"


# (cursor description, column names, positions of the JSON columns) of the last query read: a query's
# rows share one description object, so a row of a 1,024-node read costs a dict and its JSON parses only
_LAST_COLUMNS: tuple[Any, tuple[str, ...], tuple[int, ...]] = (None, (), ())


def _row(cur: sqlite3.Cursor, values: tuple[Any, ...]) -> dict[str, Any]:
    """A row as a dict, JSON columns parsed. A column that cannot be parsed (a damaged or hand-edited
    store) reads as None and the row gets ``damaged``: the reason, so callers report it, never crash."""
    global _LAST_COLUMNS
    desc, names, json_at = _LAST_COLUMNS  # one read: another thread may replace it meanwhile
    if desc is not cur.description:
        desc = cur.description
        names = tuple(d[0] for d in desc)
        json_at = tuple(i for i, name in enumerate(names) if name in _JSON_COLUMNS)
        _LAST_COLUMNS = (desc, names, json_at)
    out = dict(zip(names, values))
    try:
        for i in json_at:
            if values[i] is not None:
                out[names[i]] = json.loads(values[i])
        return out
    except (TypeError, ValueError):
        out = {}  # column by column: ``damaged`` goes where the first column that does not parse is
    for name, value in zip(names, values):
        if name in _JSON_COLUMNS and value is not None:
            try:
                value = json.loads(value)
            except (TypeError, ValueError) as exc:
                out["damaged"] = f"column {name!r} holds no readable JSON ({type(exc).__name__}: {exc})"[:300]
                value = None
        out[name] = value
    return out


def _merged(head: dict[str, Any], detail: dict[str, Any]) -> dict[str, Any]:
    """``head``'s keys first and winning, then ``detail``'s others."""
    return {**head, **{k: v for k, v in detail.items() if k not in head}}


def _whole(row: dict[str, Any]) -> dict[str, Any]:
    """A transition row read with its body (transition_details): ``dag`` the head merged with the body
    (rows stored before schema 5 carry both in ``dag``)."""
    body = row.pop("detail", None)
    if body:
        row["dag"] = _merged(row["dag"] or {}, body)
    return row


class Store:
    def __init__(self, path: Path, clock=time.time, durable: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._clock = clock
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=30)
        self.db.row_factory = _row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
        self._checkpointer: threading.Thread | None = None
        self._stop_checkpoints = threading.Event()
        self.db.execute("PRAGMA foreign_keys=ON")
        self.migrated_from = self._migrate()

    def close(self) -> None:
        self._stop_checkpoints.set()
        if self._checkpointer is not None:
            self._checkpointer.join(timeout=10)
        self.db.close()

    def start_checkpointer(self, interval_s: float = 5.0) -> None:
        """Checkpoint the WAL from a thread of its own: the commit that crosses SQLite's automatic
        checkpoint threshold would otherwise fsync the database inside the serve loop."""
        self.db.execute("PRAGMA wal_autocheckpoint=0")

        def run() -> None:
            db = sqlite3.connect(self.path, timeout=30)
            try:
                while not self._stop_checkpoints.wait(interval_s):
                    db.execute("PRAGMA wal_checkpoint(PASSIVE)")  # never blocks the writer
            finally:
                db.close()

        self._checkpointer = threading.Thread(target=run, name="store-checkpoint", daemon=True)
        self._checkpointer.start()

    def _migrate(self) -> int:
        version = self.db.execute("PRAGMA user_version").fetchone()["user_version"]
        if version > SCHEMA_VERSION:
            raise SpecError("store", f"{self.path} has schema version {version}, newer than this "
                            f"nereusd ({SCHEMA_VERSION})", "upgrade nereusd, or point daemon.state_dir elsewhere")
        for target in range(version + 1, SCHEMA_VERSION + 1):
            try:  # one migration = one transaction, version bump included
                self.db.executescript("BEGIN IMMEDIATE;" + _MIGRATIONS[target - 1]
                                      + f"PRAGMA user_version={target}; COMMIT;")
            except sqlite3.Error:
                if self.db.in_transaction:
                    self.db.execute("ROLLBACK")
                raise
        return version

    def _tx(self):
        return _Transaction(self.db)

    def transaction(self) -> _Transaction:
        """Several store calls as one commit (re-entrant: the calls' own transactions join it)."""
        return _Transaction(self.db)

    def _one(self, sql: str, *args: Any) -> dict[str, Any] | None:
        return self.db.execute(sql, args).fetchone()

    def _all(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        return self.db.execute(sql, args).fetchall()

    # --- status history ---------------------------------------------------------------------------
    def _change(self, kind: str, key: str, edges: dict[tuple[str, str], str], old: str | None, new: str,
                reason: str, now: float) -> None:
        if old is not None and old != new and (old, new) not in edges:
            allowed = ", ".join(b for (a, b) in edges if a == old) or "none (terminal)"
            raise StateError(f"{kind} {key}: {old} -> {new} is not allowed (from {old}: {allowed})")
        self.db.execute("INSERT INTO status_history(kind, key, at, from_state, to_state, reason) "
                        "VALUES (?,?,?,?,?,?)", (kind, key, now, old, new, reason))

    def history(self, kind: str, key: str) -> list[dict[str, Any]]:
        return self._all("SELECT at, from_state, to_state, reason FROM status_history WHERE kind=? AND key=? "
                         "ORDER BY id", kind, key)

    # --- jobs -------------------------------------------------------------------------------------
    def add_job(self, *, job_id: str, user: str, spec: dict[str, Any], slurm_job_id: str | None = None,
                reason: str = "submitted") -> None:
        now = self._clock()
        with self._tx():
            if self.job(job_id) is not None:
                raise SpecError("job_id", f"job {job_id!r} exists", "a new job id")
            self.db.execute("INSERT INTO jobs(job_id, user, slurm_job_id, state, spec, created_at, updated_at) "
                            "VALUES (?,?,?,?,?,?,?)", (job_id, user, slurm_job_id, "pending", json.dumps(spec),
                                                       now, now))
            self._change("job", job_id, JOB_EDGES, None, "pending", reason, now)

    def job(self, job_id: str) -> dict[str, Any] | None:
        return self._one("SELECT * FROM jobs WHERE job_id=?", job_id)

    def jobs(self, include_terminal: bool = True) -> list[dict[str, Any]]:
        rows = self._all("SELECT * FROM jobs ORDER BY created_at")
        return rows if include_terminal else [r for r in rows if r["state"] not in TERMINAL_JOB_STATES]

    def set_job_state(self, job_id: str, state: str, reason: str) -> bool:
        """Move a job to ``state``; False when it already was there (no history row)."""
        now = self._clock()
        with self._tx():
            job = self.job(job_id)
            if job is None:
                raise SpecError("job_id", f"no job {job_id!r}")
            if job["state"] == state:
                return False
            self._change("job", job_id, JOB_EDGES, job["state"], state, reason, now)
            self.db.execute("UPDATE jobs SET state=?, updated_at=? WHERE job_id=?", (state, now, job_id))
        return True

    # --- nodes ------------------------------------------------------------------------------------
    def register_node(self, *, job_id: str, node: str, devices: list[dict[str, Any]], slurm_job_id: str | None,
                      host: str, incarnation: str) -> str:
        """Insert or refresh a node; returns 'new', 'reconnected' (same agent) or 'restarted' (new agent)."""
        now = self._clock()
        with self._tx():
            old = self._one("SELECT * FROM nodes WHERE job_id=? AND node=?", job_id, node)
            if old is None:
                self.db.execute("INSERT INTO nodes VALUES (?,?,?,?,?,?,?,?,?)",
                                (job_id, node, "alive", slurm_job_id, host, incarnation, json.dumps(devices),
                                 now, now))
                self._change("node", f"{job_id}/{node}", NODE_EDGES, None, "alive", "registered", now)
                return "new"
            kind = "reconnected" if old["incarnation"] == incarnation else "restarted"
            if old["state"] != "alive":
                self._change("node", f"{job_id}/{node}", NODE_EDGES, old["state"], "alive", f"agent {kind}", now)
            self.db.execute("UPDATE nodes SET state='alive', slurm_job_id=?, host=?, incarnation=?, devices=?, "
                            "last_heartbeat=? WHERE job_id=? AND node=?",
                            (slurm_job_id, host, incarnation, json.dumps(devices), now, job_id, node))
            return kind

    def node(self, job_id: str, node: str) -> dict[str, Any] | None:
        return self._one("SELECT * FROM nodes WHERE job_id=? AND node=?", job_id, node)

    def nodes(self, job_id: str) -> list[dict[str, Any]]:
        return self._all("SELECT * FROM nodes WHERE job_id=? ORDER BY node", job_id)

    def node_states(self, job_id: str) -> list[dict[str, Any]]:
        """Each node's name, state and agent incarnation (``nodes`` without the device lists to parse:
        an order to 128 nodes read them twice)."""
        return self._all("SELECT node, state, incarnation FROM nodes WHERE job_id=? ORDER BY node", job_id)

    def node_devices(self, job_id: str) -> list[dict[str, Any]]:
        """Each node's name, state, registration time and device list as stored (``devices_json``, not
        parsed: the controller's pool map parses each distinct list once, not once per node a replan)."""
        return self._all("SELECT node, state, registered_at, devices AS devices_json FROM nodes WHERE job_id=? "
                         "ORDER BY node", job_id)

    def count_nodes(self, job_id: str, state: str) -> int:
        row = self._one("SELECT COUNT(*) AS n FROM nodes WHERE job_id=? AND state=?", job_id, state)
        return int(row["n"]) if row else 0

    def all_nodes(self) -> list[dict[str, Any]]:
        return self._all("SELECT * FROM nodes ORDER BY job_id, node")

    def set_node_state(self, job_id: str, node: str, state: str, reason: str) -> bool:
        now = self._clock()
        with self._tx():
            old = self._one("SELECT state FROM nodes WHERE job_id=? AND node=?", job_id, node)
            if old is None:
                raise SpecError("node", f"no node {node!r} in job {job_id!r}")
            if old["state"] == state:
                return False
            self._change("node", f"{job_id}/{node}", NODE_EDGES, old["state"], state, reason, now)
            self.db.execute("UPDATE nodes SET state=? WHERE job_id=? AND node=?", (state, job_id, node))
        return True

    def touch_heartbeats(self, seen: Iterable[tuple[str, str, float]]) -> None:
        """Persist last-heartbeat times in one transaction (the daemon batches them; 1 Hz x 1,024 nodes)."""
        with self._tx():
            self.db.executemany("UPDATE nodes SET last_heartbeat=? WHERE job_id=? AND node=?",
                                [(t, j, n) for j, n, t in seen])

    # --- allocations, plans, measurements, events -------------------------------------------------
    def add_allocation(self, *, job_id: str, gpus: int, nodes: list[str], source: str, reason: str) -> int:
        with self._tx():
            cur = self.db.execute("INSERT INTO allocations(job_id, at, gpus, nodes, source, reason) "
                                  "VALUES (?,?,?,?,?,?)", (job_id, self._clock(), gpus, json.dumps(nodes),
                                                           source, reason))
        return int(cur.lastrowid or 0)

    def allocations(self, job_id: str | None = None) -> list[dict[str, Any]]:
        if job_id is None:
            return self._all("SELECT * FROM allocations ORDER BY id")
        return self._all("SELECT * FROM allocations WHERE job_id=? ORDER BY id", job_id)

    def latest_allocation(self, job_id: str) -> dict[str, Any] | None:
        return self._one("SELECT * FROM allocations WHERE job_id=? ORDER BY id DESC LIMIT 1", job_id)

    def add_plan(self, *, job_id: str, version: int, plan: dict[str, Any], prediction: dict[str, Any]) -> None:
        with self._tx():
            self.db.execute("INSERT INTO plans VALUES (?,?,?,?,?)", (job_id, version, self._clock(),
                                                                   json.dumps(plan), json.dumps(prediction)))

    def commit_plan_version(self, job_id: str, version: int) -> None:
        with self._tx():
            self.db.execute("UPDATE jobs SET plan_version=?, updated_at=? WHERE job_id=?",
                            (version, self._clock(), job_id))

    def plan(self, job_id: str, version: int | None = None) -> dict[str, Any] | None:
        if version is None:
            job = self.job(job_id)
            if job is None:
                return None
            version = job["plan_version"]
        return self._one("SELECT * FROM plans WHERE job_id=? AND version=?", job_id, version)

    def max_plan_version(self, job_id: str) -> int:
        row = self._one("SELECT MAX(version) AS v FROM plans WHERE job_id=?", job_id)
        return int(row["v"]) if row and row["v"] is not None else 0

    def add_measurement(self, *, job_id: str, node: str, step: int, plan_version: int, step_latency_s: float,
                        predicted_step_s: float | None, stage_times: dict[str, float],
                        peak_memory: dict[str, int], response_tokens: float | None) -> None:
        with self._tx():
            self.db.execute("INSERT INTO measurements(job_id, node, at, step, plan_version, step_latency_s, "
                            "predicted_step_s, stage_times, peak_memory, response_tokens) VALUES (?,?,?,?,?,?,?,?,?,?)",
                            (job_id, node, self._clock(), step, plan_version, step_latency_s, predicted_step_s,
                             json.dumps(stage_times), json.dumps(peak_memory), response_tokens))

    def attach_rl(self, job_id: str, step: int, rl: dict[str, Any]) -> None:
        """The RL figures of the job's latest measurement of ``step`` (the daemon adds them after the
        controller stored the measurement)."""
        with self._tx():
            self.db.execute("UPDATE measurements SET rl=? WHERE id=(SELECT MAX(id) FROM measurements "
                            "WHERE job_id=? AND step=?)", (json.dumps(rl), job_id, step))

    def measurements(self, job_id: str, limit: int = 100) -> list[dict[str, Any]]:
        rows = self._all("SELECT * FROM measurements WHERE job_id=? ORDER BY id DESC LIMIT ?", job_id, limit)
        return rows[::-1]

    def add_event(self, kind: str, data: dict[str, Any], job_id: str | None = None) -> None:
        with self._tx():
            self.db.execute("INSERT INTO events(at, job_id, kind, data) VALUES (?,?,?,?)",
                            (self._clock(), job_id, kind, json.dumps(data)))

    def events(self, job_id: str | None = None, limit: int = 200) -> list[dict[str, Any]]:
        if job_id is None:
            rows = self._all("SELECT * FROM events ORDER BY id DESC LIMIT ?", limit)
        else:
            rows = self._all("SELECT * FROM events WHERE job_id=? ORDER BY id DESC LIMIT ?", job_id, limit)
        return rows[::-1]

    def allocation_events(self, job_id: str) -> list[dict[str, Any]]:
        """Every allocation event of a job, oldest first (what a restarted daemon replays)."""
        rows = self._all("SELECT data FROM events WHERE job_id=? AND kind='allocation' ORDER BY id", job_id)
        return [r["data"] for r in rows if isinstance(r["data"], dict)]

    def save_controller_state(self, job_id: str, snapshot: dict[str, Any]) -> None:
        with self._tx():
            self.db.execute("INSERT INTO controller_state VALUES (?,?,?) ON CONFLICT(job_id) DO UPDATE SET "
                            "snapshot=excluded.snapshot, updated_at=excluded.updated_at",
                            (job_id, json.dumps(snapshot), self._clock()))

    def controller_state(self, job_id: str) -> dict[str, Any] | None:
        row = self._one("SELECT snapshot FROM controller_state WHERE job_id=?", job_id)
        return row["snapshot"] if row else None

    # --- decisions and transitions ----------------------------------------------------------------
    def add_decision(self, *, job_id: str, trigger: str, urgent: bool, admitted: bool, rule: str, reason: str,
                     from_version: int | None, to_version: int | None, delta_l_s: float | None,
                     l_tran_s: float | None, h_x: float | None, gamma: float | None, decision_ms: float,
                     inputs: dict[str, Any]) -> int:
        with self._tx():
            cur = self.db.execute(
                "INSERT INTO decisions(job_id, at, trigger, urgent, admitted, rule, reason, from_version, "
                "to_version, delta_l_s, l_tran_s, h_x, gamma, decision_ms, inputs) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (job_id, self._clock(), trigger, int(urgent), int(admitted), rule, reason, from_version, to_version,
                 delta_l_s, l_tran_s, h_x, gamma, decision_ms, json.dumps(inputs)))
        return int(cur.lastrowid or 0)

    def decisions(self, job_id: str) -> list[dict[str, Any]]:
        return self._all("SELECT * FROM decisions WHERE job_id=? ORDER BY id", job_id)

    def decision(self, decision_id: int) -> dict[str, Any] | None:
        return self._one("SELECT * FROM decisions WHERE id=?", decision_id)

    def add_transition(self, *, job_id: str, decision_id: int | None, from_version: int, to_version: int,
                       dag: dict[str, Any], bytes_moved: int, predicted_s: float, parts: list[str]) -> int:
        now = self._clock()
        with self._tx():
            cur = self.db.execute(
                "INSERT INTO transitions(job_id, decision_id, state, from_version, to_version, dag, bytes_moved, "
                "predicted_s, parts_pending, created_at, updated_at) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (job_id, decision_id, "planned", from_version, to_version, json.dumps(dag), bytes_moved,
                 predicted_s, json.dumps(sorted(parts)), now, now))
            tid = int(cur.lastrowid or 0)
            self._change("transition", str(tid), TRANSITION_EDGES, None, "planned", f"decision {decision_id}", now)
        return tid

    def transition(self, transition_id: int, *, detail: bool = False) -> dict[str, Any] | None:
        """A transition row; its ``dag`` the record's head (kind, versions, bytes, counts, cost, L_tran:
        all the daemon reads), or with ``detail`` the whole record (the unit-level body merged in)."""
        if not detail:
            return self._one("SELECT * FROM transitions WHERE id=?", transition_id)
        row = self._one(f"{_TRANSITION_WHOLE} WHERE t.id=?", transition_id)
        return None if row is None else _whole(row)

    def transitions(self, job_id: str, *, detail: bool = False) -> list[dict[str, Any]]:
        if not detail:
            return self._all("SELECT * FROM transitions WHERE job_id=? ORDER BY id", job_id)
        return [_whole(t) for t in self._all(f"{_TRANSITION_WHOLE} WHERE t.job_id=? ORDER BY t.id", job_id)]

    def open_transitions(self, job_id: str | None = None) -> list[dict[str, Any]]:
        """The planned and ordered transitions, heads only (``transition`` reads one whole)."""
        if job_id is None:
            return self._all("SELECT * FROM transitions WHERE state IN ('planned', 'ordered') ORDER BY id")
        return self._all("SELECT * FROM transitions WHERE job_id=? AND state IN ('planned', 'ordered') ORDER BY id",
                         job_id)

    def add_transition_detail(self, transition_id: int, detail: dict[str, Any]) -> None:
        """Complete a transition's DAG record with its unit-level body, kept apart from the head (which
        wins on any key both carry, when read whole); a no-op for a transition that is gone."""
        with self._tx():
            if self._one("SELECT id FROM transitions WHERE id=?", transition_id) is None:
                return
            # the same text as json.dumps (a fresh record holds no cycle): without the cycle check's
            # bookkeeping on its ~30,000 containers, ~15% less of ~7 ms at 1,024 GPUs
            self.db.execute("INSERT OR REPLACE INTO transition_details(transition_id, detail) VALUES (?, ?)",
                            (transition_id, json.dumps(detail, check_circular=False)))

    def set_transition_state(self, transition_id: int, state: str, reason: str, *,
                             measured_s: float | None = None, parts_pending: list[str] | None = None) -> None:
        now = self._clock()
        with self._tx():
            # only the columns updated (the row's DAG record is large: parsing it was most of an order's cost)
            row = self._one("SELECT state, measured_s, parts_pending FROM transitions WHERE id=?", transition_id)
            if row is None:
                raise SpecError("transition", f"no transition {transition_id}")
            if row["state"] != state:
                self._change("transition", str(transition_id), TRANSITION_EDGES, row["state"], state, reason, now)
            pending = row["parts_pending"] if parts_pending is None else sorted(parts_pending)
            measured = row["measured_s"] if measured_s is None else measured_s
            self.db.execute("UPDATE transitions SET state=?, measured_s=?, parts_pending=?, updated_at=? WHERE id=?",
                            (state, measured, json.dumps(pending), now, transition_id))


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT/ROLLBACK; re-entrant, so store methods compose inside one another."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db
        self.outer = False

    def __enter__(self) -> _Transaction:
        if not self.db.in_transaction:
            self.db.execute("BEGIN IMMEDIATE")
            self.outer = True
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.outer:
            return
        if exc_type is None:
            self.db.execute("COMMIT")
        else:
            self.db.execute("ROLLBACK")
