"""Restore nodes: a unit's shards read from a committed DCP checkpoint into its buffers (torch).

A checkpoint (written by transitions.checkpoint.save_units) holds every shard as a DCP chunk at its
global offsets under the name ``model_stage/tensor/kind``, so it is layout-free: a worker running a
``transitions.primitives.Restore`` node allocates its share of the target unit and reads, for each
of its slots, the overlapping parts of whatever chunks were saved (``restore_unit``). Each worker
reads only its own boxes, without collectives (DCP's ``no_dist``): a restore is an ordinary DAG
node, and a worker that fails it fails its run like any other node. ``CheckpointReader`` checks the
commit marker and the stages once per run.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp
from fsspec.core import url_to_fs
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from transitions.emu import EMU
from transitions.emu import box_intersection as intersect
from transitions.errors import CheckpointError
from transitions.executor.buffers import RankState
from transitions.layout import Slot

COMMIT_MARKER = "COMMITTED"


def fqn(model_stage: str, slot: Slot) -> str:
    return f"{model_stage}/{slot.tensor}/{slot.kind}"


def join_url(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/"), *parts])


def unit_boxes(units: dict[str, RankState]) -> dict[str, tuple[torch.Tensor, Slot]]:
    """fqn -> (view, slot) of every shard held; one worker holds one box of a tensor at rest."""
    boxes: dict[str, tuple[torch.Tensor, Slot]] = {}
    for uid, state in units.items():
        for slot, view in state.shards():
            name = fqn(state.placement.model_stage, slot)
            if name in boxes:
                raise CheckpointError(f"{name}: held twice on this worker (unit {uid} and another of its "
                                      "model-stage); checkpoint between transitions, not inside one")
            boxes[name] = (view, slot)
    return boxes


def is_committed(url: str, tag: str) -> bool:
    fs, path = url_to_fs(join_url(url, tag, COMMIT_MARKER))
    return bool(fs.exists(path))


@dataclass(kw_only=True, slots=True)
class CheckpointReader:
    """One committed checkpoint as a run's restore nodes read it: the manifest is read (and the commit
    checked) once, on the first node."""

    url: str
    tag: str
    stages: frozenset[str] | None = None

    def check(self, unit: EMU) -> None:
        """CheckpointError unless the checkpoint is committed and holds ``unit``'s model-stage."""
        if self.stages is None:
            self.stages = read_stages(self.url, self.tag)
        if unit.model_stage not in self.stages:
            raise CheckpointError(f"checkpoint {self.tag} holds no stage {unit.model_stage!r}")

    def restore(self, state: RankState) -> int:
        """Fill ``state`` (an allocated share) from the checkpoint; returns the bytes read."""
        boxes = unit_boxes({"": state})
        with warnings.catch_warnings():  # DCP warns that no_dist loads "in a single process": it is meant
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({name: view for name, (view, _) in boxes.items()},
                     storage_reader=FsspecReader(join_url(self.url, self.tag)), planner=_BoxLoadPlanner(boxes),
                     no_dist=True)
        return sum(view.numel() * view.element_size() for view, _ in boxes.values())


def read_stages(url: str, tag: str) -> frozenset[str]:
    """The model-stages a committed checkpoint holds (CheckpointError if it is not committed)."""
    if not is_committed(url, tag):
        raise CheckpointError(f"{join_url(url, tag)} has no {COMMIT_MARKER} marker: not a complete checkpoint")
    fs, marker = url_to_fs(join_url(url, tag, COMMIT_MARKER))
    with fs.open(marker, "rb") as f:
        return frozenset(json.loads(f.read().decode())["stages"])


class _BoxLoadPlanner(DefaultLoadPlanner):
    """Reads, for each local shard, the overlapping parts of whatever chunks the checkpoint holds."""

    def __init__(self, boxes: dict[str, tuple[torch.Tensor, Slot]]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._boxes = boxes

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        items: list[ReadItem] = []
        for name, (_, slot) in self._boxes.items():
            md = self.metadata.state_dict_metadata.get(name)
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointError(f"checkpoint holds no tensor {name!r}")
            if tuple(md.size) != slot.global_shape:
                raise CheckpointError(f"{name}: checkpoint shape {tuple(md.size)} != {slot.global_shape}")
            _check_covered(name, md, slot)
            chunk = ChunkStorageMetadata(offsets=torch.Size(slot.offsets), sizes=torch.Size(slot.lengths))
            items += create_read_items_for_chunk_list(name, md, [chunk])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self._boxes[index.fqn][0]


def _check_covered(name: str, md: TensorStorageMetadata, slot: Slot) -> None:
    """Saved chunks of one tensor are disjoint (one layout per save, duplicates deduplicated), so the
    box is fully restorable iff their overlaps with it add up to its volume; else it was never saved."""
    covered = 0
    for chunk in md.chunks:
        part = intersect((tuple(chunk.offsets), tuple(chunk.sizes)), (slot.offsets, slot.lengths))
        if part is not None:
            n = 1
            for k in part[1]:
                n *= k
            covered += n
    if covered != slot.numel:
        raise CheckpointError(f"{name}: checkpoint covers {covered} of the {slot.numel} elements needed")


