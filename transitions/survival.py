"""What survives a failure: per model-stage, the state no surviving unit still covers (pure).

After a worker dies mid-DAG the survivors report the uids of the units they still hold; whatever
no held unit share covers entirely has lost its last copy and must come from the checkpoint.
Used by the coordinator after a failed ``RunDag``; the DAG names every unit, so no placement is needed.
"""

from __future__ import annotations

from collections.abc import Mapping, Set

from transitions.emu import box_intersection
from transitions.global_dag import TransitionDAG

Box = tuple[tuple[int, ...], tuple[int, ...]]


def uncovered_state(dag: TransitionDAG, held: Mapping[int, Set[str]]) -> dict[str, list[str]]:
    """Per model-stage of the DAG, the tensors/kinds that no surviving unit share covers entirely.

    ``held``: worker -> uids of the units it still holds. Boxes of one tensor differ along at most
    its split dimension, so coverage is a union of intervals along the dimension where they differ.
    """
    units = {u.uid: u for u in (*dag.old_units, *dag.new_units)}
    for prim in dag.nodes:
        for u in (*prim.sources, *prim.targets):
            units.setdefault(u.uid, u)
    renamed = dict(dag.renamed)
    for old, new in renamed.items():
        if new not in units and old in units:
            units[new] = units[old]
    boxes: dict[tuple[str, str, str], list[Box]] = {}
    shapes: dict[tuple[str, str, str], tuple[int, ...]] = {}
    for u in dag.old_units:
        for g in u.gpus:
            for sh in u.shards(g):
                shapes[(u.model_stage, sh.tensor, sh.kind.value)] = sh.global_shape
    for worker, uids in held.items():
        for uid in uids:
            unit = units.get(uid)
            if unit is None or not unit.holds(worker):
                continue
            for sh in unit.shards(worker):
                boxes.setdefault((unit.model_stage, sh.tensor, sh.kind.value), []).append(
                    (sh.offsets, sh.lengths))
    out: dict[str, list[str]] = {}
    for key, shape in shapes.items():
        if not _covers(shape, boxes.get(key, [])):
            out.setdefault(key[0], []).append(f"{key[1]}/{key[2]}")
    return {k: sorted(v) for k, v in out.items()}


def _covers(shape: tuple[int, ...], boxes: list[Box]) -> bool:
    full = (tuple(0 for _ in shape), shape)
    for dim in range(len(shape)):
        spans = sorted((o[dim], o[dim] + k[dim]) for o, k in boxes
                       if all(o[d] == 0 and k[d] == shape[d] for d in range(len(shape)) if d != dim))
        reach = 0
        for lo, hi in spans:
            if lo > reach:
                break
            reach = max(reach, hi)
        if reach >= shape[dim]:
            return True
    return any(box_intersection(b, full) == full for b in boxes)  # a scalar needs a box too
