"""Plan changes to exercise and measure transitions: hand-made PPO plans and seeded random ones.

Used by tests/transitions and bench/transition_dag.py. Random scenarios are driven by a
``random.Random`` so every case is reproducible from its seed. Pure: no torch, no I/O.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from planner.hardware import CPU, H200, IB_NDR, LOOPBACK, NVLINK4, ClusterSpec
from planner.models import ModelSpec
from planner.plan import GlobalPlan, Layout, StagePlan
from planner.workflow import ACTOR_GEN, ACTOR_TRAIN, CRITIC_INF, CRITIC_TRAIN, REF_INF, REWARD_INF, ModelStage
from transitions.emu import UnitState
from transitions.geometry import state_kinds

PPO_STAGES: tuple[ModelStage, ...] = (ACTOR_GEN, REF_INF, CRITIC_INF, REWARD_INF, ACTOR_TRAIN, CRITIC_TRAIN)


def stage_states(model: ModelSpec, stages: tuple[ModelStage, ...] = PPO_STAGES) -> dict[str, UnitState]:
    """UnitStates of model-stages that all use ``model`` (the paper's equal-size default)."""
    return {ms.name: UnitState(model_stage=ms.name, stage_kind=ms.kind, role=ms.role, model=model,
                               head=ms.role.head,
                               kinds=state_kinds(ms.kind)) for ms in stages}


def stage_plan(name: str, layout: Layout, gpus: list[int] | tuple[int, ...], dp: int) -> StagePlan:
    size = layout.size
    sets = tuple(tuple(gpus[i * size:(i + 1) * size]) for i in range(dp))
    return StagePlan(model_stage=name, layout=layout, gpu_sets=sets, micro_batch_size=1)


def h200_cluster(num_gpus: int) -> ClusterSpec:
    per_node = min(8, num_gpus)
    return ClusterSpec(device=H200, num_nodes=num_gpus // per_node, gpus_per_node=per_node,
                       intra_node_link=NVLINK4, inter_node_link=IB_NDR)


def ppo_plan(version: int, num_gpus: int, layouts: dict[str, Layout], offset: int = 0) -> GlobalPlan:
    """Every PPO model-stage over ``num_gpus`` GPUs (from ``offset``): generation on all of them,
    the three inference stages and the two training stages each splitting the pool between them."""
    pool = list(range(offset, offset + num_gpus))
    groups = {"actor-gen": [pool], "inf": [pool[i::3] for i in range(3)],
              "train": [pool[i::2] for i in range(2)]}
    stages = []
    for ms in PPO_STAGES:
        lay = layouts[ms.name]
        if ms.name == "actor-gen":
            gpus = groups["actor-gen"][0]
        elif ms.kind.value == "inference":
            gpus = sorted(groups["inf"][("ref-inf", "critic-inf", "reward-inf").index(ms.name)])
        else:
            gpus = sorted(groups["train"][("actor-train", "critic-train").index(ms.name)])
        dp = len(gpus) // lay.size
        stages.append(stage_plan(ms.name, lay, gpus, dp))
    return GlobalPlan(version=version, stages=tuple(stages))


# --- random small scenarios -----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Scenario:
    states: dict[str, UnitState]
    cluster: ClusterSpec
    old: GlobalPlan
    new: GlobalPlan
    lost_gpus: frozenset[int]


def random_model(rng: random.Random) -> ModelSpec:
    heads = rng.choice([2, 4, 6, 8])
    kv = rng.choice([d for d in range(1, heads + 1) if heads % d == 0])
    head_dim = rng.choice([1, 2])
    return ModelSpec(name=f"rand-{heads}-{kv}", num_layers=rng.randint(1, 5), hidden_size=heads * head_dim,
                     num_attention_heads=heads, num_kv_heads=kv, head_dim=head_dim,
                     ffn_hidden_size=24 * rng.randint(1, 2), vocab_size=rng.randint(5, 13),
                     tie_word_embeddings=rng.random() < 0.2)


def random_cluster(rng: random.Random) -> ClusterSpec:
    per_node = rng.choice([2, 4])
    return ClusterSpec(device=CPU, num_nodes=rng.randint(1, 3), gpus_per_node=per_node,
                       intra_node_link=NVLINK4, inter_node_link=LOOPBACK)


def random_stage_plan(rng: random.Random, name: str, model: ModelSpec, num_gpus: int,
                      max_dp: int | None = None) -> StagePlan:
    tps = [t for t in range(1, num_gpus + 1) if model.valid_tp(t)]
    tp = rng.choice(tps)
    pps = [p for p in range(1, min(model.num_layers, num_gpus // tp) + 1)]
    pp = rng.choice(pps)
    layout = Layout(tp, pp)
    dp = rng.randint(1, min(num_gpus // layout.size, max_dp or num_gpus))
    gpus = rng.sample(range(num_gpus), dp * layout.size)
    return stage_plan(name, layout, gpus, dp)


def random_scenario(rng: random.Random, max_stages: int = 4, loss_probability: float = 0.0) -> Scenario:
    """Random old/new plans of 1..max_stages model-stages of one random model on shared GPUs."""
    model = random_model(rng)
    cluster = random_cluster(rng)
    k = rng.randint(1, max_stages)
    stages = tuple(sorted(rng.sample(PPO_STAGES, k), key=PPO_STAGES.index))
    states = stage_states(model, stages)
    n = cluster.num_gpus
    old = GlobalPlan(version=1, stages=tuple(random_stage_plan(rng, ms.name, model, n) for ms in stages))
    lost: frozenset[int] = frozenset()
    if rng.random() < loss_probability:
        lost = frozenset(rng.sample(range(n), rng.randint(1, max(1, n // 4))))
    alive = [g for g in range(n) if g not in lost]
    new_stages = []
    for ms in stages:
        sp = random_stage_plan(rng, ms.name, model, len(alive))
        sets = tuple(tuple(alive[g] for g in s) for s in sp.gpu_sets)
        new_stages.append(StagePlan(model_stage=ms.name, layout=sp.layout, gpu_sets=sets, micro_batch_size=1))
    new = GlobalPlan(version=2, stages=tuple(new_stages))
    return Scenario(states=states, cluster=cluster, old=old, new=new, lost_gpus=lost)
