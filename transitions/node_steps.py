"""The step one worker runs for one DAG node: its local copies and its messages. Pure."""

from __future__ import annotations

from dataclasses import replace

from transitions.dag_pieces import DagMemo, node_pieces, node_stage
from transitions.early_builds import redirected
from transitions.global_dag import TransitionDAG
from transitions.transfer_plan import DEFAULT_BUCKET_BYTES, Message, Step, messages


def node_step(dag: TransitionDAG, node: int, worker: int, memo: DagMemo,
              max_bucket_bytes: int = DEFAULT_BUCKET_BYTES, predicted_s: float = 0.0,
              early: bool = False) -> Step:
    """The messages and local copies ``worker`` takes part in for DAG node ``node``. Both ends of a
    pair derive the same ordered pieces, hence the same messages, without talking to each other.
    With ``early`` (every worker of the run alike), the pieces a worker reads from a unit it builds
    early (``transitions.early_builds``) come from the new unit instead, and the building node's
    copies into it are left out (the build makes them)."""
    step = memo.get(dag, ("step", node, worker, max_bucket_bytes, early),
                    lambda: _node_step(dag, node, worker, memo, max_bucket_bytes, early))
    return step if step.predicted_s == predicted_s else replace(step, predicted_s=predicted_s)


def _node_step(dag: TransitionDAG, node: int, worker: int, memo: DagMemo, max_bucket_bytes: int,
               early: bool) -> Step:
    prim = dag.nodes[node]
    out = list(node_pieces(dag, node, worker, memo))
    if early:
        out = redirected(dag, node, worker, out, memo)
    local = tuple(p for p in out if p.src_worker == p.dst_worker)
    return Step(model_stage=node_stage(prim), primitive=f"{prim.kind.value}#{node}", local=local,
                messages=tuple(messages(out, max_bucket_bytes)), predicted_s=0.0)


def dag_messages(dag: TransitionDAG, memo: DagMemo, max_bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 early: bool = False) -> list[Message]:
    """Every message of a run of ``dag``, as its senders derive them: what crosses the wire, to the
    byte (alignment padding inside zero-copy runs and buckets included)."""
    out: list[Message] = []
    for worker in sorted(dag.gpu_nodes):
        for node in dag.nodes_on(worker):
            step = node_step(dag, node, worker, memo, max_bucket_bytes, early=early)
            out += [m for m in step.messages if m.src_worker == worker]
    return out
