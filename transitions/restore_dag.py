"""Restore from a checkpoint into any layout, as a TransitionDAG. Pure.

A restore is a move of state like any other: ``restore_dag`` gives one ``Restore`` node per unit of
the plan restored into (any layout, any world size), which the runner (transitions.executor.runner)
runs on each of the unit's workers by reading that worker's share from the committed checkpoint
(transitions.executor.restore). Nothing is held before it (the workers drop what they held: the
checkpoint replaces it), so its memory timeline is the new units' bytes, and it moves no byte
between workers. The initial placement moves no state (``agent.commands.InitUnits`` fills new units
from a seed); restoring a first checkpoint is this DAG.

    dag = restore_dag(placement_units(new), url, tag)
    coordinator.load_checkpoint(url, tag, placement_units(new))   # runs it
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.errors import SpecError
from transitions.emu import EMU
from transitions.feasibility import apply_footprint
from transitions.footprints import footprint
from transitions.global_dag import DagBody, TransitionDAG, gpu_index
from transitions.primitives import Restore


def restore_dag(units: Sequence[EMU], url: str, tag: str) -> TransitionDAG:
    """The DAG filling ``units`` (one plan's, at their version) from the checkpoint ``url``/``tag``."""
    if not units:
        raise SpecError("units", "a restore needs at least one unit to fill")
    uids = [u.uid for u in units]
    if len(set(uids)) != len(uids):
        raise SpecError("units", f"a unit is named twice: {sorted(u for u in uids if uids.count(u) > 1)}")
    nodes = tuple(Restore(target=u, url=url, tag=tag) for u in units)
    fps = tuple(footprint(n) for n in nodes)
    order = tuple(range(len(nodes)))
    used: dict[int, int] = {}
    peak: dict[int, int] = {}
    for fp in fps:
        apply_footprint(fp, used, peak)
    body = DagBody(nodes=nodes, stage_order=tuple(u.state.stage_order for u in units), data_edges=(),
                   resource_edges=(), order=order, old_units=(), lost_units=(), new_units=tuple(units),
                   renamed=(), stale_units=(), peak_bytes=peak, footprints=fps, gpu_nodes=gpu_index(list(fps), order))
    return TransitionDAG(old_version=-1, new_version=max(u.version for u in units),
                         capacity_bytes=max(peak.values(), default=0), body_=body)
