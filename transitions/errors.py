"""Typed errors that more than one pure transitions module raises or catches.

They subclass the project's NereusError, never AssertionError: a caller catches exactly the error it
means (the replica-class fast path falls back on a DagCycleError and on nothing else), and ``assert``
stays for invariants only a bug would break. An error one module raises for its own callers lives
with it (local_dag.LastCopyLostError, replay.ReplayError). Pure: no torch, no I/O.
"""

from __future__ import annotations

from planner.errors import NereusError


class DagCycleError(NereusError):
    """The edges of a transition DAG close a cycle, so no order runs every node.

    Raised by feasibility.bottom_levels (and so order_by_memory). ``unordered`` lists the nodes that
    never become ready (those on a cycle and those behind one). build_transition's unit-level edges
    never close one; the replica-class fast path catches it on its class-level edges and leaves the
    transition to the per-unit path.
    """

    def __init__(self, unordered: tuple[int, ...]) -> None:
        self.unordered = unordered
        shown = ", ".join(map(str, unordered[:8])) + (", ..." if len(unordered) > 8 else "")
        super().__init__(f"transition DAG has a cycle: {len(unordered)} nodes never become ready ({shown})")


class CoverageError(NereusError):
    """A primitive's sources hold no copy of some rows of a target shard, so its pieces cannot be derived.

    Raised by transitions.covers (pieces, transfers, footprint) for a hand-built or corrupted primitive:
    build_transition only picks sources that hold the state, or raises local_dag.LastCopyLostError.
    ``target`` is the unit's uid, ``key`` the (tensor, state kind) and ``rows`` the half-open row
    ranges along the shard's split dimension that no source holds on any GPU.
    """

    def __init__(self, target: str, gpu: int, key: tuple[str, object], rows: tuple[tuple[int, int], ...]) -> None:
        self.target = target
        self.gpu = gpu
        self.key = key
        self.rows = rows
        super().__init__(f"{target} on GPU {gpu}: {key} rows {list(rows)} held by no source")


class CheckpointError(NereusError):
    """A checkpoint is missing, uncommitted, or does not hold what a placement needs (transitions.checkpoint
    saves them; the runner's restore nodes, transitions.executor.restore, read them)."""
