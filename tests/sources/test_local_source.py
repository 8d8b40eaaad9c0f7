"""The local allocation source (no Slurm): grants, grow/shrink/release on request, a validated
schedule file replaying Slurm-like losses, and one real process group per granted node."""

from __future__ import annotations

from pathlib import Path

import pytest

from nereusd.allocation import AllocationError, AllocationSource, ElasticJob, EventKind
from nereusd.local_source import LocalSource, ScheduleStep, load_schedule
from planner.errors import SpecError


def _job(job_id: str = "demo", min_gpus: int = 2, max_gpus: int = 6) -> ElasticJob:
    return ElasticJob(job_id=job_id, anchor_job_id=f"local-{job_id}", min_gpus=min_gpus, max_gpus=max_gpus,
                      gpus_per_node=2, slurm_user="alice")


def test_grant_grow_shrink_release() -> None:
    src = LocalSource(num_nodes=4, slots_per_node=2)
    assert isinstance(src, AllocationSource)
    src.track(_job(min_gpus=3))  # 3 GPUs -> 2 nodes of 2
    (granted,) = src.poll()
    assert granted.kind is EventKind.GRANTED and granted.num_gpus == 4 and granted.slurm_job_id is None
    assert [n.gpu_indices for n in granted.nodes] == [(0, 1), (0, 1)]
    src.grow("demo", 1)
    with pytest.raises(AllocationError, match="cannot add 1 nodes"):
        src.grow("demo", 1)  # max_gpus=6 -> 3 nodes
    assert src.allocation("demo").node_names == ("local0", "local1", "local2")
    src.shrink("demo", ["local1"])
    with pytest.raises(AllocationError, match="holds no node"):
        src.shrink("demo", ["local3"])
    src.release("demo")
    kinds = [e.kind for e in src.poll()]
    assert kinds == [EventKind.GROWN, EventKind.SHRUNK, EventKind.RELEASED]
    assert src.allocation("demo").num_gpus == 0 and len(src.free_nodes()) == 4
    with pytest.raises(AllocationError, match="not tracked"):
        src.grow("other", 1)


def test_schedule_file_plays_losses_in_time(tmp_path: Path) -> None:
    path = tmp_path / "schedule.toml"
    path.write_text("""
[[step]]
at_s = 0
job = "demo"
action = "grant"
nodes = 3

[[step]]
at_s = 5
job = "demo"
action = "node_down"
names = ["local1"]

[[step]]
at_s = 10
job = "demo"
action = "preempt"
nodes = 1

[[step]]
at_s = 12
job = "demo"
action = "grow"
nodes = 9
""")
    steps = load_schedule(path)
    assert [s.action for s in steps] == ["grant", "node_down", "preempt", "grow"]
    now = [0.0]
    src = LocalSource(num_nodes=4, slots_per_node=2, schedule=steps, clock=lambda: now[0])
    src.track(_job())
    assert [e.kind for e in src.poll()] == [EventKind.GRANTED]  # the schedule grants, not track()
    now[0] = 4.9
    assert src.poll() == []
    now[0] = 5.0
    (down,) = src.poll()
    assert down.kind is EventKind.NODE_DOWN and [n.node for n in down.nodes] == ["local1"]
    now[0] = 20.0
    preempted, failed = src.poll()
    assert preempted.kind is EventKind.PREEMPTED and [n.node for n in preempted.nodes] == ["local2"]
    assert failed.kind is EventKind.REQUEST_FAILED and "cannot add 9" in failed.reason
    assert src.allocation("demo").node_names == ("local0",)


@pytest.mark.parametrize(("text", "field"), [
    ('{"step": [{"at_s": 0, "job": "a", "action": "explode", "nodes": 1}]}', "action"),
    ('{"step": [{"at_s": -1, "job": "a", "action": "grant", "nodes": 1}]}', "at_s"),
    ('{"step": [{"at_s": 0, "job": "a", "action": "grow"}]}', "nodes"),
    ('{"step": [{"at_s": 0, "job": "a", "action": "grant", "nodes": 1, "colour": "red"}]}', "unknown keys"),
    ('{"steps": []}', "list of steps"),
    ("not json", "cannot read"),
])
def test_schedule_errors_name_the_field(tmp_path: Path, text: str, field: str) -> None:
    path = tmp_path / "s.json"
    path.write_text(text)
    with pytest.raises(SpecError, match=field):
        load_schedule(path)


def test_schedule_step_allowed_values_in_message() -> None:
    with pytest.raises(SpecError) as err:
        ScheduleStep(at_s=0, job="a", action="fly", nodes=1)
    assert "grant, grow, shrink, node_down, preempt, release" in str(err.value)


@pytest.mark.multiprocess
def test_each_node_is_a_process_group_started_and_stopped() -> None:
    def argv(job: ElasticJob, node) -> list[str]:  # type: ignore[no-untyped-def]
        # stands in for `python -m agent.node --node NODE`: a process that runs until stopped
        return ["sleep", "600"]

    src = LocalSource(num_nodes=3, slots_per_node=2, agent_argv=argv)
    try:
        src.track(_job())
        src.grow("demo", 1)
        procs = {n: p for t in src._jobs.values() for n, p in t.procs.items()}  # noqa: SLF001
        assert set(procs) == {"local0", "local1"} and all(p.poll() is None for p in procs.values())
        src.shrink("demo", ["local1"])
        assert procs["local1"].returncode is not None  # stopped and reaped by shrink
        procs["local0"].kill()  # the node's agent dies on its own
        procs["local0"].wait(timeout=10)
        events = src.poll()
        assert events[-1].kind is EventKind.NODE_DOWN and "exited" in events[-1].reason
        assert src.allocation("demo").num_gpus == 0
    finally:
        src.close()


def test_a_job_that_can_never_be_granted_is_refused_before_it_is_tracked() -> None:
    src = LocalSource(num_nodes=2, slots_per_node=8)
    wide = ElasticJob(job_id="wide", anchor_job_id="a", min_gpus=16, max_gpus=16, gpus_per_node=16,
                      slurm_user="alice")
    with pytest.raises(AllocationError, match="8 slots"):
        src.track(wide)
    with pytest.raises(AllocationError, match="2 are free"):
        src.track(ElasticJob(job_id="big", anchor_job_id="a", min_gpus=24, max_gpus=32, gpus_per_node=8,
                             slurm_user="alice"))
    assert src.jobs() == () and src.poll() == [] and len(src.free_nodes()) == 2


def test_a_restored_allocation_is_kept_and_nothing_is_granted_again() -> None:
    first = LocalSource(num_nodes=4, slots_per_node=2)
    first.track(_job())
    first.grow("demo", 1)
    first.poll()
    held = first.allocation("demo")
    again = LocalSource(num_nodes=4, slots_per_node=2)  # a restarted daemon's source
    again.track(_job(), held)
    assert again.poll() == []  # no second grant
    assert again.allocation("demo").node_names == ("local0", "local1")
    again.shrink("demo", ["local1"])  # the grown node is known
    assert [e.kind for e in again.poll()] == [EventKind.SHRUNK]
