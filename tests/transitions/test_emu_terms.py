"""transitions.emu by hand: T_sub, split factors, strided part GPUs, box algebra, EMU validation,
per-GPU shards/boxes/bytes (a micro model whose byte counts are summed by hand) and parts_nest."""

from __future__ import annotations

import pytest

from planner.errors import SpecError
from planner.models import Head, ModelSpec
from planner.plan import Layout
from planner.workflow import JobSpec, Role, StageKind, Workload, workflow_preset
from transitions import emu, geometry
from transitions.emu import (
    EMU,
    UnitState,
    box_contains,
    box_intersection,
    job_states,
    part_gpus,
    part_indices,
    parts_nest,
    split_factors,
    t_sub,
)
from transitions.geometry import StateKind

# hidden 2, 2 heads of dim 1, ffn 2, vocab 4: a layer is 2+4+4+4+4+2+4+4+4 = 32 params, embed 8,
# norm 2, lm_head 8. PP2: stage 0 = embed + layer 0 = 40 params, stage 1 = layer 1 + norm + head = 42.
MICRO = ModelSpec(name="micro", num_layers=2, hidden_size=2, num_attention_heads=2, num_kv_heads=2,
                  head_dim=1, ffn_hidden_size=2, vocab_size=4)
PARAMS = UnitState(model_stage="gen", stage_kind=StageKind.GENERATION, role=Role.ACTOR, model=MICRO,
                   head=Head.LM, kinds=(StateKind.PARAM,))
# vocab 10 splits (0,5),(5,5) over TP2 but (0,3),(3,3),(6,3),(9,1) over TP4: rows 3..5 straddle
ODD = ModelSpec(name="odd", num_layers=6, hidden_size=4, num_attention_heads=4, num_kv_heads=4,
                head_dim=1, ffn_hidden_size=4, vocab_size=10)
ODD_STATE = UnitState(model_stage="gen", stage_kind=StageKind.GENERATION, role=Role.ACTOR, model=ODD,
                      head=Head.LM, kinds=(StateKind.PARAM,))


@pytest.fixture(autouse=True)
def _cold_caches() -> None:
    for f in (emu.rank_shards, emu.rank_boxes, geometry.layout_rank_bytes, emu.parts_nest):
        f.cache_clear()


def test_t_sub_is_gcd_per_axis() -> None:
    assert t_sub(Layout(4, 6), Layout(6, 4)) == Layout(2, 2)
    assert t_sub(Layout(3, 1), Layout(2, 5)) == Layout(1, 1)


def test_unit_state_must_hold_params() -> None:
    for kinds in ((), (StateKind.MASTER,)):
        with pytest.raises(SpecError) as e:
            UnitState(model_stage="t", stage_kind=StageKind.TRAINING, role=Role.ACTOR, model=MICRO,
                      head=Head.LM, kinds=kinds)
        assert e.value.field == "t.kinds"
        assert e.value.allowed == "param, master, exp_avg, exp_avg_sq, grad"
        assert str(e.value).startswith(f"t.kinds: must include param, got {kinds} (allowed")
    assert PARAMS.stage_order == 0
    ok = UnitState(model_stage="t", stage_kind=StageKind.TRAINING, role=Role.ACTOR, model=MICRO,
                   head=Head.LM, kinds=(StateKind.MASTER, StateKind.PARAM))
    assert ok.stage_order == 2


def test_emu_validation_errors_name_the_field() -> None:
    with pytest.raises(SpecError) as e:
        EMU(uid="u", state=PARAMS, layout=Layout(1, 2), gpus=(0,), version=0)
    assert (e.value.field, e.value.allowed) == ("u.gpus", "exactly 2")
    assert str(e.value) == "u.gpus: 1 GPUs for layout TP1xPP2 (allowed: exactly 2)"
    with pytest.raises(SpecError) as e:
        EMU(uid="u", state=PARAMS, layout=Layout(1, 2), gpus=(3, 3), version=0)
    assert str(e.value) == "u.gpus: repeats a GPU: (3, 3)" and e.value.allowed is None
    final = EMU(uid="f", state=PARAMS, layout=Layout(1, 2), gpus=(4, 5), version=0)
    with pytest.raises(SpecError) as e:
        EMU(uid="p", state=PARAMS, layout=Layout(1, 2), gpus=(4, 6), version=0, final=final)
    assert str(e.value) == "p.final: a part must sit on GPUs of the unit it merges into"
    # a part on exactly its final unit's GPUs (not a strict subset) is fine
    same = EMU(uid="p", state=PARAMS, layout=Layout(1, 2), gpus=(5, 4), version=0, final=final)
    assert same.final is final


def test_per_gpu_shards_boxes_and_bytes() -> None:
    u = EMU(uid="u", state=PARAMS, layout=Layout(1, 2), gpus=(7, 3), version=2)
    assert u.model_stage == "gen"
    assert (u.rank_of(7), u.rank_of(3)) == (0, 1)
    assert u.holds(3) and not u.holds(0)
    assert (u.bytes_on(7), u.bytes_on(3), u.bytes_on(0)) == (80, 84, 0)
    assert u.total_bytes() == 164
    assert u.shards(0) == () and u.boxes(0) == {}
    names3 = [s.tensor for s in u.shards(3)]
    assert names3[0] == "model.layers.1.input_layernorm.weight" and names3[-1] == "lm_head.weight"
    assert len(names3) == 11
    assert u.boxes(7)[("model.embed_tokens.weight", StateKind.PARAM)] == ((0, 0), (4, 2))
    assert u.boxes(3)[("lm_head.weight", StateKind.PARAM)] == ((0, 0), (4, 2))
    assert ("lm_head.weight", StateKind.PARAM) not in u.boxes(7)
    assert emu.rank_bytes(PARAMS, Layout(1, 2)) == (80, 84)
    assert u.describe() == {"uid": "u", "model_stage": "gen", "tp": 1, "pp": 2, "gpus": [7, 3],
                            "version": 2}
    # a part reports what its final unit holds on each GPU, whatever its own layout
    final = EMU(uid="f", state=PARAMS, layout=Layout(1, 2), gpus=(3, 7), version=2)
    part = EMU(uid="p", state=PARAMS, layout=Layout(1, 1), gpus=(7,), version=2, final=final)
    assert part.bytes_on(7) == 84 and part.total_bytes() == 84 and part.bytes_on(3) == 0
    assert part.shards(7) == final.shards(7) and part.shards(3) == ()
    assert part.boxes(7) == final.boxes(7) and part.boxes(3) == {}
    assert part.describe()["final"] == "f"


def test_rank_bytes_are_each_ranks_shard_bytes() -> None:
    training = UnitState(model_stage="train", stage_kind=StageKind.TRAINING, role=Role.ACTOR, model=MICRO,
                         head=Head.LM, kinds=(StateKind.PARAM, StateKind.MASTER, StateKind.EXP_AVG,
                                              StateKind.EXP_AVG_SQ, StateKind.GRAD))
    assert emu.rank_bytes(training, Layout(1, 2)) != emu.rank_bytes(PARAMS, Layout(1, 2))  # every kind counted
    for state in (PARAMS, ODD_STATE, training):
        for layout in (Layout(1, 1), Layout(1, 2), Layout(2, 1), Layout(1, 3)):
            try:
                want = tuple(sum(s.num_bytes for s in emu.rank_shards(state, layout, r)) for r in range(layout.size))
            except SpecError:
                with pytest.raises(SpecError):
                    emu.rank_bytes(state, layout)
                continue
            assert emu.rank_bytes(state, layout) == want


def test_split_factors_and_part_placement() -> None:
    assert split_factors(Layout(4, 6), Layout(2, 3)) == (2, 2)
    for sub in (Layout(3, 3), Layout(2, 4), Layout(3, 4)):
        with pytest.raises(SpecError) as e:
            split_factors(Layout(4, 6), sub)
        assert str(e.value) == f"layout: TP4xPP6 does not split into {sub}"
    assert part_indices(Layout(4, 2), Layout(2, 1)) == [(0, 0), (1, 0), (0, 1), (1, 1)]
    # TP4xPP2 on GPUs 10..17 (rank = pp*4 + tp); sub TP2xPP1, k = (2, 2): part (a, b) takes tp ranks
    # a, a+2 on stage b
    gpus = tuple(range(10, 18))
    assert part_gpus(Layout(4, 2), gpus, Layout(2, 1), 0, 0) == (10, 12)
    assert part_gpus(Layout(4, 2), gpus, Layout(2, 1), 1, 0) == (11, 13)
    assert part_gpus(Layout(4, 2), gpus, Layout(2, 1), 1, 1) == (15, 17)
    # TP1xPP4 into PP2, k_pp = 2: part b has stages b, b+2
    assert part_gpus(Layout(1, 4), (20, 21, 22, 23), Layout(1, 2), 0, 1) == (21, 23)


def test_box_algebra() -> None:
    x = ((0, 2), (4, 3))  # rows 0..3, cols 2..4
    assert box_intersection(x, ((2, 0), (5, 4))) == ((2, 2), (2, 2))
    assert box_intersection(x, ((4, 2), (1, 1))) is None  # touches at row 4 only
    assert box_intersection(x, ((0, 5), (4, 1))) is None
    assert box_contains(x, x)
    assert box_contains(x, ((1, 3), (3, 2)))
    assert not box_contains(x, ((1, 3), (4, 1)))  # rows 1..4 overrun by one
    assert not box_contains(x, ((0, 1), (1, 1)))  # col 1 left of col 2
    assert not box_contains(x, ((0, 4), (1, 2)))  # cols 4..5
    assert not box_contains(((0,), (3,)), ((2,), (2,)))


def test_parts_nest() -> None:
    assert parts_nest(PARAMS, Layout(1, 1), Layout(2, 2))
    assert parts_nest(ODD_STATE, Layout(1, 3), Layout(1, 6))
    assert not parts_nest(ODD_STATE, Layout(2, 1), Layout(4, 1))  # vocab rows 3..5 straddle
    # layers over PP2 (0,0,0,1,1,1) and PP4 (0,0,1,1,2,3): final stage 1 holds layer 3 of sub stage 1
    assert not parts_nest(ODD_STATE, Layout(1, 2), Layout(1, 4))
    assert parts_nest(ODD_STATE, Layout(2, 3), Layout(2, 3))


def test_job_states_one_per_model_stage() -> None:
    critic = ModelSpec(name="critic", num_layers=2, hidden_size=2, num_attention_heads=2, num_kv_heads=2,
                       head_dim=1, ffn_hidden_size=2, vocab_size=6)
    job = JobSpec(workflow=workflow_preset("grpo", learned_reward=True),
                  models={Role.ACTOR: MICRO, Role.REFERENCE: MICRO, Role.REWARD: critic},
                  workload=Workload(prompts_per_step=1, prompt_tokens=1, response_tokens=1))
    states = job_states(job)
    assert list(states) == ["actor-gen", "ref-inf", "reward-inf", "actor-train"]
    train = states["actor-train"]
    assert (train.model_stage, train.stage_kind, train.role, train.head) == (
        "actor-train", StageKind.TRAINING, Role.ACTOR, Head.LM)
    assert train.model is MICRO
    assert train.kinds == (StateKind.PARAM, StateKind.MASTER, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ)
    reward = states["reward-inf"]
    assert (reward.model, reward.head, reward.kinds, reward.stage_kind) == (
        critic, Head.VALUE, (StateKind.PARAM,), StageKind.INFERENCE)
    assert job_states(job, keep_grads=True)["actor-train"].kinds[-1] is StateKind.GRAD
    assert job_states(job, True)["actor-gen"].kinds == (StateKind.PARAM,)
