"""uncovered_state (transitions.survival) without processes: what no surviving unit share covers, per
model-stage, on real units (tests/transitions/test_restore_dag_plan's fixture); values by hand."""

from __future__ import annotations

from test_restore_dag_plan import TINY, _at

from planner.models import Head
from planner.plan import Layout
from transitions.dag_record import DagBody, TransitionDAG
from transitions.emu import EMU
from transitions.geometry import INFERENCE_KINDS
from transitions.layout import StagePlacement
from transitions.placement_dag import placement_units
from transitions.primitives import Extend, Primitive
from transitions.survival import _covers, uncovered_state

# every tensor of TINY (2 layers), as the geometry names them
LAYER = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
TENSORS = ("model.embed_tokens.weight", *(f"model.layers.{i}.{n}.weight" for i in (0, 1) for n in LAYER),
           "model.norm.weight", "lm_head.weight")


def _dag(old: list[EMU], *, new: tuple[EMU, ...] = (), nodes: tuple[Primitive, ...] = (),
         renamed: tuple[tuple[str, str], ...] = ()) -> TransitionDAG:
    body = DagBody(nodes=nodes, stage_order=tuple(0 for _ in nodes), data_edges=(), resource_edges=(),
                   order=tuple(range(len(nodes))), old_units=tuple(old), lost_units=(), new_units=new,
                   renamed=renamed, stale_units=(), peak_bytes={}, footprints=(), gpu_nodes={})
    return TransitionDAG(old_version=1, new_version=2, capacity_bytes=0, body_=body)


def _gen(gpu_sets: list[list[int]], tp: int, stage: str = "gen") -> list[EMU]:
    return placement_units([_at(stage, gpu_sets, tp=tp, training=False)], version=1)


def test_every_unit_held_loses_nothing() -> None:
    units = _gen([[0, 1], [2, 3]], 2)
    held = {0: {units[0].uid}, 1: {units[0].uid}, 2: {units[1].uid}, 3: {units[1].uid}}
    assert uncovered_state(_dag(units), held) == {}


def test_nothing_held_loses_every_tensor_sorted() -> None:
    units = _gen([[0, 1]], 2)
    assert uncovered_state(_dag(units), {}) == {"gen": sorted(f"{t}/param" for t in TENSORS)}


SPLIT = sorted(t for t in TENSORS if "norm" not in t)  # what TP=2 splits; the norms are replicated
NORMS = sorted(t for t in TENSORS if "norm" in t)


def test_one_rank_of_a_tp_pair_keeps_only_the_replicated_norms() -> None:
    units = _gen([[0, 1]], 2)
    assert len(NORMS) == 5 and len(SPLIT) == 16
    assert uncovered_state(_dag(units), {0: {units[0].uid}}) == {"gen": [f"{t}/param" for t in SPLIT]}
    assert uncovered_state(_dag(units), {1: {units[0].uid}}) == {"gen": [f"{t}/param" for t in SPLIT]}


def test_the_two_ranks_of_different_replicas_cover_together() -> None:
    # rank 0 of replica 0 (GPU 0) and rank 1 of replica 1 (GPU 3) hold the two halves of every split tensor
    units = _gen([[0, 1], [2, 3]], 2)
    assert uncovered_state(_dag(units), {0: {units[0].uid}, 3: {units[1].uid}}) == {}
    # two rank-0 halves cover nothing split
    lost = uncovered_state(_dag(units), {0: {units[0].uid}, 2: {units[1].uid}})
    assert lost == {"gen": [f"{t}/param" for t in SPLIT]}


def test_a_uid_claimed_on_a_gpu_outside_the_unit_or_unknown_counts_for_nothing() -> None:
    units = _gen([[0, 1]], 2)
    everything = {"gen": sorted(f"{t}/param" for t in TENSORS)}
    assert uncovered_state(_dag(units), {2: {units[0].uid}, 3: {units[0].uid}}) == everything
    assert uncovered_state(_dag(units), {0: {"nobody"}, 1: {"nobody"}}) == everything
    # a worker naming a foreign uid besides its own still counts its own
    assert uncovered_state(_dag(units), {0: {"nobody", units[0].uid}, 1: {units[0].uid}}) == {}


def test_training_kinds_are_reported_per_kind_and_stages_apart() -> None:
    train = placement_units([_at("train", [[0, 1]], tp=2)], version=1)
    gen = _gen([[2]], 1)
    dag = _dag([*train, *gen])
    kinds = ("param", "master", "exp_avg", "exp_avg_sq")
    assert uncovered_state(dag, {2: {gen[0].uid}}) == {"train": sorted(f"{t}/{k}" for t in TENSORS for k in kinds)}
    assert uncovered_state(dag, {0: {train[0].uid}, 1: {train[0].uid}}) == {
        "gen": sorted(f"{t}/param" for t in TENSORS)}
    # GPU 1 alone: the train norms survive in every kind, the gen unit's params do not
    assert uncovered_state(dag, {1: {train[0].uid}}) == {
        "train": sorted(f"{t}/{k}" for t in SPLIT for k in kinds), "gen": sorted(f"{t}/param" for t in TENSORS)}


def test_a_gen_copy_does_not_cover_the_optimizer_state_of_train() -> None:
    # a TP=1 gen unit holds every param of the same model whole, but is another model-stage
    train = placement_units([_at("train", [[0, 1]], tp=2)], version=1)
    gen = _gen([[2]], 1)
    lost = uncovered_state(_dag([*train, *gen]), {2: {gen[0].uid}, 1: {train[0].uid}})
    assert lost == {"train": sorted(f"{t}/{k}" for t in SPLIT for k in ("param", "master", "exp_avg", "exp_avg_sq"))}


def test_only_the_old_units_say_what_must_survive() -> None:
    old = _gen([[0, 1]], 2)
    new = placement_units([_at("fresh", [[4]], training=False)], version=2)
    # the new stage's state is not asked for; a new unit of the old stage covers it
    assert uncovered_state(_dag(old, new=tuple(new)), {}) == {"gen": sorted(f"{t}/param" for t in TENSORS)}
    copy = _gen([[5]], 1, stage="gen")
    copy = [EMU(uid="gen@v2#9", state=copy[0].state, layout=copy[0].layout, gpus=(5,), version=2)]
    assert copy[0].state == old[0].state
    assert uncovered_state(_dag(old, new=tuple(copy)), {5: {"gen@v2#9"}}) == {}


def _pp_units() -> list[EMU]:
    return placement_units([StagePlacement(model_stage="gen", model=TINY, head=Head.LM, kinds=INFERENCE_KINDS,
                                           layout=Layout(1, 2), gpu_sets=((0, 1),))], version=1)


def test_pipeline_stages_each_name_their_own_tensors() -> None:
    units = _pp_units()
    first = ["model.embed_tokens.weight", *(f"model.layers.0.{n}.weight" for n in LAYER)]
    second = [*(f"model.layers.1.{n}.weight" for n in LAYER), "model.norm.weight", "lm_head.weight"]
    assert sorted(first + second) == sorted(TENSORS)
    assert uncovered_state(_dag(units), {}) == {"gen": sorted(f"{t}/param" for t in TENSORS)}
    assert uncovered_state(_dag(units), {0: {units[0].uid}}) == {"gen": sorted(f"{t}/param" for t in second)}
    assert uncovered_state(_dag(units), {1: {units[0].uid}}) == {"gen": sorted(f"{t}/param" for t in first)}


def _moved(unit: EMU, uid: str, gpus: tuple[int, ...]) -> EMU:
    return EMU(uid=uid, state=unit.state, layout=unit.layout, gpus=gpus, version=unit.version)


def test_units_named_only_by_a_node_source_or_target_count() -> None:
    old = _gen([[0, 1]], 2)
    src = _moved(old[0], "src", (4, 5))
    tgt = _moved(old[0], "tgt", (6, 7))
    dag = _dag(old, nodes=(Extend(sources=(src,), target=tgt),))
    assert uncovered_state(dag, {4: {"src"}, 5: {"src"}}) == {}
    assert uncovered_state(dag, {6: {"tgt"}, 7: {"tgt"}}) == {}
    assert uncovered_state(dag, {6: {"tgt"}}) == {"gen": [f"{t}/param" for t in SPLIT]}


def test_a_node_unit_does_not_override_the_old_unit_of_the_same_uid() -> None:
    old = _gen([[0, 1]], 2)
    ghost = _moved(old[0], old[0].uid, (2, 3))
    dag = _dag(old, nodes=(Extend(sources=(ghost,), target=_moved(old[0], "t", (4, 5))),))
    everything = {"gen": sorted(f"{t}/param" for t in TENSORS)}
    assert uncovered_state(dag, {2: {old[0].uid}, 3: {old[0].uid}}) == everything
    assert uncovered_state(dag, {0: {old[0].uid}, 1: {old[0].uid}}) == {}


def test_a_renamed_unit_is_found_under_its_new_uid() -> None:
    old = _gen([[0, 1]], 2)
    dag = _dag(old, renamed=((old[0].uid, "gen@v2#0"),))
    assert uncovered_state(dag, {0: {"gen@v2#0"}, 1: {"gen@v2#0"}}) == {}
    # a rename from a uid the DAG does not know adds nothing (and does not fail)
    dag = _dag(old, renamed=(("gone", "gen@v2#0"),))
    assert uncovered_state(dag, {0: {"gen@v2#0"}, 1: {"gen@v2#0"}}) == {"gen": sorted(f"{t}/param" for t in TENSORS)}


def test_a_rename_onto_a_uid_the_dag_has_keeps_that_unit() -> None:
    old = _gen([[0, 1]], 2)
    new = _moved(old[0], "gen@v2#0", (2, 3))
    dag = _dag(old, new=(new,), renamed=((old[0].uid, "gen@v2#0"),))
    assert uncovered_state(dag, {2: {"gen@v2#0"}, 3: {"gen@v2#0"}}) == {}
    assert uncovered_state(dag, {0: {"gen@v2#0"}, 1: {"gen@v2#0"}}) == {"gen": sorted(f"{t}/param" for t in TENSORS)}


# --- _covers on hand-made boxes -------------------------------------------------------------------


def test_spans_along_one_dim_cover_when_they_chain_from_zero_to_the_end() -> None:
    assert _covers((10,), [((0,), (4,)), ((4,), (6,))])
    assert _covers((10,), [((4,), (6,)), ((0,), (4,))])  # any order
    assert _covers((10,), [((0,), (6,)), ((3,), (7,))])  # overlapping
    assert _covers((10,), [((0,), (8,)), ((2,), (3,)), ((7,), (3,))])  # a nested span does not pull reach back
    assert _covers((10,), [((0,), (10,))])
    assert not _covers((10,), [((0,), (4,)), ((5,), (5,))])  # a gap at 4
    assert not _covers((10,), [((1,), (9,))])  # nothing at 0
    assert not _covers((10,), [((0,), (9,))])  # one short of the end
    assert not _covers((10,), [])


def test_in_two_dims_only_boxes_whole_along_the_other_dim_join_a_span() -> None:
    assert _covers((4, 6), [((0, 0), (4, 3)), ((0, 3), (4, 3))])  # column halves
    assert _covers((4, 6), [((0, 0), (2, 6)), ((2, 0), (2, 6))])  # row halves
    assert not _covers((4, 6), [((0, 0), (4, 3)), ((0, 3), (3, 3))])  # one half short in rows
    assert not _covers((4, 6), [((0, 0), (4, 3)), ((1, 3), (4, 3))])  # one half offset in rows
    assert not _covers((4, 6), [((0, 0), (2, 3)), ((2, 0), (2, 3)), ((0, 3), (4, 3))])  # quarters are not joined
    assert not _covers((4, 6), [((0, 0), (4, 3)), ((0, 0), (2, 6))])
    # a gap along rows does not stop the columns from covering
    assert _covers((4, 6), [((1, 0), (3, 6)), ((0, 0), (4, 3)), ((0, 3), (4, 3))])
    assert _covers((4, 6), [((1, 0), (3, 6)), ((0, 0), (5, 7))])  # nor the whole-box check


def test_a_box_overhanging_the_tensor_in_every_dim_covers_it_and_a_scalar_needs_a_box() -> None:
    assert _covers((4, 6), [((0, 0), (5, 7))])
    assert not _covers((4, 6), [((0, 0), (5, 5))])
    assert not _covers((4, 6), [((1, 0), (5, 7))])
    assert not _covers((), [])  # was True: a scalar nobody held counted as covered
    assert _covers((), [((), ())])
