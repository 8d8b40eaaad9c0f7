"""planner/infeasible.py, what its other tests left open (mutation testing, tests/mutate.py --module
planner/infeasible.py: 16 of 204 mutants survived tests/planner besides the equivalents listed): the
combination bound recomputed byte for byte by a brute-force oracle (every set partition of each
stage kind, every layout) on a job whose roles have different models, each wave's worst member and
the stage named; a stage kind with no member or only sleeping members; the bounds at exactly the
device's capacity; the bounds of a model whose most sharded layout is not its smallest."""

from __future__ import annotations

import itertools
import re

from planner.hardware import H100, IB_NDR, NVLINK4, ClusterSpec, DeviceSpec
from planner.infeasible import _bounds, explain_infeasible
from planner.memory import peak_total, resident_bytes, transient_bytes
from planner.models import ModelSpec
from planner.plan import Layout
from planner.workflow import (
    ACTOR_GEN,
    ACTOR_TRAIN,
    CRITIC_INF,
    CRITIC_TRAIN,
    REF_INF,
    REWARD_INF,
    JobSpec,
    ModelStage,
    Role,
    StageKind,
    Workflow,
    Workload,
)

GB = 1e9
# the actor and reference: a large vocabulary (large logits), one KV head; the critic: more and wider
# layers, a small vocabulary (the largest resident state, little transient); the reward model between
SMALL = ModelSpec(name="small", num_layers=4, hidden_size=256, num_attention_heads=8, num_kv_heads=1, head_dim=32,
                  ffn_hidden_size=512, vocab_size=32000)
BIG = ModelSpec(name="big", num_layers=8, hidden_size=512, num_attention_heads=8, num_kv_heads=8, head_dim=64,
                ffn_hidden_size=1024, vocab_size=1000)
MID = ModelSpec(name="mid", num_layers=6, hidden_size=384, num_attention_heads=6, num_kv_heads=6, head_dim=64,
                ffn_hidden_size=768, vocab_size=2000)
MODELS = {Role.ACTOR: SMALL, Role.REFERENCE: SMALL, Role.CRITIC: BIG, Role.REWARD: MID}
WORKLOAD = Workload(prompts_per_step=8, prompt_tokens=4096, response_tokens=8192)
PPO = Workflow("ppo", (ACTOR_GEN, REF_INF, CRITIC_INF, REWARD_INF, ACTOR_TRAIN, CRITIC_TRAIN))


def _job(*stages: ModelStage, models: dict[Role, ModelSpec] = MODELS) -> JobSpec:
    wf = Workflow("w", stages)
    return JobSpec(workflow=wf, models={r: models[r] for r in wf.roles}, workload=WORKLOAD)


def _cluster(memory_bytes: int, n: int) -> ClusterSpec:
    device = DeviceSpec(name="dev", memory_bytes=memory_bytes, peak_flops_bf16=H100.peak_flops_bf16,
                        hbm_bytes_per_s=H100.hbm_bytes_per_s)
    return ClusterSpec(device=device, num_nodes=1, gpus_per_node=n, intra_node_link=NVLINK4, inter_node_link=IB_NDR)


def _layouts(model: ModelSpec, n: int) -> list[Layout]:
    """Every TP x PP a unit of at most n GPUs can have, in the order of fewer GPUs on TP first."""
    pows = [2**i for i in range(n.bit_length()) if 2**i <= n]
    return [Layout(tp, pp) for tp in pows for pp in pows
            if tp * pp <= n and pp <= model.num_layers and model.valid_tp(tp)]


def _smallest_resident(job: JobSpec, ms: ModelStage, n: int) -> tuple[int, Layout]:
    model = job.model_of(ms)
    return min(((resident_bytes(model, ms, lay).total_bytes, lay) for lay in _layouts(model, n)),
               key=lambda x: x[0])


def _smallest_transient(job: JobSpec, ms: ModelStage, n: int) -> int:
    model = job.model_of(ms)
    return min(transient_bytes(model, ms, lay, job.workload, 1, 1, ms.kind is StageKind.TRAINING).total_bytes
               for lay in _layouts(model, n))


def _set_partitions(items: list[str]) -> list[list[list[str]]]:
    """Every set partition, by labelling each item with a block number (restricted growth strings)."""
    out = []
    for labels in itertools.product(range(len(items)), repeat=len(items)):
        if all(labels[i] <= max(labels[:i], default=-1) + 1 for i in range(len(items))):
            out.append([[x for x, b in zip(items, labels) if b == k] for k in range(max(labels) + 1)])
    return out


def _oracle(job: JobSpec, n: int) -> tuple[int, list[list[str]]]:
    """(the bytes a GPU needs at least, per stage kind the waves of its best split, each described)."""
    resident, kinds = 0, []
    for kind in (StageKind.GENERATION, StageKind.INFERENCE, StageKind.TRAINING):
        members = [ms.name for ms in job.workflow.by_kind(kind)]
        if not members:
            continue
        best: tuple[int, list[str]] | None = None
        for part in _set_partitions(members):
            if any(len(wave) > n for wave in part):
                continue
            waves = []
            for wave in part:
                share = n // len(wave)
                worst = max(wave, key=lambda m: _smallest_resident(job, job.workflow.stage(m), share)[0])
                waves.append((worst, *_smallest_resident(job, job.workflow.stage(worst), share)))
            total = sum(r for _, r, _ in waves)
            if best is None or total < best[0]:
                best = (total, sorted(f"{w} {r / GB:.1f} GB ({lay})" for w, r, lay in waves))
        assert best is not None
        resident += best[0]
        kinds.append(best[1])
    transient = max(_smallest_transient(job, ms, n) for ms in job.workflow.model_stages)
    return peak_total(resident, transient), kinds


def _own(job: JobSpec, ms: ModelStage, n: int) -> int:
    model = job.model_of(ms)
    return min(peak_total(resident_bytes(model, ms, lay).total_bytes,
                          transient_bytes(model, ms, lay, job.workload, 1, 1,
                                          ms.kind is StageKind.TRAINING).total_bytes)
               for lay in _layouts(model, n))


def _combination(reason: str) -> tuple[str, list[list[str]], int]:
    m = re.fullmatch(r"(\S+): with every stage's resident state \((.*)\) a GPU needs at least ([\d.]+) GB, "
                     r"([\d.]+) GB \((\d+) bytes\) over the (\d+) GB of a dev", reason)
    assert m, reason
    return m.group(1), [sorted(k.split(" + ")) for k in m.group(2).split("; ")], int(m.group(5))


def test_the_combination_bound_is_every_kinds_best_split_byte_for_byte() -> None:
    job = _job(*PPO.model_stages)
    for n in (2, 4):
        need, kinds = _oracle(job, n)
        assert all(_own(job, ms, n) < need for ms in job.workflow.model_stages)
        [reason] = explain_infeasible(job, _cluster(need - 3, n), n).reasons
        name, described, over = _combination(reason)
        assert (described, over) == (kinds, 3), n
        # named: the stage of the largest resident bound (the critic's training), not of the largest transient
        residents = {ms.name: _smallest_resident(job, ms, n)[0] for ms in job.workflow.model_stages}
        transients = {ms.name: _smallest_transient(job, ms, n) for ms in job.workflow.model_stages}
        assert name == max(residents, key=lambda k: residents[k]) == "critic-train"
        assert max(transients, key=lambda k: transients[k]) != name
    # on 2 GPUs the three inference stages cannot share one wave: the split takes two waves or three
    assert len(_oracle(job, 2)[1][1]) > 1


def test_a_wave_is_priced_by_its_largest_resident_member_not_its_largest_transient() -> None:
    # one layer and three heads: neither TP nor PP shards them, so one wave of both (each on one GPU)
    # beats two waves; the reference's logits make its transient the larger, the critic's width its state
    unsharded = {"num_layers": 1, "num_attention_heads": 3, "num_kv_heads": 3, "head_dim": 32}
    models = {Role.REFERENCE: ModelSpec(name="ref", hidden_size=96, ffn_hidden_size=256, vocab_size=32000, **unsharded),
              Role.CRITIC: ModelSpec(name="critic", hidden_size=1024, ffn_hidden_size=4096, vocab_size=1000,
                                     **unsharded)}
    job = _job(REF_INF, CRITIC_INF, models=models)
    one = _smallest_resident(job, CRITIC_INF, 1)[0]
    assert _smallest_transient(job, REF_INF, 1) > _smallest_transient(job, CRITIC_INF, 1)
    assert one > _smallest_resident(job, REF_INF, 1)[0]
    need, kinds = _oracle(job, 2)
    [reason] = explain_infeasible(job, _cluster(need - 1, 2), 2).reasons
    assert _combination(reason)[1:] == (kinds, 1)
    assert kinds == [[f"critic-inf {one / GB:.1f} GB (TP1xPP1)"]]  # one wave of both, one GPU each


def test_a_job_without_a_stage_kind_still_counts_the_kinds_after_it() -> None:
    job = _job(ACTOR_GEN, ACTOR_TRAIN)  # no inference stage
    need, kinds = _oracle(job, 2)
    [reason] = explain_infeasible(job, _cluster(need - 1, 2), 2).reasons
    assert _combination(reason)[1:] == (kinds, 1) and len(kinds) == 2


def test_sleeping_stages_add_no_resident_bytes() -> None:
    ref_sleeps = ModelStage("ref-inf", Role.REFERENCE, StageKind.INFERENCE, sleeps=True)
    job = _job(ACTOR_GEN, ref_sleeps, ACTOR_TRAIN)
    need, kinds = _oracle(job, 2)
    assert kinds[1] == ["ref-inf 0.0 GB (TP1xPP1)"]  # the first layout of the tie: the least sharded
    [reason] = explain_infeasible(job, _cluster(need - 1, 2), 2).reasons
    assert _combination(reason)[1:] == (kinds, 1)
    assert _bounds(job, ref_sleeps, 4)[1:] == (0, _smallest_transient(job, ref_sleeps, 4), Layout(1, 1))


def test_a_bound_of_exactly_the_capacity_fits() -> None:
    job = _job(*PPO.model_stages)
    own = {ms.name: _own(job, ms, 2) for ms in job.workflow.model_stages}
    largest = max(own.values())
    [reason] = explain_infeasible(job, _cluster(largest, 2), 2).reasons
    assert reason.startswith("critic-train: with every stage's resident state"), reason  # none over alone
    [reason] = explain_infeasible(job, _cluster(largest - 1, 2), 2).reasons
    assert reason.startswith(f"{max(own, key=lambda k: own[k])}: needs at least ")
    need, _ = _oracle(job, 2)
    [reason] = explain_infeasible(job, _cluster(need, 2), 2).reasons
    assert reason == (f"the model-stages' resident state and GPU budgets do not combine on 2 GPUs of "
                      f"{need / GB:.0f} GB (lower bound {need / GB:.1f} GB per GPU)")


def test_the_capacity_is_said_in_gigabytes_of_a_billion_bytes() -> None:
    # 81.500000001 GB rounds up to 82; in GB of 1e9 + 1 bytes it would be 81.49999992 and round down
    [reason] = explain_infeasible(_job(ACTOR_GEN, ACTOR_TRAIN), _cluster(81_500_000_001, 2), 2).reasons
    assert reason.startswith("the model-stages' resident state and GPU budgets do not combine on 2 GPUs of 82 GB ")


def test_bounds_when_the_most_sharded_layout_is_not_the_smallest() -> None:
    # one KV head: past TP 1 the KV cache is replicated, so TP8xPP1 (the last layout tried) holds 8x the
    # KV of TP1xPP8; generation's transient (and own peak) is smallest on PP
    model = ModelSpec(name="kv1", num_layers=8, hidden_size=256, num_attention_heads=8, num_kv_heads=1,
                      head_dim=32, ffn_hidden_size=512, vocab_size=1000)
    job = JobSpec(workflow=Workflow("w", (ACTOR_GEN, ACTOR_TRAIN)), models={Role.ACTOR: model}, workload=WORKLOAD)
    for ms in job.workflow.model_stages:
        own, res, trans, layout = _bounds(job, ms, 8)
        assert (own, res, trans) == (_own(job, ms, 8), _smallest_resident(job, ms, 8)[0],
                                     _smallest_transient(job, ms, 8)), ms.name
        assert layout == _smallest_resident(job, ms, 8)[1]
    last = transient_bytes(model, ACTOR_GEN, Layout(8, 1), WORKLOAD, 1, 1, False).total_bytes
    assert _bounds(job, ACTOR_GEN, 8)[2] < last


def test_training_bounds_keep_one_micro_batch_in_flight() -> None:
    # three heads: TP 1 only, so the training transient is smallest on the most PP stages, where a
    # second micro-batch in flight would double the kept activations
    model = ModelSpec(name="h3", num_layers=8, hidden_size=192, num_attention_heads=3, num_kv_heads=3,
                      head_dim=64, ffn_hidden_size=512, vocab_size=1000)
    job = JobSpec(workflow=Workflow("w", (ACTOR_TRAIN,)), models={Role.ACTOR: model}, workload=WORKLOAD)
    _, _, trans, _ = _bounds(job, ACTOR_TRAIN, 4)
    assert trans == transient_bytes(model, ACTOR_TRAIN, Layout(1, 4), WORKLOAD, 1, 1, True).total_bytes
    assert trans < transient_bytes(model, ACTOR_TRAIN, Layout(1, 4), WORKLOAD, 1, 2, True).total_bytes
