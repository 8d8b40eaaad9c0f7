"""Extend fan-outs a broadcast can run: several Extends copying one unit whole. Pure.

``transitions.executor.fan_out`` runs each as one broadcast per unit rank; every worker of the
generation derives the same list in the same order, since forming the groups is collective.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from transitions.emu import EMU
from transitions.global_dag import TransitionDAG
from transitions.primitives import Extend


@dataclass(frozen=True, kw_only=True, slots=True)
class FanOut:
    """Several Extends copying one unit whole to other GPUs, run as one broadcast per unit rank from
    the source GPU to its copies. NCCL pipelines a broadcast along a ring, so the source's link
    carries the unit once instead of once per copy; gloo's broadcast also beat the point-to-point
    copies here (see ``FAN_OUT_MIN_BYTES``)."""

    nodes: tuple[int, ...]  # the Extend nodes it stands for, in execution order
    source: EMU
    targets: tuple[EMU, ...]  # one per node

    @property
    def ranks(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """Per unit rank: the source GPU and the GPUs of its copies (one broadcast group each)."""
        return tuple((g, tuple(t.gpus[r] for t in self.targets)) for r, g in enumerate(self.source.gpus))


def fan_outs(dag: TransitionDAG) -> list[FanOut]:
    """The Extend fan-outs of ``dag`` that a broadcast can run: two or more Extends of one whole unit
    into same-layout copies on other GPUs (parts excluded), and no node of any GPU involved in
    between them in the execution order, so no member waits on another node while the others are in
    the broadcast (which would deadlock). Pure, identical on every worker: groups are formed in this
    order."""
    pos = {n: i for i, n in enumerate(dag.order)}
    by_source: dict[str, list[int]] = defaultdict(list)
    for n, prim in enumerate(dag.nodes):
        if not isinstance(prim, Extend) or len(prim.sources) != 1:
            continue
        src, tgt = prim.sources[0], prim.target
        if (src.final is None and tgt.final is None and tgt.layout == src.layout and tgt.state == src.state
                and not set(tgt.gpus) & set(src.gpus)):
            by_source[src.uid].append(n)
    out = []
    for nodes in by_source.values():
        if len(nodes) < 2:
            continue
        nodes.sort(key=lambda n: pos[n])
        prims = [dag.nodes[n] for n in nodes]
        source = prims[0].sources[0]
        targets = tuple(prim.targets[0] for prim in prims)
        members = set(source.gpus).union(*(t.gpus for t in targets))
        if len(members) != len(source.gpus) * (1 + len(targets)):
            continue  # two copies share a GPU
        lo, hi, mine = pos[nodes[0]], pos[nodes[-1]], set(nodes)
        if any(lo < pos[m] < hi and m not in mine for w in members for m in dag.nodes_on(w)):
            continue
        out.append(FanOut(nodes=tuple(nodes), source=source, targets=targets))
    return out

