"""Pure parts of the Slurm tracker, without a cluster: host lists, the state table, GRES indices from
real `scontrol -o show job -d` and `squeue --json` output (captured from the lab, in reference/), and
the generated sbatch scripts compared with stored references."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nereusd.allocation import EventKind
from nereusd.slurm.commands import gres_indices, node_gpu_indices, parse_show_job
from nereusd.slurm.hostlist import expand
from nereusd.slurm.poller import parse_squeue_job
from nereusd.slurm.states import JOB_STATES, Phase, map_job_state, node_lost
from nereusd.slurm.submit import LaunchSpec, SubmititLauncher
from planner.errors import SpecError

REF = Path(__file__).with_name("reference")
# Every job state of Slurm 22.05 (src/common/slurm_protocol_defs.c: job_state_string + flags).
SLURM_22_05_JOB_STATES = ("PENDING", "RUNNING", "SUSPENDED", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT",
                          "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY", "COMPLETING",
                          "CONFIGURING", "RESIZING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "SPECIAL_EXIT",
                          "STOPPED", "REVOKED", "RESV_DEL_HOLD", "SIGNALING", "STAGE_OUT")


@pytest.mark.parametrize(("text", "names"), [
    ("node[1-3,07],login", ("node1", "node2", "node3", "node07", "login")),
    ("gpu-a[01-02]", ("gpu-a01", "gpu-a02")),
    ("rack[1-2]-n[1-2]", ("rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2")),
    ("node4", ("node4",)),
    ("", ()),
    ("(null)", ()),
])
def test_hostlist_expand(text: str, names: tuple[str, ...]) -> None:
    assert expand(text) == names


def test_hostlist_errors_say_what_is_allowed() -> None:
    with pytest.raises(SpecError, match="N or N-M"):
        expand("node[a-b]")
    with pytest.raises(SpecError, match="unbalanced"):
        expand("node[1-2")


def test_every_slurm_state_is_mapped_and_losses_say_why() -> None:
    for state in SLURM_22_05_JOB_STATES:
        mapping = map_job_state(state)
        assert mapping.phase is not Phase.UNKNOWN, state
        if mapping.terminal:
            assert mapping.ended_by is not None, f"{state} ends a job without saying why"
    assert set(JOB_STATES) == set(SLURM_22_05_JOB_STATES)
    assert map_job_state("CANCELLED by 0").ended_by is EventKind.CANCELLED
    assert map_job_state("TIMEOUT").ended_by is EventKind.TIME_LIMIT
    assert map_job_state("NODE_FAIL").ended_by is EventKind.NODE_DOWN
    assert map_job_state("PREEMPTED").ended_by is EventKind.PREEMPTED
    assert map_job_state("RUNNING").holds_usable_nodes and not map_job_state("SUSPENDED").holds_usable_nodes
    assert map_job_state("SOMETHING_NEW").phase is Phase.UNKNOWN


@pytest.mark.parametrize(("state", "flags", "lost"), [
    ("down", (), True), ("down*", (), True), ("DOWN+DRAIN", (), True), ("fail", (), True),
    ("idle", (), False), ("mixed", (), False), ("allocated", ("DRAIN",), False), ("drained", (), False),
    ("mixed", ("NOT_RESPONDING",), False), ("idle", ("POWERED_DOWN",), True),
])
def test_node_lost(state: str, flags: tuple[str, ...], lost: bool) -> None:
    assert node_lost(state, flags) is lost


@pytest.mark.parametrize(("gres", "indices"), [
    ("gpu:4(IDX:0-1,3)", (0, 1, 3)), ("gpu:a100:2(IDX:4-5)", (4, 5)), ("gpu:2(IDX:N/A)", ()),
    ("gpu:0", ()), ("mps:100(0/100,0/100),gpu:1(IDX:7)", (7,)), ("", ()),
])
def test_gres_indices(gres: str, indices: tuple[int, ...]) -> None:
    assert gres_indices(gres) == indices


def test_scontrol_show_job_per_node_gres_from_real_output() -> None:
    fields = parse_show_job((REF / "scontrol_show_job_d.txt").read_text())
    assert fields["JobId"] == "2" and fields["BatchHost"] == "node1" and fields["Comment"] == "nereus:demo"
    assert fields["NodeList"] == "node[1-3]" and fields["JobState"] == "RUNNING"
    # node1 shares its GPUs with another job (which holds index 0); the others are free
    assert node_gpu_indices(fields) == {"node1": (1, 2), "node2": (0, 1), "node3": (0, 1)}


def test_squeue_json_entries_from_real_output_agree_with_scontrol() -> None:
    data = json.loads((REF / "squeue.json").read_text())
    jobs = {j.job_id: j for j in map(parse_squeue_job, data["jobs"])}
    mixed = jobs["2"]
    assert mixed.nodes == ("node1", "node2", "node3") and mixed.comment == "nereus:demo"
    assert dict(mixed.gpu_indices) == node_gpu_indices(parse_show_job((REF / "scontrol_show_job_d.txt").read_text()))
    assert mixed.mapping.phase is Phase.RUNNING and mixed.submit_time_s > 1.7e9
    assert jobs["1"].gpu_indices == {"node1": (0,)}


def _launcher() -> SubmititLauncher:
    return SubmititLauncher(LaunchSpec(job_id="grpo-8b", folder="/shared/nereus/grpo-8b", gpus_per_node=8,
                                       endpoint="tcp://head:7501", keys_dir="/home/alice/.config/nereus/agent",
                                       partition="gpu", python="/opt/nereus/bin/python"))


@pytest.mark.parametrize(("role", "nodes"), [("anchor", 2), ("member", 1)])
def test_generated_sbatch_matches_reference(role: str, nodes: int) -> None:
    text = _launcher().sbatch_text(role, nodes)  # type: ignore[arg-type]
    assert text == (REF / f"{role}.sbatch").read_text()
    assert "expand" not in text  # growth never relies on Slurm job expansion


def test_agent_command_and_launch_spec_validation() -> None:
    assert _launcher().spec.agent_command() == [
        "/opt/nereus/bin/python", "-m", "agent.node", "--endpoint", "tcp://head:7501", "--job", "grpo-8b",
        "--keys", "/home/alice/.config/nereus/agent"]
    with pytest.raises(SpecError, match="launch.endpoint"):
        LaunchSpec(job_id="a", folder="/f", gpus_per_node=1, endpoint="head:7501")
    with pytest.raises(SpecError, match="launch.job_id"):
        LaunchSpec(job_id="has space", folder="/f", gpus_per_node=1, endpoint="tcp://h:1")
    with pytest.raises(SpecError, match="member: exactly 1"):
        _launcher().parameters("member", 2)
    with pytest.raises(SpecError, match="anchor, member"):
        _launcher().parameters("driver", 1)  # type: ignore[arg-type]
