"""The memos that planning transitions fills, in one object owned by whoever builds DAGs.

Building transition DAGs derives the same things again and again: the footprint of each relative
shape of primitive (transitions.primitives) and, over replica classes (transitions.replica_classes),
each stage plan's GPU array, owners and held bytes, the class-level plan of each pair of stage plans
and of each relative shape of such a pair. A PlanningCache holds all of them, each bounded, so a
builder that builds again and again (a planner trying candidates, the daemon replanning its jobs)
pays a lookup for what it derived before. What is in it never changes a DAG, only how fast it comes.

Who owns one: whoever builds repeatedly keeps one PlanningCache for its lifetime, passes it to every
``build_transition(..., cache=...)`` and empties it (``clear()``) when it wants a cold start: the
daemon's planner binding (nereusd.planning, one per daemon, shared by its job controllers) and
bench/transition_dag.py do. A lazily expanded DAG keeps its builder's cache for that expansion (not
when pickled). ``DEFAULT_CACHE`` is the process's one default, documented and explicit: what a
caller that passes none gets (one-off builds, tests), and what per-GPU derivation
(``transitions.pieces.pieces`` for one GPU without a cache of its own) uses.

Keys are values (relative shapes), except for the per-plan and per-pair memos: those are found by
the identity of the plan objects (a planner hands the same objects back while it tries candidates;
hashing a 1,024-GPU stage plan takes ~20 us, an identity lookup ~0.5 us), and each entry keeps its
objects alive, so an id is never reused by another object while its entry exists.
Pure: stdlib only, cheap to import (the daemon builds one at start).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    import numpy as np

    from transitions.gpu_traffic import DstTraffic, PairWire
    from transitions.primitives import Footprint
    from transitions.replica_plan import ClassShape, ShapeEntry, StageClasses

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

# Bounds (entries): a 4,096-GPU pair of stage plans' classes take about a MB; footprints are small.
FOOTPRINT_ENTRIES = 16384
CLASS_SHAPE_ENTRIES = 4096
GPU_ENTRIES = 16384  # per target GPU's relative key, and per pair of one: a few ints each
PLAN_ENTRIES = 256  # per stage plan: GPU arrays, owners, held bytes
PAIR_ENTRIES = 64  # per pair of stage plans, and per relative shape of one
STREAM_ENTRIES = 1024  # per streamed pair's input: its pieces' ranges and shifts, ~20 KB a key at 70B (<= ~45 MB)


class Memo(Generic[K, V]):
    """At most ``max_entries`` values by key. When full, a new key empties it at once (the cheapest
    bound, for memos whose entries are all alike), or with ``lru`` drops the least recently used entry
    (a planner's hot shapes stay)."""

    __slots__ = ("max_entries", "lru", "_data")

    def __init__(self, max_entries: int, *, lru: bool = False) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self.max_entries = max_entries
        self.lru = lru
        self._data: dict[K, V] = {}

    def get(self, key: K) -> V | None:
        if not self.lru:
            return self._data.get(key)
        value = self._data.pop(key, None)
        if value is not None:
            self._data[key] = value  # most recently used last
        return value

    def put(self, key: K, value: V) -> V:
        if key not in self._data and len(self._data) >= self.max_entries:
            if self.lru:
                del self._data[next(iter(self._data))]
            else:
                self._data.clear()
        self._data[key] = value
        return value

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        self._data.clear()


class IdentityMemo(Generic[V]):
    """At most ``max_entries`` values derived from particular objects (``pinned``), found by a flat
    ``key`` that starts with those objects' ids (then anything hashable); emptied at once when full.
    An entry holds its objects, so while it exists their ids belong to them: equal ids mean the same
    objects, never a dead one's reused id."""

    __slots__ = ("max_entries", "_data")

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self.max_entries = max_entries
        self._data: dict[tuple[Any, ...], tuple[tuple[object, ...], V]] = {}

    def get_or_make(self, key: tuple[Hashable, ...], pinned: tuple[object, ...], make: Callable[[], V]) -> V:
        """The value for ``key`` (``(id(a), id(b), ..., extra...)`` for ``pinned == (a, b, ...)``), made
        by ``make`` on a miss. The key is flat and built by the caller: this is the warm path of every
        build, a lookup of about a microsecond."""
        entry = self._data.get(key)
        if entry is not None:
            return entry[1]
        value = make()
        if len(self._data) >= self.max_entries:
            self._data.clear()
        self._data[key] = (pinned, value)
        return value

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        self._data.clear()


@dataclass(kw_only=True, slots=True, eq=False)
class PlanningCache:
    """Every memo transition planning fills (see the module docstring for who owns one)."""

    # primitives: relative shape of a primitive -> its footprint over GPU labels
    footprints: Memo[tuple[object, ...], Footprint] = field(default_factory=lambda: Memo(FOOTPRINT_ENTRIES))
    # gpu_traffic: relative key of a target GPU (of its TP group where symmetric) -> its traffic, roles
    # relative to it; and with a sender's positions -> that pair's wire
    dst_traffic: Memo[tuple[object, ...], DstTraffic] = field(default_factory=lambda: Memo(GPU_ENTRIES))
    pair_wires: Memo[tuple[object, ...], PairWire] = field(default_factory=lambda: Memo(GPU_ENTRIES))
    # gpu_traffic: a pair's streamed input (wire_stream.PairStream.content_key) -> its wire
    pair_streams: Memo[tuple[object, ...], PairWire] = field(default_factory=lambda: Memo(STREAM_ENTRIES))
    # replica_classes: relative shape of a class -> its canonical footprint and what derives from it
    class_shapes: Memo[tuple[object, ...], ClassShape] = field(
        default_factory=lambda: Memo(CLASS_SHAPE_ENTRIES))
    # replica_classes: relative shape of a pair of stage plans -> its class-level plan over labels
    shape_stages: Memo[tuple[object, ...], ShapeEntry] = field(
        default_factory=lambda: Memo(PAIR_ENTRIES, lru=True))
    # replica_classes, by identity: (current, target) stage plans -> their class-level plan (None: none)
    stage_pairs: IdentityMemo[StageClasses | None] = field(default_factory=lambda: IdentityMemo(PAIR_ENTRIES))
    # replica_classes, by identity: a stage plan's GPU sets -> (replicas x unit size) array
    gpu_arrays: IdentityMemo[np.ndarray] = field(default_factory=lambda: IdentityMemo(PLAN_ENTRIES))
    # replica_classes, by identity: a stage plan -> (replica on each GPU, rank there)
    owners: IdentityMemo[tuple[np.ndarray, np.ndarray]] = field(default_factory=lambda: IdentityMemo(PLAN_ENTRIES))
    # replica_classes, by identity: a stage plan -> bytes its units hold on each GPU
    held_bytes: IdentityMemo[np.ndarray] = field(default_factory=lambda: IdentityMemo(PLAN_ENTRIES))

    def clear(self) -> None:
        """Empty every memo (the owner's call: a cold start)."""
        for memo in self.memos().values():
            memo.clear()

    def memos(self) -> dict[str, Memo[Any, Any] | IdentityMemo[Any]]:
        return {"footprints": self.footprints, "dst_traffic": self.dst_traffic, "pair_wires": self.pair_wires,
                "pair_streams": self.pair_streams,
                "class_shapes": self.class_shapes,
                "shape_stages": self.shape_stages, "stage_pairs": self.stage_pairs,
                "gpu_arrays": self.gpu_arrays, "owners": self.owners, "held_bytes": self.held_bytes}

    def sizes(self) -> dict[str, int]:
        """Entries per memo (for tests and benchmarks)."""
        return {name: len(memo) for name, memo in self.memos().items()}


DEFAULT_CACHE = PlanningCache()
