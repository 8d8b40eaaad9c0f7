"""A GRPO run with a different layout per model-stage on 2 real ranks (actor-gen TP2, ref-inf and
actor-train PP2, so the per-step weight sync reshards PP -> TP) samples exactly the tokens of a
single-process run, sends exactly the executor plan's bytes in each weight sync, and reports per-stage
measurements by op class that the calibrator accepts."""

from __future__ import annotations

import pytest
import torch
from engine_dist import run_workers

from agent.engine.grpo import GRPOConfig
from agent.engine.loop import RLLoop, RunConfig, uniform_plan
from agent.engine.sync import PARAMS, plan_placement, sync_plan
from agent.engine.tasks import SortDigits
from planner.calibration import Calibrator
from planner.cost import OpClass
from planner.hardware import CPU, LOOPBACK
from planner.models import Head
from planner.plan import GlobalPlan, Layout, StagePlan

CFG = RunConfig(algo="grpo", task=SortDigits(num_digits=3), prompts_per_step=4, grpo=GRPOConfig(samples_per_prompt=4),
                train_mini_batches_per_step=2, seed=5, profile_ops=True)
PLAN = GlobalPlan(version=0, stages=(
    StagePlan(model_stage="actor-gen", layout=Layout(2, 1), gpu_sets=((0, 1),), micro_batch_size=16),
    StagePlan(model_stage="ref-inf", layout=Layout(1, 2), gpu_sets=((0, 1),), micro_batch_size=8),
    StagePlan(model_stage="actor-train", layout=Layout(1, 2), gpu_sets=((0, 1),), micro_batch_size=4, grad_accum=2),
))


def worker(rank: int, world: int) -> dict[str, object]:
    loop = RLLoop(CFG, PLAN, rank=rank)
    runs = [loop.step(s) for s in range(2)]
    meas = loop.measurements(1)
    classes = {name: {o.op_class.value: o.work for o in m.ops} for name, m in meas.items()}
    records = [r for m in meas.values() for r in m.calibration_records(CPU, LOOPBACK)]
    eff = Calibrator().observe(records).efficiencies()
    return {"tokens": [r.tokens for r in runs], "classes": classes, "n_records": len(records),
            "gemm_eff": eff[OpClass.GEMM], "tokens_measured": meas["actor-gen"].tokens,
            "sync_sent": [r.sync_sent_bytes for r in runs], "sync_predicted_s": runs[-1].sync_predicted_s}


@pytest.mark.multiprocess
def test_mixed_layouts_match_single_process_and_measure_op_classes() -> None:
    torch.manual_seed(0)
    ref = RLLoop(CFG, uniform_plan(CFG, Layout(1, 1), (0,)))
    ref_runs = [ref.step(s) for s in range(2)]
    ref_tokens = [r.tokens for r in ref_runs]
    assert all(r.sync_sent_bytes == 0 for r in ref_runs)  # one process: every piece is local
    results = run_workers(worker, 2)
    # the weight sync is the executor's plan from actor-train (PP2) to actor-gen (TP2), to the byte
    sync = sync_plan((plan_placement(CFG.model, Head.LM, PLAN.stage("actor-train"), "actor-gen", PARAMS),),
                     (plan_placement(CFG.model, Head.LM, PLAN.stage("actor-gen"), "actor-gen", PARAMS),))
    assert sync.plan_bytes > 0
    for step in range(2):
        assert sum(r["sync_sent"][step] for r in results) == sync.plan_bytes
    assert results[0]["sync_predicted_s"] == sync.predicted_s
    for r in results:
        for got, want in zip(r["tokens"], ref_tokens):
            assert torch.equal(got, want)
    c = results[0]["classes"]
    assert c["actor-gen"]["gemm"] > 0 and c["actor-gen"]["attention_decode"] > 0
    assert c["actor-gen"]["tp_allreduce_intra"] > 0  # row-parallel outputs are all-reduced
    assert c["ref-inf"]["attention_prefill"] > 0 and c["ref-inf"]["pp_send_intra"] > 0
    assert c["actor-train"]["gemm"] > c["ref-inf"]["gemm"]  # backward adds ~2x the forward GEMMs
    assert results[0]["n_records"] >= 6
    assert 0 < results[0]["gemm_eff"] <= 1.5
    assert results[0]["tokens_measured"] == int(ref_tokens[1].ne(256).sum())
