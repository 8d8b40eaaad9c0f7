"""The store's schema (ordered migrations, one per version) and its allowed state changes. Data only.

nereusd.store applies the migrations in order (one transaction each, the version bumped inside it)
and refuses a store newer than ``SCHEMA_VERSION``. A migration is never edited once released: a
change to the schema is a new one appended.
"""

from __future__ import annotations

# Allowed state changes; every edge says why it exists.
JOB_EDGES: dict[tuple[str, str], str] = {
    ("pending", "running"): "the first agent registered",
    ("running", "transitioning"): "a transition was ordered",
    ("transitioning", "running"): "every agent reported its part done (or the transition failed)",
    ("running", "lost"): "every node of the job is lost",
    ("transitioning", "lost"): "every node was lost mid-transition",
    ("lost", "running"): "an agent reconnected",
    ("pending", "cancelled"): "cancelled before it started",
    ("running", "finished"): "the allocation source reports normal completion",
    ("running", "cancelled"): "cancelled by the user or an admin",
    ("running", "failed"): "Slurm or the driver reports failure",
    ("lost", "failed"): "the allocation ended while no node was alive",
    ("lost", "cancelled"): "cancelled while no node was alive",
    ("transitioning", "failed"): "the allocation failed mid-transition",
    ("transitioning", "cancelled"): "cancelled mid-transition",
}
NODE_EDGES: dict[tuple[str, str], str] = {
    ("alive", "lost"): "heartbeats missed past control.heartbeat_timeout_s",
    ("lost", "alive"): "the agent heartbeated or registered again",
    ("alive", "released"): "the member job was released or Slurm took the node",
    ("lost", "released"): "a lost node's allocation ended",
    ("released", "alive"): "an agent registered again on a node that was handed back",
}
TRANSITION_EDGES: dict[tuple[str, str], str] = {
    ("planned", "ordered"): "each agent was sent its part",
    ("planned", "cancelled"): "superseded before it was ordered",
    ("ordered", "done"): "every part reported done",
    ("ordered", "failed"): "a part failed or a node was lost mid-transition",
}
TERMINAL_JOB_STATES = frozenset({"finished", "failed", "cancelled"})

_MIGRATIONS: tuple[str, ...] = (
    # 1: the initial schema
    """
    CREATE TABLE jobs (
        job_id TEXT PRIMARY KEY, user TEXT NOT NULL, slurm_job_id TEXT, state TEXT NOT NULL,
        spec TEXT NOT NULL, plan_version INTEGER NOT NULL DEFAULT 0,
        created_at REAL NOT NULL, updated_at REAL NOT NULL);
    CREATE TABLE nodes (
        job_id TEXT NOT NULL REFERENCES jobs(job_id), node TEXT NOT NULL, state TEXT NOT NULL,
        slurm_job_id TEXT, host TEXT, incarnation TEXT, devices TEXT NOT NULL,
        registered_at REAL NOT NULL, last_heartbeat REAL NOT NULL, PRIMARY KEY (job_id, node));
    CREATE TABLE status_history (
        id INTEGER PRIMARY KEY, kind TEXT NOT NULL, key TEXT NOT NULL, at REAL NOT NULL,
        from_state TEXT, to_state TEXT NOT NULL, reason TEXT NOT NULL);
    CREATE INDEX status_history_key ON status_history(kind, key);
    CREATE TABLE allocations (
        id INTEGER PRIMARY KEY, job_id TEXT NOT NULL, at REAL NOT NULL, gpus INTEGER NOT NULL,
        nodes TEXT NOT NULL, source TEXT NOT NULL, reason TEXT NOT NULL);
    CREATE TABLE plans (
        job_id TEXT NOT NULL, version INTEGER NOT NULL, at REAL NOT NULL, plan TEXT NOT NULL,
        prediction TEXT NOT NULL, PRIMARY KEY (job_id, version));
    CREATE TABLE decisions (
        id INTEGER PRIMARY KEY, job_id TEXT NOT NULL, at REAL NOT NULL, trigger TEXT NOT NULL,
        urgent INTEGER NOT NULL, admitted INTEGER NOT NULL, rule TEXT NOT NULL, reason TEXT NOT NULL,
        from_version INTEGER, to_version INTEGER, delta_l_s REAL, l_tran_s REAL, h_x REAL, gamma REAL,
        decision_ms REAL, inputs TEXT NOT NULL);
    CREATE TABLE transitions (
        id INTEGER PRIMARY KEY, job_id TEXT NOT NULL, decision_id INTEGER REFERENCES decisions(id),
        state TEXT NOT NULL, from_version INTEGER NOT NULL, to_version INTEGER NOT NULL,
        dag TEXT NOT NULL, bytes_moved INTEGER NOT NULL, predicted_s REAL NOT NULL, measured_s REAL,
        parts_pending TEXT NOT NULL, created_at REAL NOT NULL, updated_at REAL NOT NULL);
    CREATE TABLE measurements (
        id INTEGER PRIMARY KEY, job_id TEXT NOT NULL, node TEXT NOT NULL, at REAL NOT NULL,
        step INTEGER NOT NULL, plan_version INTEGER NOT NULL, step_latency_s REAL NOT NULL,
        predicted_step_s REAL, stage_times TEXT NOT NULL, peak_memory TEXT NOT NULL, response_tokens REAL);
    CREATE INDEX measurements_job ON measurements(job_id, step);
    CREATE TABLE events (
        id INTEGER PRIMARY KEY, at REAL NOT NULL, job_id TEXT, kind TEXT NOT NULL, data TEXT NOT NULL);
    CREATE INDEX events_job ON events(job_id);
    """,
    # 2: decisions and transitions are listed per job, newest first
    """
    CREATE INDEX decisions_job ON decisions(job_id, id);
    CREATE INDEX transitions_job ON transitions(job_id, id);
    """,
    # 3: the controller's monitor state (trigger references, H_x EMAs, last signals) survives restarts
    """
    CREATE TABLE controller_state (
        job_id TEXT PRIMARY KEY REFERENCES jobs(job_id), snapshot TEXT NOT NULL, updated_at REAL NOT NULL);
    """,
    # 4: a measurement's RL figures (reward, KL, entropy, lengths, clip fractions, tokens/s, pool)
    """
    ALTER TABLE measurements ADD COLUMN rl TEXT;
    """,
    # 5: a transition's unit-level DAG body in a table of its own: the daemon reads and updates the
    # row on every part's report, and with the body in it (0.2-0.9 MB at 1,024 GPUs) each report parsed
    # it and each update rewrote it into the WAL: 10-24 ms per report, 1-2.4 s per transition
    """
    CREATE TABLE transition_details (
        transition_id INTEGER PRIMARY KEY REFERENCES transitions(id), detail TEXT NOT NULL);
    """,
)
SCHEMA_VERSION = len(_MIGRATIONS)
