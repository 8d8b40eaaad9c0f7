"""Prompt files (JSONL, Parquet): deterministic epochs, a resumable position, the same batch and DP
rows as the synthetic tasks, and errors that name the file, row and field."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from agent.engine.data import DataConfig, DataError, PromptDataset
from agent.engine.tasks import Problem, SortDigits, problems_for_step
from planner.errors import SpecError
from planner.plan import Layout, StagePlan


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def ds(path: Path, **kw) -> PromptDataset:
    seed = kw.pop("seed", 0)
    return PromptDataset(DataConfig(path=str(path), **kw), seed=seed)


ROWS = [{"question": f"q{i}", "meta": {"answer": i}} for i in range(10)]


def test_epochs_are_seeded_permutations_and_the_position_resumes(tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "p.jsonl", ROWS)
    a = ds(f, prompt_field="question", ground_truth_field="meta.answer", seed=3)
    assert a.rows(0, 2) == [Problem(f"q{i}", str(i)) for i in a.order(0)[:2]]
    for epoch in range(3):  # every row once per epoch
        assert sorted(a.order(epoch)) == list(range(10))
    assert a.order(0) != a.order(1)  # a new order each epoch
    assert ds(f, prompt_field="question", seed=3).order(0) == a.order(0)  # a pure function of the seed
    assert ds(f, prompt_field="question", seed=4).order(0) != a.order(0)
    assert ds(f, prompt_field="question", shuffle=False).order(5) == list(range(10))
    # 7 steps of 4 prompts cross two epoch boundaries; resuming from the position reads on
    whole = [p for s in range(7) for p in a.batch(s, 4)]
    pos = a.position(3 * 4)
    assert (pos.epoch, pos.row_in_epoch) == (1, 2)
    fresh = ds(f, prompt_field="question", ground_truth_field="meta.answer", seed=3)
    resumed = fresh.rows(pos.prompts_consumed, 4 * 4)
    assert resumed == whole[12:]
    assert fresh.rows(12, 6) + fresh.rows(18, 10) == whole[12:]  # prompts_per_step may change on resume


def test_parquet_reads_like_jsonl(tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "p.jsonl", ROWS)
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "p.parquet")
    a = ds(f, prompt_field="question", ground_truth_field="meta.answer")
    b = ds(tmp_path / "p.parquet", prompt_field="question", ground_truth_field="meta.answer")
    assert a.problems == b.problems and a.rows(0, 25) == b.rows(0, 25)


def test_chat_message_prompts(tmp_path: Path) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    f = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": msgs, "reward_model": {"ground_truth": "4"}}])
    p = ds(f, ground_truth_field="reward_model.ground_truth").problems[0]
    assert p == Problem(tuple(msgs), "4")


def test_dp_rows_are_those_of_the_synthetic_task(tmp_path: Path) -> None:
    """A file holding the synthetic task's prompts in step order gives the same global batches, and
    each DP replica takes the same rows of them (``StageEngine.replica_rows``' arithmetic)."""
    from agent.engine.parallel import StageEngine

    steps, count = 3, 8
    synthetic = [problems_for_step(SortDigits(), 0, s, count) for s in range(steps)]
    f = write_jsonl(tmp_path / "t.jsonl", [{"prompt": p.prompt, "answer": p.answer} for b in synthetic for p in b])
    data = ds(f, ground_truth_field="answer", shuffle=False)
    for dp in (1, 2, 4):
        plan = StagePlan(model_stage="actor-gen", layout=Layout(1, 1), gpu_sets=tuple((r,) for r in range(dp)),
                         micro_batch_size=count // dp)
        eng = StageEngine.__new__(StageEngine)  # only the row arithmetic: no process groups needed
        eng.name, eng.plan = "actor-gen", plan
        for s in range(steps):
            for r in range(dp):
                rows = eng.replica_rows(count, r)
                assert data.batch(s, count)[rows] == synthetic[s][rows]


def test_errors_name_file_row_and_field(tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "m.jsonl", [{"prompt": "a", "gt": "1"}, {"prompt": "b"}])
    with pytest.raises(DataError, match=r"m\.jsonl, row 2, field 'gt': is missing") as e:
        ds(f, ground_truth_field="gt")
    assert (e.value.row, e.value.column) == (2, "gt")
    f = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "a"}, {"prompt": 7}])
    with pytest.raises(DataError, match="row 2, field 'prompt': must be text or a list"):
        ds(f)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="empty.jsonl: holds no rows"):
        ds(tmp_path / "empty.jsonl")
    (tmp_path / "bad.jsonl").write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl, row 2: is not UTF-8"):
        ds(tmp_path / "bad.jsonl")
    (tmp_path / "j.jsonl").write_text('{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(DataError, match="row 2: is not JSON"):
        ds(tmp_path / "j.jsonl")
    with pytest.raises(DataError, match="does not exist"):
        ds(tmp_path / "none.jsonl")
    with pytest.raises(SpecError, match="data.path.*allowed: .jsonl, .parquet"):
        DataConfig(path="x.csv")


def test_parquet_errors_name_row_and_field(tmp_path: Path) -> None:
    # a string column holding invalid UTF-8 in its third cell (written through a binary view)
    cells = pa.array([b"ok", b"fine", b"caf\xe9"], type=pa.binary()).view(pa.string())
    pq.write_table(pa.table({"prompt": cells}), tmp_path / "u.parquet")
    with pytest.raises(DataError, match=r"u\.parquet, row 3, field 'prompt': is not UTF-8"):
        ds(tmp_path / "u.parquet")
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "c.parquet")
    with pytest.raises(DataError, match="field 'prompt': has no such column \\(columns: text\\)"):
        ds(tmp_path / "c.parquet")
    pq.write_table(pa.table({"prompt": ["a", None]}), tmp_path / "n.parquet")
    with pytest.raises(DataError, match="row 2, field 'prompt': is missing"):
        ds(tmp_path / "n.parquet")
    pq.write_table(pa.table({"prompt": pa.array([], type=pa.string())}), tmp_path / "e.parquet")
    with pytest.raises(DataError, match="holds no rows"):
        ds(tmp_path / "e.parquet")
    (tmp_path / "x.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="is not a Parquet file"):
        ds(tmp_path / "x.parquet")
