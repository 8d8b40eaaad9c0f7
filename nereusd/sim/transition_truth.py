"""The simulator's ground truth of the state's cost: how long a transition DAG really takes, and what the
checkpoint/restart baseline pays on a pool change. Like truth.py, it reads no planner cost model."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from planner.hardware import ClusterSpec
from planner.workflow import JobSpec, StageKind


@dataclass(frozen=True, kw_only=True, slots=True)
class TransitionTruth:
    """How long a transition DAG really takes (its store summary: primitives, bytes, data edges).

    Sources: NCCL communicator creation ~0.5-2 s at hundreds of ranks (NCCL issue tracker, ncclCommInitRank
    timings); a new torch.distributed generation (TCPStore rendezvous + barrier) ~1 s; point-to-point
    transfers reach ~70% of the link (nccl-tests sendrecv), and concurrent transfers share the inter-node
    fabric (contention: aggregate bandwidth of the nodes involved).
    """

    generation_setup_s: float = 1.0
    setup_per_gpu_s: float = 2e-3
    per_primitive_s: float = 0.15
    link_efficiency: float = 0.7
    extra: dict[str, float] = field(default_factory=dict)

    def seconds(self, dag: dict[str, Any], cluster: ClusterSpec, gpus_involved: int, nf: float = 1.0) -> float:
        nodes = dag.get("nodes") or []
        if not nodes:
            return self.generation_setup_s if dag.get("kind") == "transition" else 0.0
        bw = cluster.inter_node_link.bytes_per_s * self.link_efficiency * nf
        # critical path over data edges, each primitive its fixed cost + its bytes at one link
        own = [self.per_primitive_s + float(n.get("bytes_moved", 0)) / bw for n in nodes]
        preds: dict[int, list[int]] = {}
        for a, b in dag.get("data_edges") or []:
            preds.setdefault(int(b), []).append(int(a))
        finish: dict[int, float] = {}
        for i in dag.get("order") or range(len(nodes)):
            finish[i] = own[i] + max((finish.get(p, 0.0) for p in preds.get(i, [])), default=0.0)
        path = max(finish.values(), default=0.0)
        total = sum(float(n.get("bytes_moved", 0)) for n in nodes)
        nodes_involved = max(1, math.ceil(gpus_involved / cluster.gpus_per_node))
        contention = total / (bw * nodes_involved)
        return self.generation_setup_s + self.setup_per_gpu_s * gpus_involved + max(path, contention)


def restart_seconds(job: JobSpec, cluster: ClusterSpec, num_gpus: int) -> float:
    """Checkpoint/restart on a pool change (the baseline): save and load every model's state through the
    parallel file system, plus relaunch (scheduler, process start, vLLM and NCCL initialisation).

    Sources: Lustre/GPFS ~1-2 GB/s per client node, ~10 GB/s per job at small scale (we use 1 GB/s per
    node, capped at 20 GB/s); relaunch of an RL job (Ray + vLLM engine start + model load) 3-6 minutes
    as users of verl/OpenRLHF report (we use 240 s).
    """
    state = 0.0
    for role in job.workflow.roles:
        ms_kinds = {ms.kind for ms in job.workflow.model_stages if ms.role is role}
        per = 16 if StageKind.TRAINING in ms_kinds else 2
        state += per * job.models[role].num_params(role.head)
    nodes = max(1, num_gpus // cluster.gpus_per_node)
    fs = min(1e9 * nodes, 20e9)
    return 240.0 + 2 * state / fs
