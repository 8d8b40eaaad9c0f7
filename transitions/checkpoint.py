"""The checkpoint/restart fallback: torch.distributed.checkpoint (DCP) of a job's EMUs through fsspec.

Used when no in-memory path exists (the last copy of some state died) and as the baseline the live
executor is measured against. Every worker of the current generation saves the shards it holds as
DCP chunks at their global offsets (replicas and GQA duplicates are deduplicated by DCP's planner),
so the checkpoint is layout-free: ``load_units`` restores into the units of ANY other plan, each
worker reading exactly the boxes of its shares. Saved and loaded is the worker's one state map, EMU
uid -> ``RankState``; a tensor is named by its unit's model-stage, never by the unit, so what was
saved from one layout's units is found again by another's.

Writes are atomic: the checkpoint is written under ``<url>/<tag>.partial-g<generation>``, renamed to
``<url>/<tag>`` once every rank finished, and then marked by a ``COMMITTED`` file (itself written to a
temporary name and renamed). Loading refuses a checkpoint without the marker, so a save that died
halfway can never be mistaken for a good one. ``url`` is any fsspec URL; a plain path means local.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from fsspec.core import url_to_fs
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorProperties,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from planner.errors import NereusError
from transitions.channel import DataChannel
from transitions.emu import EMU
from transitions.emu import box_intersection as intersect
from transitions.executor import RankState, allocate_unit
from transitions.layout import Slot

COMMIT_MARKER = "COMMITTED"


class CheckpointError(NereusError):
    """A checkpoint is missing, uncommitted, or does not hold what a placement needs."""


def fqn(model_stage: str, slot: Slot) -> str:
    return f"{model_stage}/{slot.tensor}/{slot.kind}"


def _boxes(units: dict[str, RankState]) -> dict[str, tuple[torch.Tensor, Slot]]:
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


class _BoxSavePlanner(DefaultSavePlanner):
    """Writes each local shard as a DCP chunk at its global offsets (plain tensors would be whole)."""

    def __init__(self, boxes: dict[str, tuple[torch.Tensor, Slot]]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._boxes = boxes

    def create_local_plan(self) -> SavePlan:
        items = []
        for name, (view, slot) in self._boxes.items():
            offsets = torch.Size(slot.offsets)
            items.append(WriteItem(
                index=MetadataIndex(name, offsets), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(slot.lengths)),
                    properties=TensorProperties.create_from_tensor(view),
                    size=torch.Size(slot.global_shape))))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        return self._boxes[index.fqn][0]


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


def _join(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/"), *parts])


def save_units(units: dict[str, RankState], url: str, tag: str, channel: DataChannel) -> dict[str, Any]:
    """Collective over the current generation: every member saves the units it holds (EMU uid ->
    state); atomic commit."""
    spec = channel.spec
    if spec is None:
        raise CheckpointError("save needs a formed generation")
    final = _join(url, tag)
    partial = _join(url, f"{tag}.partial-g{spec.generation}")
    fs, final_path = url_to_fs(final)
    _, partial_path = url_to_fs(partial)
    leader = spec.members[0] == channel.worker_id
    # every rank checks (the storage is shared), so all fail alike and none waits in a barrier alone
    if fs.exists(final_path):
        raise CheckpointError(f"{final} already exists; checkpoints are never overwritten")
    if leader:
        if fs.exists(partial_path):
            fs.rm(partial_path, recursive=True)  # left over by a save that died halfway
        fs.makedirs(partial_path, exist_ok=True)
    channel.barrier()
    boxes = _boxes(units)
    dcp.save({name: view for name, (view, _) in boxes.items()}, storage_writer=FsspecWriter(partial),
             planner=_BoxSavePlanner(boxes))
    channel.barrier()  # every rank's files and the metadata are written
    if leader:
        # the stages of every rank (DCP's metadata), not the leader's own: it may hold none of some
        saved = FsspecReader(partial).read_metadata().state_dict_metadata
        fs.mv(partial_path, final_path, recursive=True)
        manifest = {"tag": tag, "generation": spec.generation, "members": list(spec.members),
                    "stages": sorted({n.split("/")[0] for n in saved})}
        tmp = _join(final_path, f".{COMMIT_MARKER}.tmp")
        with fs.open(tmp, "wb") as f:
            f.write(json.dumps(manifest).encode())
        fs.mv(tmp, _join(final_path, COMMIT_MARKER))
    channel.barrier()
    return {"path": final, "bytes": sum(v.numel() * v.element_size() for v, _ in boxes.values())}


def is_committed(url: str, tag: str) -> bool:
    fs, path = url_to_fs(_join(url, tag, COMMIT_MARKER))
    return bool(fs.exists(path))


def load_units(units: tuple[EMU, ...] | list[EMU], worker: int, url: str, tag: str,
               channel: DataChannel) -> dict[str, RankState]:
    """Collective: allocate this worker's shares of ``units`` (any plan's) and fill them from the
    checkpoint; returns the new state map, EMU uid -> state."""
    if not is_committed(url, tag):
        raise CheckpointError(f"{_join(url, tag)} has no {COMMIT_MARKER} marker: not a complete checkpoint")
    fs, marker = url_to_fs(_join(url, tag, COMMIT_MARKER))
    with fs.open(marker, "rb") as f:
        manifest = json.loads(f.read().decode())
    missing = {u.model_stage for u in units} - set(manifest["stages"])
    if missing:
        raise CheckpointError(f"checkpoint {tag} holds no stage {sorted(missing)}")
    held = {u.uid: allocate_unit(u, worker, channel.device) for u in units if u.holds(worker)}
    boxes = _boxes(held)
    dcp.load({name: view for name, (view, _) in boxes.items()}, storage_reader=FsspecReader(_join(url, tag)),
             planner=_BoxLoadPlanner(boxes))
    return held
