"""The simulated world around the real controller: a virtual clock, the simulated job, the store with one
read made cheap, and the nodes that join, leave and die as a trace says (the agents' side, told to the
controller as the daemon would)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nereusd.allocation import AllocationEvent, EventKind, NodeAllocation
from nereusd.controller import JobController
from nereusd.planning import cluster_for
from nereusd.sim.trace import Trace, TraceRow
from nereusd.sim.truth import StepWorkload
from nereusd.store import Store
from planner.hardware import ClusterSpec
from planner.plan import GlobalPlan


class QuietLog:
    """The controller's logger in a simulation: decisions are in the store; nothing is printed."""

    def bind(self, **_: Any) -> QuietLog:
        return self

    def __getattr__(self, _name: str) -> Callable[..., None]:
        return lambda *a, **k: None


class VirtualClock:
    def __init__(self, start_s: float = 1_000_000.0) -> None:
        self.now = start_s

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        assert seconds >= 0, seconds
        self.now += seconds



@dataclass(frozen=True, kw_only=True, slots=True)
class SimJob:
    """The simulated job: presets and the workload (the response length comes from the trace)."""

    model: str = "llama-3.1-8b"
    algo: str = "ppo"
    device: str = "h200"
    gpus_per_node: int = 8
    prompts_per_step: int = 1024
    samples_per_prompt: int = 1
    prompt_tokens: int = 512
    max_response_tokens: int | None = None  # the generation cap (vLLM max_tokens); None: uncapped
    train_mini_batches_per_step: int = 1

    def spec(self, response_tokens: float) -> dict[str, Any]:
        workload: dict[str, Any] = {"prompts_per_step": self.prompts_per_step,
                                    "samples_per_prompt": self.samples_per_prompt,
                                    "prompt_tokens": self.prompt_tokens,
                                    "response_tokens": max(1, round(response_tokens)),
                                    "train_mini_batches_per_step": self.train_mini_batches_per_step}
        if self.max_response_tokens:
            workload["max_response_tokens"] = self.max_response_tokens
        return {"model": self.model, "algo": self.algo, "device": self.device,
                "gpus_per_node": self.gpus_per_node, "workload": workload}


_GPUS: dict[int, tuple[GlobalPlan, frozenset[int]]] = {}


def plan_gpus(plan: GlobalPlan) -> frozenset[int]:
    """``plan.gpus``, computed once per plan object (it is rebuilt on every access, ~ms at 1,024 GPUs)."""
    hit = _GPUS.get(id(plan))
    if hit is None or hit[0] is not plan:
        if len(_GPUS) > 64:
            _GPUS.clear()
        hit = _GPUS[id(plan)] = (plan, plan.gpus)
    return hit[1]


# --- simulated agents ---------------------------------------------------------------------------------


def _devices(n: int) -> list[dict[str, Any]]:
    return [{"index": i, "kind": "gpu", "name": "sim", "memory_bytes": 0} for i in range(n)]


class SimCluster:
    """The nodes of one job: joins, releases and losses, told to the controller as the daemon would."""

    def __init__(self, ctl: JobController, store: Store, job_id: str, gpus_per_node: int,
                 clock: VirtualClock) -> None:
        self.ctl, self.store, self.job_id, self.per_node, self.clock = ctl, store, job_id, gpus_per_node, clock
        self.alive: list[str] = []
        self.counter = 0

    def resize(self, gpus: int) -> None:
        want = gpus // self.per_node
        if want > len(self.alive):
            added = []
            for _ in range(want - len(self.alive)):
                name = f"sim{self.counter:05d}"
                self.counter += 1
                self.store.register_node(job_id=self.job_id, node=name, devices=_devices(self.per_node),
                                         slurm_job_id=None, host=name, incarnation=name)
                added.append(name)
            self.alive += added
            self.ctl.on_allocation(self._event(EventKind.GROWN, added, "trace: nodes granted"))
            for name in added:
                self.ctl.on_node_joined(name, "new")
        elif want < len(self.alive):
            gone, self.alive = self.alive[want:], self.alive[:want]
            self.ctl.on_allocation(self._event(EventKind.SHRUNK, gone, "trace: nodes taken back"))

    def lose_one(self) -> str:
        name = self.alive.pop()
        self.store.set_node_state(self.job_id, name, "lost", "trace: node lost")
        self.ctl.on_node_lost(name, "trace: node lost")
        return name

    def _event(self, kind: EventKind, names: list[str], reason: str) -> AllocationEvent:
        return AllocationEvent(kind=kind, job_id=self.job_id, slurm_job_id=None, reason=reason,
                               nodes=tuple(NodeAllocation(node=n, gpu_indices=tuple(range(self.per_node)), holder_job_id=n)
                                           for n in names),
                               time_s=self.clock())


def workload_of(row: TraceRow) -> StepWorkload:
    return StepWorkload(mean_response_tokens=row.mean_response_tokens, p95_response_tokens=row.p95_response_tokens,
                        compute_factor=row.compute_factor, network_factor=row.network_factor)


def cluster_of(job: SimJob, trace: Trace) -> ClusterSpec:
    # GPU ids grow with every node ever registered (ranks are kept); the truth is sized for all of them
    spec = job.spec(trace.rows[0].mean_response_tokens)
    grown = sum(max(0, b.gpus - a.gpus) for a, b in zip(trace.rows, trace.rows[1:])) + trace.rows[0].gpus
    return cluster_for(spec, frozenset({grown - 1}))
