"""A user's prompt file (JSONL or Parquet) as the source of each RL step's global prompt batch.

The job file names the prompt field and, optionally, the ground-truth field (dotted names reach into
nested records, e.g. verl's ``reward_model.ground_truth``). A prompt is text or a list of chat
messages (``{"role", "content"}``); a ground truth is text (numbers are written as text).

Order and position: the prompts are read in epochs; epoch ``e`` is the file's rows in a permutation
drawn from ``(seed, e)`` (or file order with ``shuffle = false``). Step ``s`` takes the
``prompts_per_step`` rows that follow position ``s * prompts_per_step`` of that endless sequence,
so the batch is a pure function of ``(seed, step)`` like the synthetic tasks', and a DP replica takes
its rows of it by rank (``StageEngine.replica_rows``) exactly as it does there. The position is one
integer, ``prompts_consumed`` (``DataPosition``); a resumed job passes it back to ``rows`` and reads on
where it stopped, even if ``prompts_per_step`` changed.

Every row is read and checked when the file is opened, so a bad row fails the job at its start: a
missing field, a wrong type, an empty file or a non-UTF-8 row raise ``DataError`` naming the file,
the row (1-based; a JSONL row is its line) and the field. JSONL lines are parsed one by one (stdlib
json) so that a bad line is named; Parquet is read with pyarrow.

Run: ``python -m agent.engine.data FILE [PROMPT_FIELD [GROUND_TRUTH_FIELD]]`` prints the first rows.
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.engine.tasks import Problem
from planner.errors import SpecError

FORMATS = (".jsonl", ".parquet")


class DataError(SpecError):
    """A prompt file that cannot be used, with the file, row and field it is about."""

    def __init__(self, path: str | Path, message: str, *, row: int | None = None, field: str | None = None) -> None:
        where = str(path) + (f", row {row}" if row is not None else "") + (f", field {field!r}" if field else "")
        super().__init__("data", f"{where}: {message}")
        self.path, self.row, self.column = str(path), row, field


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    path: str  # a .jsonl or .parquet file
    prompt_field: str = "prompt"
    ground_truth_field: str | None = None  # None: the reward function gets None for every sample
    shuffle: bool = True  # a new permutation every epoch, from the job's seed

    def __post_init__(self) -> None:
        if Path(self.path).suffix not in FORMATS:
            raise SpecError("data.path", f"{self.path!r} is not a prompt file", ", ".join(FORMATS))
        if not self.prompt_field:
            raise SpecError("data.prompt_field", "must name a field")


@dataclass(frozen=True, slots=True)
class DataPosition:
    """Where the prompt sequence stands: ``prompts_consumed`` is the whole state."""

    prompts_consumed: int
    num_rows: int

    @property
    def epoch(self) -> int:
        return self.prompts_consumed // self.num_rows

    @property
    def row_in_epoch(self) -> int:
        return self.prompts_consumed % self.num_rows


def _dig(record: Any, field: str) -> tuple[bool, Any]:
    for part in field.split("."):
        if not isinstance(record, dict) or part not in record:
            return False, None
        record = record[part]
    return True, record


def _prompt(value: Any, path: Path, row: int, field: str) -> str | tuple[dict[str, str], ...]:
    if isinstance(value, str):
        if not value:
            raise DataError(path, "is empty", row=row, field=field)
        return value
    if isinstance(value, list) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value):
        return tuple({"role": m["role"], "content": m["content"]} for m in value)
    raise DataError(path, f"must be text or a list of {{'role', 'content'}} messages, got {type(value).__name__}",
                    row=row, field=field)


def _ground_truth(value: Any, path: Path, row: int, field: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    raise DataError(path, f"must be text or a number, got {type(value).__name__}", row=row, field=field)


def _decode(value: Any, path: Path, row: int, field: str) -> Any:
    """Parquet binary cells (and nested ones) as text; non-UTF-8 bytes are the row's error."""
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(path, f"is not UTF-8 ({e.reason} at byte {e.start})", row=row, field=field) from None
    if isinstance(value, dict):
        return {k: _decode(v, path, row, field) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v, path, row, field) for v in value]
    return value


def _jsonl_records(path: Path) -> list[tuple[int, dict[str, Any]]]:
    out = []
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(path, f"is not UTF-8 ({e.reason} at byte {e.start} of the line)", row=line_no) from None
            if not line.strip():
                continue  # blank lines (a trailing newline) are not rows
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(path, f"is not JSON: {e.msg} at column {e.colno}", row=line_no) from None
            if not isinstance(record, dict):
                raise DataError(path, f"is a JSON {type(record).__name__}, not an object", row=line_no)
            out.append((line_no, record))
    return out


def _parquet_records(path: Path, fields: list[str]) -> list[tuple[int, dict[str, Any]]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(path, f"is not a Parquet file: {e}") from None
    top = sorted({f.split(".")[0] for f in fields})
    for name in top:
        if name not in schema.names:
            raise DataError(path, f"has no such column (columns: {', '.join(schema.names)})", row=None,
                            field=next(f for f in fields if f.split(".")[0] == name))
    table = pq.read_table(path, columns=top)
    columns = {}
    for name in top:
        col = table.column(name)
        # read text as bytes and decode here, so that a non-UTF-8 cell is named by its row
        if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            col = col.cast(pa.binary() if pa.types.is_string(col.type) else pa.large_binary())
        columns[name] = col.to_pylist()
    return [(i + 1, {name: _decode(columns[name][i], path, i + 1, name) for name in top})
            for i in range(table.num_rows)]


class PromptDataset:
    """Every row of a prompt file, checked; ``rows(start, count)`` of its endless epoch sequence."""

    def __init__(self, cfg: DataConfig, *, seed: int = 0) -> None:
        self.cfg, self.seed = cfg, seed
        path = Path(cfg.path)
        if not path.is_file():
            raise DataError(path, "does not exist")
        fields = [cfg.prompt_field] + ([cfg.ground_truth_field] if cfg.ground_truth_field else [])
        records = _jsonl_records(path) if path.suffix == ".jsonl" else _parquet_records(path, fields)
        if not records:
            raise DataError(path, "holds no rows")
        self.problems: list[Problem] = []
        for row, record in records:
            found, value = _dig(record, cfg.prompt_field)
            if not found or value is None:
                raise DataError(path, "is missing", row=row, field=cfg.prompt_field)
            answer = None
            if cfg.ground_truth_field:
                found, gt = _dig(record, cfg.ground_truth_field)
                if not found or gt is None:
                    raise DataError(path, "is missing", row=row, field=cfg.ground_truth_field)
                answer = _ground_truth(gt, path, row, cfg.ground_truth_field)
            self.problems.append(Problem(_prompt(value, path, row, cfg.prompt_field), answer))
        self.source_rows = [row for row, _ in records]  # file row of each problem, for messages
        self._orders: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.problems)

    def order(self, epoch: int) -> list[int]:
        """Problem indices of ``epoch`` in the order they are served."""
        if epoch not in self._orders:
            idx = list(range(len(self.problems)))
            if self.cfg.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(idx)
            self._orders = {epoch: idx}  # one epoch at a time is all a step needs (two at a boundary)
        return self._orders[epoch]

    def indices(self, start: int, count: int) -> list[int]:
        n, out = len(self.problems), []
        for pos in range(start, start + count):
            out.append(self.order(pos // n)[pos % n])
        return out

    def rows(self, start: int, count: int) -> list[Problem]:
        """``count`` problems from position ``start`` (prompts consumed so far) on."""
        return [self.problems[i] for i in self.indices(start, count)]

    def batch(self, step: int, count: int) -> list[Problem]:
        """The global prompt batch of RL step ``step`` (``count`` = prompts per step)."""
        return self.rows(step * count, count)

    def position(self, prompts_consumed: int) -> DataPosition:
        return DataPosition(prompts_consumed, len(self.problems))


if __name__ == "__main__":
    a = sys.argv[1:]
    ds = PromptDataset(DataConfig(path=a[0], prompt_field=a[1] if len(a) > 1 else "prompt",
                                  ground_truth_field=a[2] if len(a) > 2 else None))
    print(f"{len(ds)} rows")
    for p in ds.rows(0, min(5, len(ds))):
        print(p)
