"""Stage placements as TransitionDAGs (transitions.placement_dag), without torch: the state each placement
implies, the cluster, the units, and the checks of old against new."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.errors import SpecError
from planner.hardware import CPU
from planner.models import Head, ModelSpec
from planner.plan import Layout
from planner.workflow import Role, StageKind
from transitions.geometry import INFERENCE_KINDS, TRAINING_KINDS
from transitions.layout import StagePlacement
from transitions.placement_dag import placement_cluster, placement_dag, placement_units, unit_state
from transitions.replay import replay

TINY = ModelSpec(name="tiny", num_layers=2, hidden_size=8, num_attention_heads=4, num_kv_heads=2, head_dim=2,
                 ffn_hidden_size=24, vocab_size=11)


def _at(stage: str, gpu_sets: list[list[int]], *, tp: int = 1, training: bool = True,
        head: Head = Head.LM, model: ModelSpec = TINY) -> StagePlacement:
    return StagePlacement(model_stage=stage, model=model, head=head,
                          kinds=TRAINING_KINDS if training else INFERENCE_KINDS, layout=Layout(tp, 1),
                          gpu_sets=tuple(tuple(g) for g in gpu_sets))


@pytest.mark.parametrize(("training", "head", "role", "kind"), [
    (True, Head.LM, Role.ACTOR, StageKind.TRAINING),
    (False, Head.LM, Role.REFERENCE, StageKind.INFERENCE),
    (True, Head.VALUE, Role.CRITIC, StageKind.TRAINING),
    (False, Head.VALUE, Role.CRITIC, StageKind.INFERENCE),
])
def test_the_state_follows_the_kinds_and_the_head(training: bool, head: Head, role: Role, kind: StageKind) -> None:
    p = _at("s", [[0]], training=training, head=head)
    state = unit_state(p)
    assert (state.role, state.stage_kind, state.head, state.model) == (role, kind, head, TINY)
    assert state.kinds == (TRAINING_KINDS if training else INFERENCE_KINDS) and state.model_stage == "s"


def test_units_start_at_version_one_on_a_cpu_node_of_every_worker() -> None:
    ps = [_at("a", [[0, 1]], tp=2), _at("r", [[4]], training=False)]
    assert [u.uid for u in placement_units(ps)] == ["a@v1#0", "r@v1#0"]
    cluster = placement_cluster(ps, [_at("a", [[2, 3]], tp=2)])
    assert (cluster.num_gpus, cluster.num_nodes, cluster.device) == (5, 1, CPU)


def test_a_lost_worker_is_rebuilt_and_other_stages_or_state_are_refused() -> None:
    old = [_at("a", [[0], [1]])]
    dag = placement_dag(old, [_at("a", [[0], [2]])], lost_workers=[1])
    assert [u.uid for u in dag.lost_units] == ["a@v1#1"] and (dag.old_version, dag.new_version) == (1, 2)
    replay(dag)
    with pytest.raises(SpecError) as err:
        placement_dag(old, [_at("b", [[0]])])
    assert err.value.field == "placements" and str(err.value) == "placements: old stages ['a'] differ from new ['b']"
    with pytest.raises(SpecError) as err:
        placement_dag(old, [_at("a", [[1]], model=replace(TINY, name="tiny-b"))])
    assert str(err.value) == "a.model: a transition keeps the model, head and state kinds"
