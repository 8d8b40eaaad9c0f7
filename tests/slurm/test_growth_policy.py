"""The daemon's growth policy (nereusd/growth.py) on its own: a stand-in source and controller, the real
payback rule. The lab story (test_live_slurm) shows it growing a live job by member jobs."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from nereusd.allocation import Allocation, ElasticJob, NodeAllocation
from nereusd.growth import GrowthPolicy
from planner import admission


@dataclass
class Source:
    name: str = "slurm"
    held: int = 1
    pending: list[str] = field(default_factory=list)
    idle: tuple[str, ...] = ("node3",)
    job: ElasticJob = field(default_factory=lambda: ElasticJob(job_id="j", anchor_job_id="7", min_gpus=2, max_gpus=6,
                                                               gpus_per_node=2, slurm_user="u"))

    def jobs(self) -> tuple[ElasticJob, ...]:
        return (self.job,)

    def allocation(self, job_id: str) -> Allocation:
        return Allocation(job_id=job_id, nodes=tuple(NodeAllocation(node=f"node{i}", gpu_indices=(0, 1),
                                                                    holder_job_id="7") for i in range(self.held)))

    def pending_members(self, job_id: str) -> tuple[str, ...]:
        return tuple(self.pending)

    def idle_nodes(self) -> tuple[str, ...]:
        return self.idle


class Planner:
    """Step time falls with GPUs as ``step_s(n)``; a transition costs ``l_tran_s``."""

    def __init__(self, step_s: Any, l_tran_s: float) -> None:
        self.step_s, self.l_tran_s = step_s, l_tran_s

    def search(self, spec: dict[str, Any], pool: frozenset[int], version: int) -> admission.Candidate:
        return admission.Candidate(plan=("plan", len(pool)), prediction=SimpleNamespace(step_latency_s=self.step_s(len(pool))))

    def transition(self, spec: Any, old: Any, new: Any, participants: frozenset[int], node_of_gpu: Any) -> Any:
        assert node_of_gpu(max(participants)) == "(member pending)"  # the priced node is the member to come
        return SimpleNamespace(predicted_s=self.l_tran_s)


def _ctl(planner: Planner, gpus: int = 2, state: str = "running") -> Any:
    store = SimpleNamespace(open_transitions=lambda job: [], max_plan_version=lambda job: 1)
    owner = {g: f"node{g // 2}" for g in range(gpus)}
    return SimpleNamespace(job_id="j", job={"state": state}, draining={}, plan=("plan", gpus), store=store,
                           prediction=SimpleNamespace(step_latency_s=planner.step_s(gpus)), pool=frozenset(owner),
                           gpus_per_node=2, gpu_owner=owner, planner=planner, last_step=10, gamma=0.5,
                           current_prediction=lambda: None,
                           _spec_now=lambda: {}, _participants=lambda: frozenset(owner), _node_of_gpu=owner.__getitem__)


def _policy(source: Source, ctl: Any) -> tuple[GrowthPolicy, list[tuple[str, str, Any]], list[tuple[str, Any]]]:
    asked: list[tuple[str, str, Any]] = []
    events: list[tuple[str, Any]] = []
    policy = GrowthPolicy(source=source, controllers={"j": ctl}, request=lambda op, j, a: asked.append((op, j, a)),
                          add_event=lambda j, kind, data: events.append((kind, data)), horizon_steps=50)
    return policy, asked, events


def test_grows_one_member_at_a_time_while_the_payback_rule_admits_it() -> None:
    source = Source()
    planner = Planner(step_s=lambda n: 10.0 / n, l_tran_s=20.0)  # 2 -> 4 GPUs saves 2.5 s/step: pays in 8 steps
    policy, asked, events = _policy(source, _ctl(planner))
    assert policy.consider(source.job) == "requested"
    assert asked == [("grow", "j", 1)] and events[-1][0] == "growth-requested"
    assert events[-1][1]["gpus_after"] == 4 and events[-1][1]["saving_s_per_step"] == 2.5
    source.pending = ["8"]  # the member waits in Slurm's queue: no second request meanwhile
    assert policy.consider(source.job) == "pending" and len(asked) == 1


def test_declines_without_a_gain_and_cancels_a_member_no_longer_wanted() -> None:
    source = Source()
    slow = Planner(step_s=lambda n: 10.0 / n, l_tran_s=1e6)  # the transition never pays back
    policy, asked, events = _policy(source, _ctl(slow))
    assert policy.consider(source.job) == "declined" and not asked
    assert events[-1][0] == "growth-declined" and "gamma*H_x" in events[-1][1]["reason"]
    assert policy.consider(source.job) == "declined" and len(events) == 1  # said once, not every look
    source.pending = ["8"]  # a member asked for earlier, whose gain went away on the re-priced pool
    assert policy.consider(source.job) == "cancelled" and asked == [("cancel_pending", "j", ["8"])]
    assert events[-1][0] == "growth-cancelled"


def test_waits_for_room_stops_at_the_maximum_and_cancels_when_the_job_ends() -> None:
    source = Source(idle=())
    planner = Planner(step_s=lambda n: 10.0 / n, l_tran_s=1.0)
    policy, asked, events = _policy(source, _ctl(planner))
    assert policy.consider(source.job) == "waiting" and not asked  # no idle node for a member
    source.idle, source.held = ("node9",), 3
    assert policy.consider(source.job) == "declined" and "max_gpus=6" in events[-1][1]["reason"]
    source.held, source.pending = 2, ["8", "9"]  # 2 held + 2 pending > 3 nodes: the extra one goes
    assert policy.consider(source.job) == "cancelled" and asked[-1] == ("cancel_pending", "j", ["9"])
    source.pending = ["10"]
    ended = _ctl(planner, state="cancelled")
    policy2, asked2, _ = _policy(source, ended)
    assert policy2.consider(source.job) == "cancelled" and asked2 == [("cancel_pending", "j", ["10"])]


def test_a_member_near_its_time_limit_is_shrunk_gracefully_ahead_of_it() -> None:
    source = Source(held=2)
    ends = {"node1": 1000.0 + 90, "node0": 1000.0 + 3600}  # node1's member ends in 90 s, inside the lead
    source.member_end_times = lambda job_id: ends  # type: ignore[attr-defined]
    shrunk: list[tuple[str, list[str], str]] = []
    events: list[tuple[str, Any]] = []
    planner = Planner(step_s=lambda n: 10.0 / n, l_tran_s=1.0)
    policy = GrowthPolicy(source=source, controllers={"j": _ctl(planner, gpus=4)}, request=lambda *a: None,
                          add_event=lambda j, kind, data: events.append((kind, data)),
                          shrink=lambda j, nodes, why: shrunk.append((j, nodes, why)), time_limit_lead_s=120,
                          wall=lambda: 1000.0)
    assert policy.ahead_of_time_limits("j") == ["node1"]
    assert shrunk == [("j", ["node1"], "time limit ahead")] and events[0] == ("time-limit-ahead",
                                                                               {"node": "node1", "ends_in_s": 90.0})
    assert policy.ahead_of_time_limits("j") == []  # once
