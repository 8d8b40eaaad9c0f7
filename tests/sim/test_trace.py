"""Trace CSV parsing and validation: every bad row is named by line and column, with what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest

from nereusd.sim.trace import TraceError, TraceRow, format_trace, load_trace, parse_trace

TRACES = Path(__file__).resolve().parents[2] / "etc" / "traces"
HEADER = "step,gpus,mean_response_tokens,p95_response_tokens"


def test_minimal_trace_parses_with_defaults_and_comments() -> None:
    t = parse_trace(f"# a comment\n{HEADER}\n0,8,500,900\n1,16,510,1000\n", gpus_per_node=8)
    assert len(t) == 2 and t.max_gpus == 16 and t.pool_changes() == 1
    assert t.rows[1] == TraceRow(step=1, gpus=16, mean_response_tokens=510, p95_response_tokens=1000)


def test_optional_columns_round_trip_through_format() -> None:
    rows = (TraceRow(step=0, gpus=8, mean_response_tokens=500, p95_response_tokens=900, compute_factor=0.9,
                     network_factor=0.5, node_loss=True),)
    again = parse_trace(format_trace(rows, ("x",)), gpus_per_node=8)
    assert again.rows == rows


@pytest.mark.parametrize(("body", "line", "column", "allowed"), [
    ("0,8,500,900\n2,8,500,900", 3, "step", "1 (one row per RL step"),
    ("0,12,500,900", 2, "gpus", "multiple of 8"),
    ("0,8,500,400", 2, "p95_response_tokens", ">= mean_response_tokens"),
    ("0,8,abc,900", 2, "mean_response_tokens", "tokens >= 1"),
    ("0,8,500", 2, "row", "step,gpus"),
    ("0,-8,500,900", 2, "gpus", "positive multiple"),
])
def test_bad_rows_name_line_column_and_what_is_allowed(body: str, line: int, column: str, allowed: str) -> None:
    with pytest.raises(TraceError) as info:
        parse_trace(f"{HEADER}\n{body}\n", source="t.csv", gpus_per_node=8)
    err = info.value
    assert (err.line, err.column) == (line, column)
    assert allowed in str(err) and "t.csv" in str(err)


def test_bad_header_and_optional_values() -> None:
    with pytest.raises(TraceError, match="unknown column") as info:
        parse_trace("step,gpus,mean_response_tokens,p95_response_tokens,speed\n0,8,1,1\n")
    assert info.value.column == "speed"
    with pytest.raises(TraceError, match="required column missing"):
        parse_trace("step,gpus,mean_response_tokens\n0,8,1\n")
    with pytest.raises(TraceError, match=r"\(0, 2\]") as info:
        parse_trace(f"{HEADER},network_factor\n0,8,1,1,3\n")
    assert info.value.column == "network_factor"
    with pytest.raises(TraceError, match="0 or 1"):
        parse_trace(f"{HEADER},node_loss\n0,8,1,1,2\n")
    with pytest.raises(TraceError, match="no rows"):
        parse_trace(f"{HEADER}\n")


@pytest.mark.parametrize(("name", "per_node", "steps", "max_gpus"), [
    ("drift_8_32.csv", 8, 240, 32), ("growth_1024.csv", 8, 1000, 1024), ("spot_16.csv", 4, 600, 16),
    ("smoke.csv", 8, 30, 16)])
def test_shipped_traces_are_valid_and_match_the_papers_descriptions(name: str, per_node: int, steps: int,
                                                                    max_gpus: int) -> None:
    t = load_trace(TRACES / name, gpus_per_node=per_node)
    assert len(t) == steps and t.max_gpus == max_gpus
    if name == "drift_8_32.csv":
        assert 1000 < t.rows[0].mean_response_tokens < 1300 and 3300 < t.rows[-1].mean_response_tokens < 4100
    if name == "spot_16.csv":
        assert t.pool_changes() > 10 and sum(r.node_loss for r in t.rows) == 2
