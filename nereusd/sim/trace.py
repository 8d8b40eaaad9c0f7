"""Simulation traces: one CSV row per RL step, validated row by row.

    step,gpus,mean_response_tokens,p95_response_tokens[,compute_factor][,network_factor][,node_loss]

- ``step``: 0, 1, 2, ... consecutive (the RL step the row describes);
- ``gpus``: GPUs the allocation grants for that step (a multiple of the job's GPUs per node);
- ``mean_response_tokens`` / ``p95_response_tokens``: the generated lengths of that step's responses
  (p95 >= mean; the ground truth draws each replica's longest response from them);
- ``compute_factor`` / ``network_factor`` (optional, default 1): a multiplier on the ground truth's hidden
  compute and network efficiencies during that step, for throttling and congestion episodes, in (0, 2];
- ``node_loss`` (optional, default 0): 1 when a node is lost abruptly during that step (no notice; the
  next row's ``gpus`` says what is left).

Lines starting with ``#`` are comments (the traces in etc/traces/ say where their numbers come from).
A bad row raises :class:`TraceError` naming the row (1-based line number), the column and what is allowed.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path

from planner.errors import SpecError

REQUIRED = ("step", "gpus", "mean_response_tokens", "p95_response_tokens")
OPTIONAL = ("compute_factor", "network_factor", "node_loss")


class TraceError(SpecError):
    """A trace that cannot be replayed: ``line`` and ``column`` say where."""

    def __init__(self, source: str, line: int, column: str, message: str, allowed: str | None = None) -> None:
        self.line = line
        self.column = column
        super().__init__(f"{source}: line {line}, column {column!r}", message, allowed)


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceRow:
    step: int
    gpus: int
    mean_response_tokens: float
    p95_response_tokens: float
    compute_factor: float = 1.0
    network_factor: float = 1.0
    node_loss: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class Trace:
    name: str
    rows: tuple[TraceRow, ...]

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def max_gpus(self) -> int:
        return max(r.gpus for r in self.rows)

    def pool_changes(self) -> int:
        return sum(1 for a, b in zip(self.rows, self.rows[1:]) if a.gpus != b.gpus)

    def head(self, steps: int) -> Trace:
        return Trace(name=self.name, rows=self.rows[:steps])


def _number(source: str, line: int, column: str, text: str, *, integer: bool, low: float, high: float,
            allowed: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise TraceError(source, line, column, f"{text!r} is not a number", allowed) from None
    if not math.isfinite(value) or (integer and value != int(value)) or not low <= value <= high:
        raise TraceError(source, line, column, f"{text!r} is out of range", allowed)
    return value


def parse_trace(text: str, *, source: str = "trace", gpus_per_node: int = 1) -> Trace:
    """Parse and validate CSV text. ``gpus_per_node``: every ``gpus`` must be a multiple of it."""
    lines = [(n, ln) for n, ln in enumerate(text.splitlines(), start=1) if ln.strip() and not ln.lstrip().startswith("#")]
    if not lines:
        raise TraceError(source, 1, "header", "the trace is empty", ",".join(REQUIRED))
    header_line, header = lines[0]
    columns = [c.strip() for c in next(csv.reader(io.StringIO(header)))]
    for c in columns:
        if c not in REQUIRED + OPTIONAL:
            raise TraceError(source, header_line, c, "unknown column", ", ".join(REQUIRED + OPTIONAL))
    for c in REQUIRED:
        if c not in columns:
            raise TraceError(source, header_line, c, "required column missing", ",".join(REQUIRED))
    if len(set(columns)) != len(columns):
        raise TraceError(source, header_line, "header", "a column is named twice", ",".join(REQUIRED + OPTIONAL))
    rows: list[TraceRow] = []
    for line, text_row in lines[1:]:
        cells = [c.strip() for c in next(csv.reader(io.StringIO(text_row)))]
        if len(cells) != len(columns):
            raise TraceError(source, line, "row", f"{len(cells)} cells for {len(columns)} columns",
                             ",".join(columns))
        cell = dict(zip(columns, cells))

        def num(col: str, *, integer: bool = False, low: float = 0.0, high: float = math.inf,
                allowed: str = "", default: float | None = None, _line: int = line, _cell: dict = cell) -> float:
            if col not in _cell:
                assert default is not None
                return default
            return _number(source, _line, col, _cell[col], integer=integer, low=low, high=high, allowed=allowed)

        expected = rows[-1].step + 1 if rows else None
        step = int(num("step", integer=True, allowed="an integer >= 0"))
        if expected is not None and step != expected:
            raise TraceError(source, line, "step", f"{step} after step {rows[-1].step}",
                             f"{expected} (one row per RL step, consecutive)")
        gpus = int(num("gpus", integer=True, low=1, allowed=f"a positive multiple of {gpus_per_node}"))
        if gpus % gpus_per_node:
            raise TraceError(source, line, "gpus", f"{gpus} is not a multiple of {gpus_per_node} GPUs per node",
                             f"a positive multiple of {gpus_per_node}")
        mean = num("mean_response_tokens", low=1, allowed="a number of tokens >= 1")
        p95 = num("p95_response_tokens", low=1, allowed="a number of tokens >= mean_response_tokens")
        if p95 < mean:
            raise TraceError(source, line, "p95_response_tokens", f"{p95:g} is below the mean {mean:g}",
                             "a number of tokens >= mean_response_tokens")
        factor = "a multiplier in (0, 2]"
        cf = num("compute_factor", low=1e-3, high=2.0, allowed=factor, default=1.0)
        nf = num("network_factor", low=1e-3, high=2.0, allowed=factor, default=1.0)
        loss = num("node_loss", integer=True, high=1, allowed="0 or 1", default=0.0)
        rows.append(TraceRow(step=step, gpus=gpus, mean_response_tokens=mean, p95_response_tokens=p95,
                             compute_factor=cf, network_factor=nf, node_loss=bool(loss)))
    if not rows:
        raise TraceError(source, header_line, "row", "the trace has a header but no rows", "one row per RL step")
    return Trace(name=source, rows=tuple(rows))


def load_trace(path: str | Path, *, gpus_per_node: int = 1) -> Trace:
    p = Path(path)
    return parse_trace(p.read_text(), source=p.name, gpus_per_node=gpus_per_node)


def format_trace(rows: list[TraceRow] | tuple[TraceRow, ...], comments: tuple[str, ...] = ()) -> str:
    """CSV text for ``rows`` (every optional column written), with ``# comment`` lines first."""
    out = [f"# {c}" for c in comments]
    out.append(",".join(REQUIRED + OPTIONAL))
    for r in rows:
        out.append(f"{r.step},{r.gpus},{r.mean_response_tokens:.1f},{r.p95_response_tokens:.1f},"
                   f"{r.compute_factor:.3f},{r.network_factor:.3f},{int(r.node_loss)}")
    return "\n".join(out) + "\n"
