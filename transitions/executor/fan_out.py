"""Running an Extend fan-out as one broadcast per unit rank (torch); ``transitions.fan_outs`` finds them."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from transitions.channel import DataChannel
from transitions.executor.buffers import RankState, allocate_unit
from transitions.executor.rounds import StepReport
from transitions.fan_outs import FanOut


def run_fan_out(fan: FanOut, groups: Sequence[Any], worker: int, units: dict[str, RankState],
                channel: DataChannel, timeout_s: float | None) -> list[StepReport]:
    """This worker's part of ``fan``: the source broadcasts its rank's whole buffer, each copy
    receives it into its new unit (same layout, so the same bytes in the same places, counters
    included). One report per Extend node this worker is in."""
    start = time.perf_counter()
    reports: list[StepReport] = []
    for (src_gpu, copies), group in zip(fan.ranks, groups):
        if worker == src_gpu:
            flat = units[fan.source.uid].flat
            channel.broadcast(flat, src_gpu, timeout_s=timeout_s, group=group)
            seconds = time.perf_counter() - start
            for i, node in enumerate(fan.nodes):  # the first carries the time, the others ran with it
                reports.append(StepReport(
                    model_stage=fan.source.model_stage, primitive=f"extend#{node}",
                    predicted_s=0.0, measured_s=seconds if i == 0 else 0.0, bytes_sent=flat.numel(),
                    bytes_received=0, bytes_copied_locally=0, peak_bucket_bytes=0,
                    alongside="" if i == 0 else f"broadcast extend#{fan.nodes[0]}"))
        elif worker in copies:
            i = copies.index(worker)
            target = fan.targets[i]
            units[target.uid] = state = allocate_unit(target, worker, channel.device)
            try:
                channel.broadcast(state.flat, src_gpu, timeout_s=timeout_s, group=group)
            except BaseException:
                units.pop(target.uid, None)  # half-filled: never mistake it for a copy
                raise
            reports.append(StepReport(
                model_stage=target.model_stage, primitive=f"extend#{fan.nodes[i]}", predicted_s=0.0,
                measured_s=time.perf_counter() - start, bytes_sent=0, bytes_received=state.flat.numel(),
                bytes_copied_locally=0, peak_bucket_bytes=0, alongside="broadcast"))
    return reports

