"""The checkpoint/restart fallback: torch.distributed.checkpoint (DCP) of a job's EMUs through fsspec.

Used when no in-memory path exists (the last copy of some state died) and as the baseline the live
executor is measured against. Every worker of the current generation saves the shards it holds as
DCP chunks at their global offsets (replicas and GQA duplicates are deduplicated by DCP's planner),
so the checkpoint is layout-free: a restore DAG (``transitions.restore_dag``) restores it into the
units of ANY other plan, each worker reading exactly the boxes of its shares
(``transitions.executor.restore``, the runner's restore nodes). Saved is the worker's one state map,
EMU uid -> ``RankState``; a tensor is named by its unit's model-stage, never by the unit, so what was
saved from one layout's units is found again by another's.

Writes are atomic: the checkpoint is written under ``<url>/<tag>.partial-g<generation>``, renamed to
``<url>/<tag>`` once every rank finished, and then marked by a ``COMMITTED`` file (itself written to a
temporary name and renamed). A restore refuses a checkpoint without the marker, so a save that died
halfway can never be mistaken for a good one. ``url`` is any fsspec URL; a plain path means local.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from fsspec.core import url_to_fs
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorProperties,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from transitions.channel import DataChannel
from transitions.errors import CheckpointError
from transitions.executor import RankState
from transitions.executor.restore import COMMIT_MARKER, is_committed, join_url, unit_boxes
from transitions.layout import Slot

__all__ = ["COMMIT_MARKER", "CheckpointError", "is_committed", "save_units"]


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


def save_units(units: dict[str, RankState], url: str, tag: str, channel: DataChannel) -> dict[str, Any]:
    """Collective over the current generation: every member saves the units it holds (EMU uid ->
    state); atomic commit."""
    spec = channel.spec
    if spec is None:
        raise CheckpointError("save needs a formed generation")
    final = join_url(url, tag)
    partial = join_url(url, f"{tag}.partial-g{spec.generation}")
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
    boxes = unit_boxes(units)
    dcp.save({name: view for name, (view, _) in boxes.items()}, storage_writer=FsspecWriter(partial),
             planner=_BoxSavePlanner(boxes))
    channel.barrier()  # every rank's files and the metadata are written
    if leader:
        # the stages of every rank (DCP's metadata), not the leader's own: it may hold none of some
        saved = FsspecReader(partial).read_metadata().state_dict_metadata
        fs.mv(partial_path, final_path, recursive=True)
        manifest = {"tag": tag, "generation": spec.generation, "members": list(spec.members),
                    "stages": sorted({n.split("/")[0] for n in saved})}
        tmp = join_url(final_path, f".{COMMIT_MARKER}.tmp")
        with fs.open(tmp, "wb") as f:
            f.write(json.dumps(manifest).encode())
        fs.mv(tmp, join_url(final_path, COMMIT_MARKER))
    channel.barrier()
    return {"path": final, "bytes": sum(v.numel() * v.element_size() for v, _ in boxes.values())}
