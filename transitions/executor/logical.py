"""The logical state a set of workers holds, whatever the layout: tensors assembled from shards (torch).

Every worker's ``agent.commands.Dump`` reply lists the shards it holds (model-stage -> shards, each
with its tensor, kind, global box and data). ``logical_state`` puts every shard of every
(model-stage, tensor, kind) in its place in the full tensor; ``logical_digests`` hashes those
tensors, so two layouts holding the same state give the same digests. This is the one assembly the
driver's checks and the tests use.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping
from typing import Any

import torch

from planner.errors import NereusError
from transitions.layout import COUNTERS

LogicalKey = tuple[str, str, str]  # (model-stage, tensor, kind)
Dumps = Mapping[int, Mapping[str, list[dict[str, Any]]]]  # worker -> its Dump reply


class LogicalStateError(NereusError):
    """Copies of one element disagree, or an element is held by no worker."""


def logical_state(dumps: Dumps, stages: Collection[str] | None = None, *,
                  strict: bool = True) -> dict[LogicalKey, torch.Tensor]:
    """Every (model-stage, tensor, kind) of ``stages`` (None: all) reassembled from every worker's
    shards. ``strict``: copies of one element held on several ranks or replicas must agree bit for bit,
    and every element must be held (LogicalStateError otherwise); else the last copy read wins."""
    full: dict[LogicalKey, torch.Tensor] = {}
    seen: dict[LogicalKey, torch.Tensor] = {}
    for dump in dumps.values():
        for stage, shards in dump.items():
            if stages is not None and stage not in stages:
                continue
            for shard in shards:
                _place(full, seen, (stage, shard["tensor"], shard["kind"]), shard, strict)
    for key, mask in seen.items():
        if not bool(mask.all()):
            raise LogicalStateError(f"{'/'.join(key)}: {int((~mask).sum())} elements held by no worker")
    return full


def _place(full: dict[LogicalKey, torch.Tensor], seen: dict[LogicalKey, torch.Tensor], key: LogicalKey,
           shard: dict[str, Any], strict: bool) -> None:
    data = shard["data"]
    if key not in full:
        full[key] = torch.zeros(shard["global_shape"], dtype=data.dtype)
        if strict:
            seen[key] = torch.zeros(shard["global_shape"], dtype=torch.bool)
    box = tuple(slice(o, o + k) for o, k in zip(shard["offsets"], shard["lengths"]))
    region = full[key][box]
    if strict:
        mask = seen[key][box]
        if mask.any() and not torch.equal(region[mask], data[mask]):
            raise LogicalStateError(f"{'/'.join(key)}: copies disagree")
        mask.fill_(True)
    region.copy_(data)


def logical_digests(dumps: Dumps, stages: Collection[str] | None = None) -> dict[str, str]:
    """sha256 of every logical "stage/tensor/kind" (``logical_state``, last copy wins): what a layout
    holds, independent of the layout. A unit's counters are hashed without counter 0, the plan
    version, which changes with the plan by design (steps and the minibatch position stay)."""
    out = {}
    for key, t in sorted(logical_state(dumps, stages, strict=False).items()):
        if key[1] == COUNTERS:
            t = t[1:]
        out["/".join(key)] = hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    return out
