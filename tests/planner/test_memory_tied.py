"""Parameters on the worst GPU of a unit, against the transition geometry's own placement of every
tensor: a tied embedding is held by the first and by the last PP stage (it is the LM head there)."""

from __future__ import annotations

import dataclasses

import pytest

from planner.memory import params_per_gpu, resident_bytes
from planner.models import TINY_3M, Head, ModelSpec
from planner.plan import Layout
from planner.workflow import ACTOR_TRAIN, REF_INF
from transitions.geometry import unit_rank_bytes

TIED = dataclasses.replace(TINY_3M, name="tiny-3m-tied", tie_word_embeddings=True)


@pytest.mark.parametrize("model", [TINY_3M, TIED], ids=lambda m: m.name)
@pytest.mark.parametrize("head", [Head.LM, Head.VALUE])
@pytest.mark.parametrize("tp,pp", [(1, 1), (1, 2), (2, 2), (1, 3), (4, 4), (2, 4)])
def test_worst_gpu_matches_the_shards_each_rank_holds(model: ModelSpec, head: Head, tp: int, pp: int) -> None:
    layout = Layout(tp, pp)
    held = max(unit_rank_bytes(model, head, layout, r) for r in range(layout.size))  # bf16 params
    assert params_per_gpu(model, head, layout) * model.bytes_per_param == held


def test_tied_embedding_makes_the_last_stage_the_heaviest() -> None:
    """PP2, LM head: the last stage holds its layers, the final norm and (tied) the embedding again."""
    layout = Layout(1, 2)
    embed = TIED.vocab_size * TIED.hidden_size
    last = unit_rank_bytes(TIED, Head.LM, layout, layout.size - 1) // TIED.bytes_per_param
    first = unit_rank_bytes(TIED, Head.LM, layout, 0) // TIED.bytes_per_param
    assert last - first == TIED.hidden_size  # same layers and embedding; the final norm on top
    assert params_per_gpu(TIED, Head.LM, layout) == last
    untied_last = unit_rank_bytes(TINY_3M, Head.LM, layout, layout.size - 1) // TINY_3M.bytes_per_param
    assert last == untied_last  # the untied head is a vocab x hidden matrix too: same count
    assert params_per_gpu(TIED, Head.LM, layout) >= embed
    # and the memory model charges it: inference and training state of the tied model on PP2
    assert resident_bytes(TIED, REF_INF, layout).params_bytes == last * TIED.bytes_per_param
    assert resident_bytes(TIED, ACTOR_TRAIN, layout).total_bytes == 16 * last
