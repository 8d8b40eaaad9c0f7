"""The Slurm allocation source on a real 4-node cluster: an elastic job grows with member jobs, shrinks
(member cancelled; anchor resized in place, twice), and loses nodes to Slurm (node DOWN, a member
cancelled from outside, preemption); growth is throttled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import has, kinds, poll_until
from lab import SlurmLab

from nereusd.allocation import AllocationError, ElasticJob, EventKind
from nereusd.slurm.commands import SlurmCommands
from nereusd.slurm.elastic import SlurmSource
from nereusd.slurm.poller import SlurmPoller
from nereusd.slurm.states import Phase
from nereusd.slurm.submit import LaunchSpec, SubmititLauncher

pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group("slurm")]
GPUS = 4  # per node in the lab


def _spec(lab: SlurmLab, tmp_path: Path, job_id: str) -> LaunchSpec:
    # The node agent's place is taken by a plain long sleep: these tests are about allocations.
    return LaunchSpec(job_id=job_id, folder=str(tmp_path / "submitit"), gpus_per_node=GPUS,
                      endpoint="tcp://127.0.0.1:7501", partition=lab.partition, agent_argv=("sleep", "600"))


def _source(lab: SlurmLab, spec: LaunchSpec, **kw: object) -> tuple[SlurmSource, SlurmCommands]:
    cmds = SlurmCommands(timeout_s=10, env=lab.env)
    poller = SlurmPoller(cmds, interval_s=0.3, backoff_max_s=2)
    return SlurmSource(cmds, poller, launch_spec=lambda job: spec, **kw), cmds  # type: ignore[arg-type]


def _elastic(job_id: str, anchor: str, max_gpus: int) -> ElasticJob:
    return ElasticJob(job_id=job_id, anchor_job_id=anchor, min_gpus=GPUS, max_gpus=max_gpus,
                      gpus_per_node=GPUS, slurm_user="root")


def test_grow_shrink_resize_twice_and_release(lab: SlurmLab, tmp_path: Path) -> None:
    spec = _spec(lab, tmp_path, "grow-shrink")
    anchor = SubmititLauncher(spec, env=lab.env).submit("anchor", 3).slurm_job_id
    source, _ = _source(lab, spec)
    source.track(_elastic("grow-shrink", anchor, max_gpus=4 * GPUS))
    seen: list = []
    poll_until(source, seen, has(EventKind.GRANTED, anchor), what="anchor start")
    granted = kinds(seen, EventKind.GRANTED)[0]
    assert len(granted.nodes) == 3 and granted.num_gpus == 3 * GPUS
    assert all(n.gpu_indices == (0, 1, 2, 3) and n.holder_job_id == anchor for n in granted.nodes)

    with pytest.raises(AllocationError, match="at most 1 more"):
        source.grow("grow-shrink", 2)  # 3 nodes held, max 4
    (member,) = source.grow("grow-shrink", 1)
    assert member in source.jobs()[0].member_job_ids and has(EventKind.REQUESTED, member)(source.poll())
    poll_until(source, seen, has(EventKind.GROWN, member), what="member start")
    alloc = source.allocation("grow-shrink")
    assert alloc.num_gpus == 4 * GPUS and set(alloc.node_names) == set(lab.nodes)
    member_node = next(n.node for n in alloc.nodes if n.holder_job_id == member)

    # release the member (scancel): SHRUNK, not CANCELLED, and the member is forgotten
    source.shrink("grow-shrink", [member_node])
    poll_until(source, seen, has(EventKind.SHRUNK, member), what="member release")
    poll_until(source, seen, lambda _: member not in source.jobs()[0].member_job_ids, what="member forgotten")
    assert not kinds(seen, EventKind.CANCELLED)

    # shrink the anchor in place, twice (repeated resizes need slurmdbd); the batch node is refused
    batch = lab.job_field(anchor, "BatchHost")
    with pytest.raises(AllocationError, match="batch node"):
        source.shrink("grow-shrink", [batch])
    for step in (1, 2):
        victim = next(n for n in source.allocation("grow-shrink").node_names if n != batch)
        source.shrink("grow-shrink", [victim])
        poll_until(source, seen, has(EventKind.SHRUNK, anchor, count=step), what=f"anchor resize {step}")
        assert lab.job_field(anchor, "NumNodes") == str(3 - step)
        assert victim not in source.allocation("grow-shrink").node_names
    assert source.allocation("grow-shrink").node_names == (batch,)
    assert lab.job_field(anchor, "JobState") == "RUNNING"

    source.release("grow-shrink")
    poll_until(source, seen, has(EventKind.RELEASED, anchor), what="release")
    assert source.allocation("grow-shrink").num_gpus == 0


def test_losses_node_down_cancelled_member_preemption(lab: SlurmLab, tmp_path: Path) -> None:
    spec = _spec(lab, tmp_path, "losses")
    anchor = SubmititLauncher(spec, env=lab.env).submit("anchor", 1).slurm_job_id
    source, _ = _source(lab, spec)
    source.track(_elastic("losses", anchor, max_gpus=4 * GPUS))
    seen: list = []
    poll_until(source, seen, has(EventKind.GRANTED, anchor), what="anchor start")
    members = source.grow("losses", 3)
    assert len(members) == 3
    poll_until(source, seen, has(EventKind.GROWN, count=3), what="three members")
    holder = {n.holder_job_id: n.node for n in source.allocation("losses").nodes}

    # 1. a node goes DOWN under a member
    down_member, cancelled_member, preempted_member = members
    lab.run("scontrol", "update", f"NodeName={holder[down_member]}", "State=DOWN", "Reason=nereus-test")
    poll_until(source, seen, has(EventKind.NODE_DOWN, down_member), what="node down")
    event = kinds(seen, EventKind.NODE_DOWN)[0]
    assert [n.node for n in event.nodes] == [holder[down_member]] and "nereus-test" in event.reason
    assert event.kind.urgent

    # 2. someone else cancels a member
    lab.run("scancel", cancelled_member)
    poll_until(source, seen, has(EventKind.CANCELLED, cancelled_member), what="outside cancel")

    # 3. a job in the higher-tier partition preempts a member
    lab.sbatch("-p", lab.urgent_partition, "-w", holder[preempted_member], f"--gres=gpu:{GPUS}", "-J", "urgent")
    poll_until(source, seen, has(EventKind.PREEMPTED, preempted_member), timeout_s=40, what="preemption")

    assert source.allocation("losses").node_names == (holder[anchor],)
    poll_until(source, seen, lambda _: source.jobs()[0].member_job_ids == (), what="members forgotten")
    assert not kinds(seen, EventKind.SHRUNK) and not kinds(seen, EventKind.REQUEST_FAILED)


def test_growth_is_throttled(lab: SlurmLab, tmp_path: Path) -> None:
    spec = _spec(lab, tmp_path, "throttled")
    anchor = SubmititLauncher(spec, env=lab.env).submit("anchor", 1).slurm_job_id
    now = [1000.0]
    source, _ = _source(lab, spec, max_submissions_per_minute=1, clock=lambda: now[0])
    source.track(_elastic("throttled", anchor, max_gpus=3 * GPUS))
    seen: list = []
    first = source.grow("throttled", 2)
    assert len(first) == 1  # the second waits for the throttle window
    seen.extend(source.poll())
    assert len(source.jobs()[0].member_job_ids) == 1
    now[0] += 60.0
    seen.extend(source.poll())
    assert len(source.jobs()[0].member_job_ids) == 2
    assert len(kinds(seen, EventKind.REQUESTED)) == 2
    poll_until(source, seen, has(EventKind.GROWN, count=2), what="both members")
    assert os.path.isdir(spec.folder)


def test_restarted_source_adopts_members_and_resumes_without_spurious_events(lab: SlurmLab, tmp_path: Path) -> None:
    spec = _spec(lab, tmp_path, "restart")
    anchor = SubmititLauncher(spec, env=lab.env).submit("anchor", 1).slurm_job_id
    first, _ = _source(lab, spec)
    first.track(_elastic("restart", anchor, max_gpus=2 * GPUS))
    seen: list = []
    (member,) = first.grow("restart", 1)
    poll_until(first, seen, has(EventKind.GROWN, member), what="member start")
    before = first.allocation("restart")

    # The daemon died between sbatch and storing the member id: a new source knows only the anchor.
    crashed, _ = _source(lab, spec)
    crashed.track(_elastic("restart", anchor, max_gpus=2 * GPUS))
    after: list = []
    poll_until(crashed, after, has(EventKind.GROWN, member), what="member adopted by its comment")
    assert crashed.jobs()[0].member_job_ids == (member,)
    assert set(crashed.allocation("restart").node_names) == set(before.node_names)

    # The daemon restarted with everything stored: the first poll reports nothing new.
    restored, _ = _source(lab, spec)
    restored.track(_elastic("restart", anchor, max_gpus=2 * GPUS).with_member(member), allocation=before)
    assert restored.poll() == []  # the first poll is due at once and finds nothing new
    assert restored.poller.successful_polls == 1
    assert restored.allocation("restart") == before


def test_example_submit_script_submits_anchor_and_members(lab: SlurmLab, tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(root / "etc" / "submit_elastic.py"), "example", "--min-gpus", "8",
                           "--max-gpus", "16", "--gpus-per-node", str(GPUS), "--endpoint", "tcp://127.0.0.1:1",
                           "--folder", str(tmp_path / "f"), "--partition", lab.partition, "--members", "1",
                           "--no-register"], capture_output=True, text=True, timeout=60, env=lab.env, cwd=root)
    assert proc.returncode == 0, proc.stderr
    job = ElasticJob.from_dict(json.loads(proc.stdout))
    assert job.max_nodes == 4 and len(job.member_job_ids) == 1 and job.extra["endpoint"] == "tcp://127.0.0.1:1"
    assert lab.job_field(job.anchor_job_id, "NumNodes") in ("2", "2-2")
    assert lab.job_field(job.anchor_job_id, "Comment") == "nereus:example"
    assert lab.job_field(job.anchor_job_id, "JobName") == "nereus-example-anchor"
    assert lab.job_field(job.member_job_ids[0], "JobName") == "nereus-example-member"
    assert lab.job_field(job.member_job_ids[0], "TresPerNode") == f"gres:gpu:{GPUS}"


def test_jobs_ending_before_they_start_are_reported(lab: SlurmLab, tmp_path: Path) -> None:
    held = replace(_spec(lab, tmp_path, "never-ran"), extra_sbatch={"hold": True})  # nothing will start
    anchor = SubmititLauncher(held, env=lab.env).submit("anchor", 1).slurm_job_id
    source, _ = _source(lab, held)
    source.track(_elastic("never-ran", anchor, max_gpus=2 * GPUS))
    (member,) = source.grow("never-ran", 1)
    seen: list = []
    lab.run("scancel", member)  # someone cancels the pending member: the growth request failed
    poll_until(source, seen, has(EventKind.REQUEST_FAILED, member), what="failed request")
    assert "before starting" in kinds(seen, EventKind.REQUEST_FAILED)[0].reason
    lab.run("scancel", anchor)  # the anchor ends without ever holding a node: the job still ends
    poll_until(source, seen, has(EventKind.CANCELLED, anchor), what="anchor cancelled while pending")
    assert kinds(seen, EventKind.CANCELLED)[0].nodes == ()
    assert not kinds(seen, EventKind.GRANTED) and not kinds(seen, EventKind.GROWN)


def test_an_anchor_requeue_is_followed_and_the_members_stay(lab: SlurmLab, tmp_path: Path) -> None:
    """Slurm requeues the anchor (a node failure, preemption, scontrol requeue) and restamps its submit
    time: the source reports its nodes gone (NODE_DOWN), not the job ended, keeps the member, grows no
    member while the anchor waits to run again (its nodes are asked for), and grants the anchor again."""
    spec = replace(_spec(lab, tmp_path, "rq"), extra_sbatch={"requeue": True})
    anchor = SubmititLauncher(spec, env=lab.env).submit("anchor", 1).slurm_job_id
    source, _ = _source(lab, spec)
    source.track(replace(_elastic("rq", anchor, max_gpus=2 * GPUS), extra={"comment": "nereus:rq"}))
    seen: list = []
    poll_until(source, seen, has(EventKind.GRANTED, anchor), what="anchor start")
    (member,) = source.grow("rq", 1)
    poll_until(source, seen, has(EventKind.GROWN, member), what="member start")
    member_node = next(n.node for n in source.allocation("rq").nodes if n.holder_job_id == member)
    lab.run("scontrol", "requeue", anchor)
    poll_until(source, seen, has(EventKind.NODE_DOWN, anchor), what="the anchor's requeue")
    info = source.poller.info(anchor)
    if info is not None and info.mapping.phase is Phase.PENDING:  # (it may run again already)
        # the requeued anchor's nodes are asked for: no member grows into its place meanwhile
        with pytest.raises(AllocationError, match="at most 0 more"):
            source.grow("rq", 1)
    poll_until(source, seen, has(EventKind.GRANTED, anchor, count=2), timeout_s=90,
               what="the requeued anchor granted again")
    ended = [e for e in seen if e.kind in (EventKind.CANCELLED, EventKind.FAILED, EventKind.COMPLETED)]
    assert not ended, ended  # not "VANISHED (job id reused)": the job goes on
    gone = [e for e in seen if e.slurm_job_id == anchor and e.kind not in (EventKind.GRANTED, EventKind.REQUESTED)]
    assert [e.kind for e in gone] == [EventKind.NODE_DOWN], gone
    assert source.jobs()[0].member_job_ids == (member,)
    assert member_node in source.allocation("rq").node_names
