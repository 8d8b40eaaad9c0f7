"""The executor: moves live EMU state between layouts over the data channel, bit-exactly (torch).

One runner (``run_dag``) runs every move of state, a ``transitions.global_dag.TransitionDAG``; the
plan it runs is pure data derived from the DAG (``transitions.layout``, ``transitions.transfer_plan``,
``transitions.node_steps``, ``transitions.early_builds``, ``transitions.in_place_plan``,
``transitions.fan_outs``). The torch side, by concept:

- ``buffers``: flat per-rank buffers (``RankState``) and typed views into them;
- ``pages``: moving and copying raw memory (mremap, memmove, madvise);
- ``rounds``: pipelined rounds of posted sends and receives for one node (``run_step``);
- ``runner``: the DAG runner, one method per kind of node (``run_dag``);
- ``fan_out``: Extend fan-outs as broadcasts;
- ``in_place`` and ``early_build``: units built inside, or from the pages of, the unit they are cut from;
- ``lend``: a node's local runs out of a donor nothing reads any more, moved as pages after its transfers;
- ``warm_pool``: touched mappings kept for the next buffers, refilled between runs;
- ``background``: long-lived threads for work handed off a transition (pool refills, engine releases);
- ``shipped``: the steps a driver already derived from a DAG, sent to each worker instead of re-derived;
- ``restore``: restore nodes, a unit's shards read from a DCP checkpoint (``transitions.restore_dag``);
- ``logical``: the logical state a set of workers holds, assembled from their dumps (and its digests).
"""

from transitions.executor.buffers import RankState, alloc_bytes, allocate_unit
from transitions.executor.rounds import StepReport
from transitions.executor.runner import FAN_OUT_MIN_BYTES, IN_PLACE, run_dag

__all__ = ["FAN_OUT_MIN_BYTES", "IN_PLACE", "RankState", "StepReport", "alloc_bytes", "allocate_unit", "run_dag"]
