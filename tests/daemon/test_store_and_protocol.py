"""The durable store (migrations, state edges, histories) and the wire protocol (codes for bad frames)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nereusd.store import _MIGRATIONS, JOB_EDGES, SCHEMA_VERSION, StateError, Store
from nereusd.wire import protocol
from planner.errors import SpecError


def test_fresh_store_is_at_the_latest_schema_in_wal_mode(tmp_path: Path) -> None:
    s = Store(tmp_path / "s.db")
    assert s.migrated_from == 0
    assert s.db.execute("PRAGMA user_version").fetchone()["user_version"] == SCHEMA_VERSION
    assert s.db.execute("PRAGMA journal_mode").fetchone()["journal_mode"] == "wal"


def test_an_old_store_is_migrated_and_keeps_its_rows(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "s.db")
    db.executescript(_MIGRATIONS[0] + "PRAGMA user_version=1;")
    db.execute("INSERT INTO jobs VALUES ('old', 'alice', NULL, 'pending', '{}', 0, 1.0, 1.0)")
    db.commit()
    db.close()
    s = Store(tmp_path / "s.db")
    assert s.migrated_from == 1
    assert s.job("old")["user"] == "alice"  # type: ignore[index]
    indexes = {r["name"] for r in s.db.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    assert {"decisions_job", "transitions_job"} <= indexes


def test_a_newer_store_is_refused(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "s.db")
    db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(SpecError, match="newer than this nereusd"):
        Store(tmp_path / "s.db")


def test_state_edges_and_histories(tmp_path: Path) -> None:
    s = Store(tmp_path / "s.db")
    s.add_job(job_id="j", user="alice", spec={})
    with pytest.raises(SpecError, match="exists"):
        s.add_job(job_id="j", user="bob", spec={})
    with pytest.raises(StateError, match="pending -> transitioning is not allowed"):
        s.set_job_state("j", "transitioning", "skip ahead")
    assert s.set_job_state("j", "running", "agent registered")
    assert not s.set_job_state("j", "running", "again")  # no duplicate history row
    assert s.set_job_state("j", "cancelled", "user")
    with pytest.raises(StateError, match=r"none \(terminal\)"):
        s.set_job_state("j", "running", "zombie")
    assert [(h["from_state"], h["to_state"], h["reason"]) for h in s.history("job", "j")] == [
        (None, "pending", "submitted"), ("pending", "running", "agent registered"), ("running", "cancelled", "user")]
    assert all(a != b for a, b in JOB_EDGES)

    assert s.register_node(job_id="j", node="n", devices=[], slurm_job_id=None, host="h", incarnation="a") == "new"
    s.set_node_state("j", "n", "lost", "silent")
    assert s.register_node(job_id="j", node="n", devices=[], slurm_job_id=None, host="h", incarnation="a") == \
        "reconnected"
    assert s.register_node(job_id="j", node="n", devices=[], slurm_job_id=None, host="h", incarnation="b") == \
        "restarted"
    assert [h["to_state"] for h in s.history("node", "j/n")] == ["alive", "lost", "alive"]


def test_a_failed_write_rolls_back_whole(tmp_path: Path) -> None:
    s = Store(tmp_path / "s.db")
    s.add_job(job_id="j", user="alice", spec={})
    tid = s.add_transition(job_id="j", decision_id=None, from_version=0, to_version=1, dag={}, bytes_moved=0,
                           predicted_s=0.0, parts=["n"])
    with pytest.raises(StateError):
        s.set_transition_state(tid, "done", "skipping ordered")
    assert s.transition(tid)["state"] == "planned"  # type: ignore[index]
    assert len(s.history("transition", str(tid))) == 1
    assert not s.db.in_transaction


def test_node_states_and_a_transitions_detail(tmp_path: Path) -> None:
    s = Store(tmp_path / "s.db")
    s.add_job(job_id="j", user="alice", spec={})
    for node, inc in (("n1", "b"), ("n0", "a")):
        s.register_node(job_id="j", node=node, devices=[{"index": 0}], slurm_job_id=None, host="h", incarnation=inc)
    s.set_node_state("j", "n1", "lost", "silent")
    assert s.node_states("j") == [{"node": "n0", "state": "alive", "incarnation": "a"},
                                  {"node": "n1", "state": "lost", "incarnation": "b"}]
    head = {"kind": "transition", "bytes_moved": 7}
    tid = s.add_transition(job_id="j", decision_id=None, from_version=0, to_version=1, dag=head, bytes_moved=7,
                           predicted_s=0.0, parts=["n0"])
    s.add_transition_detail(tid, {"nodes": [{"id": 0}], "bytes_moved": 999})
    # the head's keys first and kept (the detail derives the same figures; the head is what was decided)
    assert list(s.transition(tid, detail=True)["dag"].items()) == [  # type: ignore[index]
        ("kind", "transition"), ("bytes_moved", 7), ("nodes", [{"id": 0}])]
    assert [t["dag"] for t in s.transitions("j", detail=True)] == [s.transition(tid, detail=True)["dag"]]  # type: ignore[index]
    # what the daemon reads on every part's report: the head alone, the body neither parsed nor rewritten
    assert s.transition(tid)["dag"] == head  # type: ignore[index]
    assert [t["dag"] for t in s.transitions("j")] == [t["dag"] for t in s.open_transitions("j")] == [head]
    s.set_transition_state(tid, "ordered", "sent", parts_pending=["n0"])
    assert s.db.execute("SELECT dag FROM transitions WHERE id=?", (tid,)).fetchone()["dag"] == head
    assert s.transition(tid, detail=True)["dag"]["nodes"] == [{"id": 0}]  # type: ignore[index]
    s.add_transition_detail(tid + 1, {"nodes": []})  # a transition that is gone: nothing written
    assert s.transition(tid + 1) is None
    assert s.db.execute("SELECT count(*) AS n FROM transition_details").fetchone()["n"] == 1


def test_a_transition_stored_before_schema_5_reads_whole(tmp_path: Path) -> None:
    """Rows written before the body had its own table carry head and body in ``dag``: read as they are."""
    db = sqlite3.connect(tmp_path / "s.db")
    db.executescript("".join(_MIGRATIONS[:4]) + "PRAGMA user_version=4;")
    db.execute("INSERT INTO jobs VALUES ('j', 'alice', NULL, 'running', '{}', 0, 0, 0)")
    db.execute("INSERT INTO transitions(job_id, state, from_version, to_version, dag, bytes_moved, predicted_s, "
               "parts_pending, created_at, updated_at) VALUES ('j', 'done', 1, 2, ?, 7, 1.0, '[]', 0, 0)",
               (json.dumps({"kind": "transition", "nodes": [{"id": 0}]}),))
    db.commit()
    db.close()
    s = Store(tmp_path / "s.db")
    assert s.migrated_from == 4
    (t,) = s.transitions("j", detail=True)
    assert t["dag"] == {"kind": "transition", "nodes": [{"id": 0}]} == s.transition(t["id"])["dag"]  # type: ignore[index]


GOOD = protocol.Heartbeat(job_id="j", node="n", seq=1)


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
def test_round_trip(encoding: protocol.Encoding) -> None:
    msg = protocol.Register(job_id="j", node="n", devices=(protocol.Device(index=0, kind="gpu", name="h200",
                                                                            memory_bytes=141 << 30),))
    frame = protocol.encode(msg, encoding)
    assert protocol.encoding_of(frame) == encoding
    assert protocol.decode(frame, 4096) == msg


@pytest.mark.parametrize(("frame", "code"), [
    (b"", "malformed"), (b"{", "malformed"), (b"\xc1", "malformed"), (msgpack.packb([1, 2]), "malformed"),
    (json.dumps({"type": "heartbeat"}).encode(), "wrong-version"),
    (json.dumps({**GOOD.model_dump(), "v": 2}).encode(), "wrong-version"),
    (json.dumps({**GOOD.model_dump(), "seq": "x"}).encode(), "invalid"),
    (json.dumps({**GOOD.model_dump(), "type": "nope"}).encode(), "invalid"),
    (json.dumps({**GOOD.model_dump(), "pad": "x" * 5000}).encode(), "oversized"),
])
def test_bad_frames_get_a_code(frame: bytes, code: str) -> None:
    with pytest.raises(protocol.ProtocolError) as info:
        protocol.decode(frame, 4096)
    assert info.value.code == code and code in protocol.ERROR_CODES


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_never_escape_as_anything_but_protocol_error(frame: bytes) -> None:
    try:
        protocol.decode(frame, 256)
    except protocol.ProtocolError as exc:
        assert exc.code in protocol.ERROR_CODES


_ADVERSARIAL = st.one_of(
    st.none(), st.booleans(), st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**70), max_value=2**70), st.text(max_size=80),
    st.sampled_from(["", "a/b", "x" * 65, "../../etc", "\x00", "ok"]),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=5), st.floats(), max_size=3))
_GOOD = {m.type: json.loads(protocol.encode(m, "json")) for m in (
    protocol.Register(job_id="j", node="n", devices=(protocol.Device(index=0, kind="gpu", name="g", memory_bytes=1),)),
    protocol.Heartbeat(job_id="j", node="n", seq=1,
                       workers=(protocol.WorkerState(device=0, pid=1, state="running"),)),
    protocol.Measurement(job_id="j", node="n", step=1, plan_version=0, step_latency_s=1.0,
                         stage_times_s={"actor-gen": 0.5}, peak_memory_bytes={"0": 1}, response_tokens=3.0),
    protocol.TransitionReport(job_id="j", node="n", transition_id=1, ok=True, measured_s=0.1))}


def _numbers(value: object) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [value]
    if isinstance(value, dict):
        return [x for v in value.values() for x in _numbers(v)]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _numbers(v)]
    return []


@settings(max_examples=600, deadline=None)
@given(st.sampled_from(sorted(_GOOD)), st.data(), _ADVERSARIAL, st.sampled_from(["json", "msgpack"]))
def test_whatever_a_field_holds_a_message_is_refused_or_fits_the_store(kind: str, data: st.DataObject,
                                                                        value: object, encoding: str) -> None:
    good = _GOOD[kind]
    field = data.draw(st.sampled_from(sorted(k for k in good if k not in ("v", "type"))))
    raw = {**good, field: value}
    try:
        frame = json.dumps(raw).encode() if encoding == "json" else msgpack.packb(raw, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        return  # not encodable (msgpack has no 2**70): a sender cannot produce it either
    try:
        msg = protocol.decode(frame, 1 << 20)
    except protocol.ProtocolError as exc:
        assert exc.code in protocol.ERROR_CODES
        if exc.code == "invalid":
            assert str(exc).split(": ")[1].split(".")[0] == kind  # the message names the type, then the field
        return
    # accepted: every number is finite and fits SQLite; every name has no '/'
    dumped = msg.model_dump()
    for x in _numbers(dumped):
        assert x == x and abs(x) <= 2**63 - 1, (field, x)
    for name_field in ("job_id", "node"):
        assert "/" not in dumped[name_field] and 1 <= len(dumped[name_field]) <= 64


def test_admin_arguments_name_the_op_and_field() -> None:
    with pytest.raises(protocol.ProtocolError, match=r"alloc: nodes: .*greater than or equal to 1"):
        protocol.admin_args("alloc", {"job": "j", "action": "grow", "nodes": -3})
    with pytest.raises(protocol.ProtocolError, match=r"job-add: spec.workload.prompts_per_step"):
        protocol.admin_args("job-add", {"job": "j", "user": "u", "spec": {"model": "m", "algo": "a", "workload": {
            "prompts_per_step": "8", "prompt_tokens": 1, "response_tokens": 1}}})
    with pytest.raises(protocol.ProtocolError, match="missing workload"):
        protocol.admin_args("job-add", {"job": "j", "user": "u", "spec": {"model": "m", "algo": "a"}})
    with pytest.raises(protocol.ProtocolError, match="unknown op"):
        protocol.admin_args("drop-tables", {})
    ok = protocol.admin_args("job-add", {"job": "j", "user": "u"})
    assert isinstance(ok, protocol.JobAddArgs) and ok.spec.stored() == {}


def test_an_unreadable_json_column_reads_as_damaged_not_as_a_crash(tmp_path: Path) -> None:
    s = Store(tmp_path / "s.db")
    s.add_job(job_id="j", user="alice", spec={"a": 1})
    s.db.execute("UPDATE jobs SET spec='{broken' WHERE job_id='j'")
    row = s.job("j")
    assert row is not None and row["spec"] is None and "spec" in row["damaged"]
    assert [j["job_id"] for j in s.jobs()] == ["j"]


def test_rows_read_the_same_whichever_queries_interleave(tmp_path: Path) -> None:
    """Rows are built from their own query's columns even when two queries' reads interleave (the column
    layout is kept for the last query only), and a damaged row keeps its columns in table order with
    ``damaged`` before the column that does not parse."""
    s = Store(tmp_path / "s.db")
    s.add_job(job_id="j", user="alice", spec={"a": 1})
    devices = [{"index": i, "kind": "gpu"} for i in range(2)]
    for n in ("n0", "n1", "n2"):
        s.register_node(job_id="j", node=n, devices=devices, slurm_job_id=None, host=n, incarnation="1")
    nodes = s.db.execute("SELECT * FROM nodes WHERE job_id='j' ORDER BY node")
    first = nodes.fetchone()
    job = s.job("j")  # another query in between
    rest = nodes.fetchall()
    assert job is not None and job["spec"] == {"a": 1} and job["user"] == "alice"
    assert [r["node"] for r in [first, *rest]] == ["n0", "n1", "n2"]
    assert all(r["devices"] == devices and r["state"] == "alive" and "spec" not in r for r in [first, *rest])
    assert list(first) == [d[0] for d in s.db.execute("SELECT * FROM nodes").description]
    s.db.execute("UPDATE nodes SET devices='[' WHERE node='n1'")
    bad = s.node("j", "n1")
    assert bad is not None and bad["devices"] is None and "'devices'" in bad["damaged"]
    keys = list(bad)
    assert keys.index("damaged") == keys.index("devices") - 1 and keys[0] == "job_id"
    assert "damaged" not in (s.node("j", "n2") or {"damaged": 1})
