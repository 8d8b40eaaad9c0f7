"""Running a TransitionDAG on one worker: THE runner of every state move (torch).

Each worker runs the DAG nodes that touch it, in the DAG's order, on its units (EMU uid -> RankState),
deriving its own pieces and messages (``transitions.node_steps``): targets are allocated when their
node starts, sources freed by the node that frees them, Merges of parts already in final shape only
relabel; local-only nodes right after a remote one run alongside its transfers. On CPU a unit cut
from one the worker gives up is built from that unit's pages before the nodes sending from it
(``early_build``), or else inside that unit's buffer once nothing reads it any more (``in_place``);
a node's local runs out of a unit nothing reads after it (a merge keeping its own part) move as pages
once its transfers are done (``lend``), and the warm pool refills what moves emptied after the run
(once the worker's next command arrives: ``warm_pool.WarmPool.start_pending``).
A large Extend fan-out runs as one broadcast per unit rank (``fan_out``); a Restore node reads the
worker's share of its unit from a checkpoint (``restore``). Time per node is measured next to the
cost model's prediction.

A run that stops halfway (a peer died, a timeout) loses no logical state unless its last copy died:
``transitions.survival.uncovered_state`` says what then needs the checkpoint.
"""

from __future__ import annotations

import resource
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from transitions.channel import DataChannel
from transitions.dag_pieces import DagMemo
from transitions.early_builds import EarlyBuild, early_builds
from transitions.executor import shipped, warm_pool
from transitions.executor.buffers import RankState, allocate_unit
from transitions.executor.early_build import Built, build_early
from transitions.executor.fan_out import run_fan_out
from transitions.executor.in_place import build_in_place
from transitions.executor.lend import Lent, lend_pages, movable_pieces
from transitions.executor.restore import CheckpointReader
from transitions.executor.rounds import BucketPool, OnRound, StepReport, run_step
from transitions.fan_outs import FanOut, fan_outs
from transitions.global_dag import TransitionDAG
from transitions.in_place_plan import InPlace, in_place_plan
from transitions.layout import unit_buffer_bytes
from transitions.node_steps import node_step
from transitions.primitives import Merge, Primitive, Restore, relabels
from transitions.transfer_plan import DEFAULT_BUCKET_BYTES, Piece, Step

# CPU: a unit cut from another one on the same worker (a TP or PP Split/Merge keeping part of the
# shard) is built from the pages of the unit it is cut from (``early_build``: 182 MiB of tiny-25m in
# 232 mremaps, ~5-15 ms, where copying into fresh pages runs at 1.7-3 GB/s), or inside its buffer
# once nothing reads it any more (``in_place``: compacting warm memory at 3-10 GB/s); the worker's
# peak memory drops by the new unit's size. Off on GPUs: the caching allocator hands out warm
# memory, and a block can neither give back its tail nor move its pages.
IN_PLACE = True
# Extend fan-outs run as broadcasts from this many bytes per unit rank: forming the groups costs
# 1-15 ms (every worker calls new_group); DP1 -> DP4 of 382 MB: gloo broadcast 0.60 s vs three
# point-to-point copies 0.73-0.78 s here, and NCCL pipelines broadcasts along a ring.
FAN_OUT_MIN_BYTES = 32 << 20
# this process's last run_dag in spans (seconds): planning (``prepare_s``: of it ``seed_s`` putting the
# driver's shipped steps in the memo, ``prepare_cpu_s`` its CPU time: the rest is waiting for a core),
# forming the fan-out groups, the first node's early builds (made before the barrier), the opening
# barrier, the nodes, destroying the groups; the minor page faults it took (first touches of fresh
# memory); when it started and ended (``time.perf_counter``, the host's monotonic clock, which every
# process on it shares); read by benchmarks (bench/live_transition.py)
LAST_RUN: dict[str, float] = {}


@dataclass(frozen=True, kw_only=True, slots=True)
class _Prepared:
    """What a worker derives from the DAG before anything moves (planning stays out of the timings)."""

    steps: dict[int, Step]
    order: list[int]
    builds: dict[int, EarlyBuild]  # early builds, by building node
    plans: dict[int, InPlace]  # in-place builds, by node
    fans: list[FanOut]
    predicted_s: Sequence[float] | None  # per node, the cost model's
    early: bool = False  # units cut from others are built from their pages (CPU, ``in_place``)


def run_dag(dag: TransitionDAG, worker: int, units: dict[str, RankState], channel: DataChannel, *,
            predicted_s: Sequence[float] | None = None, max_bucket_bytes: int = DEFAULT_BUCKET_BYTES,
            timeout_s: float | None = None, on_round: OnRound | None = None,
            in_place: bool | None = None, fan_out: bool | None = None,
            memo: DagMemo | None = None, derived: bytes | None = None) -> list[StepReport]:
    """Run the DAG nodes that touch ``worker``, in the DAG's order, on ``units`` (EMU uid -> state).

    Each worker runs its nodes one at a time in the global order, so pairs meet in the same node and
    memory follows the DAG's checked timeline. ``in_place`` (default ``IN_PLACE``, CPU only) must be
    the same on every worker of the run, since receivers derive the senders' early builds; either way
    a failure finds the same copies alive. ``fan_out``: None runs as broadcasts the fan-outs copying
    at least ``FAN_OUT_MIN_BYTES`` per rank. ``memo`` keeps what is derived from ``dag`` (a worker
    passes its own, so a DAG run twice is derived once; None: a fresh one for this run). ``derived``:
    what the driver already derived for this worker (``transitions.executor.shipped.pack``), put into
    ``memo`` first, so that the planning finds it instead of deriving it again.
    Raises ChannelBroken on any communication failure; ``units`` then holds whatever existed at that
    point (old units are only freed after their readers).
    """
    memo = memo if memo is not None else DagMemo()
    warm_pool.POOL.settle()  # the last run's refill holds the pool's mappings: done first (bounded)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0, cpu0 = time.perf_counter(), time.thread_time()
    if derived is not None:
        shipped.seed(memo, dag, derived)
    t0s = time.perf_counter()
    prepared = _prepare(dag, worker, channel.device, predicted_s, max_bucket_bytes, in_place, fan_out, memo)
    t1, cpu1 = time.perf_counter(), time.thread_time()
    # every worker of the generation forms every group, in the same order (new_group is collective)
    groups = [[channel.new_group(tuple(sorted({src, *copies}))) for src, copies in fan.ranks]
              for fan in prepared.fans]
    run = _DagRun(dag=dag, worker=worker, units=units, channel=channel, prepared=prepared, groups=groups,
                  timeout_s=timeout_s, on_round=on_round, memo=memo)
    t2 = time.perf_counter()
    try:
        return run.run()
    finally:
        t3 = time.perf_counter()
        for group in (g for per_fan in groups for g in per_fan):
            channel.destroy_group(group)
        LAST_RUN.clear()
        LAST_RUN.update(prepare_s=t1 - t0, seed_s=t0s - t0, prepare_cpu_s=cpu1 - cpu0, groups_s=t2 - t1,
                        early_s=run.early_s, barrier_s=run.barrier_s, nodes_s=t3 - t2 - run.barrier_s - run.early_s,
                        destroy_groups_s=time.perf_counter() - t3,
                        minor_faults=resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
                        started_at=t0, ended_at=time.perf_counter())
        if channel.device.type == "cpu" and warm_pool.WARM_POOL_BYTES > 0:
            # what this run emptied, populated before the next one; started by the worker's next
            # command (its peers may still be moving bytes on the same cores now)
            warm_pool.POOL.refill_later()


def _prepare(dag: TransitionDAG, worker: int, device: torch.device, predicted_s: Sequence[float] | None,
             max_bucket_bytes: int, in_place: bool | None, fan_out: bool | None, memo: DagMemo) -> _Prepared:
    early = (IN_PLACE if in_place is None else in_place) and device.type == "cpu"
    steps = {node: node_step(dag, node, worker, memo, max_bucket_bytes,
                             predicted_s[node] if predicted_s is not None else 0.0, early=early)
             for node in dag.nodes_on(worker) if not _unstepped(dag.nodes[node])}
    order = list(dag.nodes_on(worker))
    builds = early_builds(dag, worker, memo) if early else {}
    if fan_out is None:  # where it helps: copies big enough to pay for forming the groups
        fans = [f for f in fan_outs(dag) if unit_buffer_bytes(f.source, f.source.gpus[0]) >= FAN_OUT_MIN_BYTES]
    else:
        fans = fan_outs(dag) if fan_out else []
    broadcast = {fan.source.uid for fan in fans}  # read whole by a broadcast: never a donor
    plans: dict[int, InPlace] = {}
    if early:
        for node in order:
            plan = in_place_plan(dag, node, steps[node], worker, order, steps) \
                if node in steps and node not in builds else None
            if plan is not None and plan.donor not in broadcast:
                plans[node] = plan
    return _Prepared(steps=steps, order=order, builds=builds, plans=plans, fans=fans, predicted_s=predicted_s,
                     early=early)


def _unstepped(prim: Primitive) -> bool:
    """Nodes without a step of messages and copies: relabelling Merges and Restores (read, not sent)."""
    return relabels(prim) or isinstance(prim, Restore)


@dataclass(kw_only=True)
class _DagRun:
    """One worker's run of one DAG: the nodes in order, one method per kind of node."""

    dag: TransitionDAG
    worker: int
    units: dict[str, RankState]
    channel: DataChannel
    prepared: _Prepared
    groups: list[list[Any]]
    timeout_s: float | None
    on_round: OnRound | None
    memo: DagMemo
    reports: list[StepReport] = field(default_factory=list)
    built: dict[str, Built] = field(default_factory=dict)  # donor uid -> its early build, until the DAG frees it
    build_stats: dict[str, Built] = field(default_factory=dict)  # "kind#node" of a building node -> its build
    carried: set[int] = field(default_factory=set)  # local-only nodes already run alongside a remote one
    deferred: dict[int, list[InPlace]] = field(default_factory=dict)  # node -> in-place builds after it
    relabel: list[Merge] = field(default_factory=list)
    readers: dict[tuple[str, str], CheckpointReader] = field(default_factory=dict)  # (url, tag) -> reader
    lent: dict[str, Lent] = field(default_factory=dict)  # donor uid -> pages moved out of it, until it is freed
    barrier_s: float = 0.0  # the opening barrier's wait
    early_s: float = 0.0  # the first node's early builds, made before the barrier

    def run(self) -> list[StepReport]:
        try:
            self._run_nodes()
        except BaseException:
            for made in self.built.values():  # the donors hold their bytes again; the targets never existed
                if made.build.donor in self.units:
                    made.undo()
                    self.units.pop(made.build.target.uid, None)
            for lent in self.lent.values():  # likewise for pages a node's local copies moved
                if lent.donor in self.units:
                    lent.undo()
                    for uid in lent.targets:
                        self.units.pop(uid, None)
            raise
        return self.reports

    def _run_nodes(self) -> None:
        prep, units = self.prepared, self.units
        build_before: dict[int, list[EarlyBuild]] = defaultdict(list)
        for build in prep.builds.values():
            build_before[build.readers[0]].append(build)
        fan_of = {node: i for i, fan in enumerate(prep.fans) for node in fan.nodes}
        # Merges whose parts all arrive in final shape move nothing and touch no GPU's timeline, so
        # they are in no worker's node list: each worker relabels its share as soon as it holds it; so
        # are Merges that copy on other GPUs but only relabel here (a part that arrived in final shape
        # on a GPU the Merge's copies do not touch): without this the part would keep its name
        mine = set(prep.order)
        self.relabel = [prim for i, prim in enumerate(self.dag.nodes)
                        if isinstance(prim, Merge) and (relabels(prim) or i not in mine)]
        # the first node's early builds are local work nothing before it waits for: made while the
        # peers are still on their way to the barrier (a TP split's sender built its kept half after
        # it: 7-24 ms in series before its send), unless a relabel would rename their units first
        renamed = {u.uid for merge in self.relabel for u in (*merge.parts, merge.unit)}
        first = build_before.get(prep.order[0], []) if prep.order else []
        if first:
            start = time.perf_counter()
            for build in first:
                if build.donor not in renamed and build.target.uid not in renamed:
                    self._build(build)
            self.early_s = time.perf_counter() - start
        # every member is there before anything moves (and NCCL's communicator exists before p2p)
        start = time.perf_counter()
        self.channel.barrier(self.timeout_s)
        self.barrier_s = time.perf_counter() - start
        self._check_restores()
        _apply_relabels(self.relabel, self.worker, units)
        pool = BucketPool(device=self.channel.device)
        for index, node in enumerate(prep.order):
            if node in self.carried:
                continue
            for build in build_before.get(node, ()):
                self._build(build)
            if node in fan_of:
                self._fan_out(fan_of[node])
            elif isinstance(self.dag.nodes[node], Restore):
                self._restore(node)
            else:
                self._node(index, node, pool, set(prep.plans) | set(build_before))
            _apply_relabels(self.relabel, self.worker, units)
        for old_uid, new_uid in self.dag.renamed:  # units that stay as they are take their new plan's name
            if old_uid in units:
                units[new_uid] = units.pop(old_uid)
        for report in self.reports:  # a building node's report carries its build, made before its readers
            extra = self.build_stats.get(report.primitive)
            if extra is not None:
                report.in_place = True
                report.measured_s += extra.seconds
                report.local_copy_s += extra.seconds
                report.bytes_copied_locally += extra.copied
                report.bytes_remapped += extra.moved_bytes

    def _build(self, build: EarlyBuild) -> None:
        """``build`` made from its donor's pages, unless the donor is gone or the target exists."""
        if build.donor in self.units and build.target.uid not in self.units:
            made = self.built[build.donor] = build_early(build, self.units, self.dag, self.memo)
            self.build_stats[f"{self.dag.nodes[build.node].kind.value}#{build.node}"] = made

    def _fan_out(self, i: int) -> None:
        fan = self.prepared.fans[i]
        for report in run_fan_out(fan, self.groups[i], self.worker, self.units, self.channel, self.timeout_s):
            report.predicted_s = self.prepared.steps[int(report.primitive.split("#")[1])].predicted_s
            self.reports.append(report)
        self.carried.update(fan.nodes)

    def _check_restores(self) -> None:
        """Before any node runs: the checkpoint of every Restore node here is committed and holds its
        unit's model-stage (CheckpointError otherwise), so a restore never stops half-done on that."""
        for node in self.prepared.order:
            prim = self.dag.nodes[node]
            if isinstance(prim, Restore):
                self._reader(prim).check(prim.target)

    def _reader(self, prim: Restore) -> CheckpointReader:
        return self.readers.setdefault((prim.url, prim.tag), CheckpointReader(url=prim.url, tag=prim.tag))

    def _restore(self, node: int) -> None:
        """A Restore node: this worker's share of the unit, allocated and read from the checkpoint;
        nothing is stored if the read fails."""
        prim = self.dag.nodes[node]
        assert isinstance(prim, Restore)
        start = time.perf_counter()
        reader = self._reader(prim)
        state = allocate_unit(prim.target, self.worker, self.channel.device)
        read = reader.restore(state)
        self.units[prim.target.uid] = state
        predicted = self.prepared.predicted_s[node] if self.prepared.predicted_s is not None else 0.0
        self.reports.append(StepReport(
            model_stage=prim.target.model_stage, primitive=f"{prim.kind.value}#{node}", predicted_s=predicted,
            measured_s=time.perf_counter() - start, bytes_sent=0, bytes_received=0, bytes_copied_locally=0,
            peak_bucket_bytes=0, bytes_restored=read))

    def _in_place_plan(self, node: int) -> InPlace | None:
        """The node's in-place build if it still applies here (a unit missing or built already: None)."""
        plan = self.prepared.plans.get(node)
        if plan is None or plan.target.uid in self.units or plan.donor not in self.units \
                or self.units[plan.donor].flat.numel() < plan.target_bytes:
            return None
        return plan

    def _node(self, index: int, node: int, pool: BucketPool, building: set[int]) -> None:
        """A node that moves or copies bytes here (or, a Merge, relabels its parts first)."""
        prim, units, worker = self.dag.nodes[node], self.units, self.worker
        start = time.perf_counter()
        if isinstance(prim, Merge):
            for part in prim.parts:
                if part.final == prim.unit and part.holds(worker) and part.uid in units:
                    units[prim.unit.uid] = units.pop(part.uid)  # already in final shape: relabel
        plan = self._in_place_plan(node)
        # an in-place target is built once the last node reading its donor here is done
        later = {plan.target.uid} if plan is not None else set()
        if plan is not None:
            self.deferred.setdefault(plan.build_after, []).append(plan)
        allocated = _allocate_targets(prim, worker, units, self.channel.device, later)
        if node not in self.prepared.steps:
            return  # a relabelling Merge: handled by _apply_relabels
        step = self.prepared.steps[node]
        riders = _riders(self.dag, self.prepared.order[index + 1:], self.prepared.steps, worker, units, prim,
                         building) if _remote(step, worker) else []
        for rider in riders:
            allocated += _allocate_targets(self.dag.nodes[rider], worker, units, self.channel.device)
        moving = step if plan is None else replace(
            step, local=tuple(p for p in step.local if p.dst_worker != worker or p.dst_unit not in later))
        # local runs out of a donor nothing reads any more once this node's transfers are done: their
        # pages change buffers after them instead of being copied beside them
        moves = movable_pieces(self.dag, index, moving, worker, units, self.prepared.order,
                               self._kept_donors()) if plan is None and self.prepared.early else []
        if moves:
            moved_ids = {id(p) for p in moves}
            moving = replace(moving, local=tuple(p for p in moving.local if id(p) not in moved_ids))
        try:
            report, rider_s = run_step(moving, worker, self._resolve, self.channel, self.timeout_s,
                                       self.on_round, pool, [self.prepared.steps[r] for r in riders])
            for done in (node, *riders):
                self._build_deferred(done, report)
            for lent in lend_pages(moves, units) if moves else ():
                self.lent[lent.donor] = lent
                report.bytes_remapped += lent.moved_bytes
                report.bytes_copied_locally += lent.copied
                report.local_copy_s += lent.seconds
        except BaseException:
            for uid in allocated:  # half-filled: never mistake them for a surviving copy
                units.pop(uid, None)
            raise
        report.measured_s = time.perf_counter() - start - sum(rider_s)
        self.reports.append(report)
        self._free(node)
        for rider, seconds in zip(riders, rider_s):
            self._free(rider)
            self.reports.append(_rider_report(self.prepared.steps[rider], worker, seconds, step.primitive))
            self.carried.add(rider)

    def _kept_donors(self) -> set[str]:
        """Units whose bytes a planned early, in-place or broadcast build still reads."""
        prep = self.prepared
        return ({b.donor for b in prep.builds.values()} | {pl.donor for pl in prep.plans.values()}
                | {f.source.uid for f in prep.fans} | set(self.built))

    def _resolve(self, p: Piece, is_source: bool) -> RankState:
        return self.units[p.src_unit if is_source else p.dst_unit]

    def _build_deferred(self, done: int, report: StepReport) -> None:
        """The in-place builds waiting for node ``done``'s transfers."""
        for waiting in self.deferred.pop(done, []):
            if waiting.target.uid in self.units or waiting.donor not in self.units:
                continue  # not as planned here: the target was made otherwise
            copied, compact_s = build_in_place(waiting, self.worker, self.units)
            report.in_place = True
            report.bytes_copied_locally += copied
            report.local_copy_s += compact_s

    def _free(self, node: int) -> None:
        """Frees in the DAG's order, once every node that ran here is done reading."""
        for unit in self.dag.nodes[node].frees:
            if unit.holds(self.worker):
                self.units.pop(unit.uid, None)  # Destroy (or a Merge's parts): the buffer goes with it
                self.built.pop(unit.uid, None)  # an early build from it is final
                self.lent.pop(unit.uid, None)  # so are the pages moved out of it


def _rider_report(step: Step, worker: int, seconds: float, host: str) -> StepReport:
    return StepReport(model_stage=step.model_stage, primitive=step.primitive, predicted_s=step.predicted_s,
                      measured_s=seconds, bytes_sent=0, bytes_received=0,
                      bytes_copied_locally=sum(p.num_bytes for p in step.local if p.dst_worker == worker),
                      peak_bucket_bytes=0, local_copy_s=seconds, alongside=host)


def _apply_relabels(merges: list[Merge], worker: int, units: dict[str, RankState]) -> None:
    for merge in merges:
        mine = [p for p in merge.parts if p.holds(worker)]
        if mine and all(p.uid in units and p.final == merge.unit for p in mine):
            for part in mine:
                units[merge.unit.uid] = units.pop(part.uid)


def _allocate_targets(prim: Primitive, worker: int, units: dict[str, RankState],
                      device: torch.device, skip: set[str] | frozenset[str] = frozenset()) -> list[str]:
    allocated = [t.uid for t in prim.targets if t.holds(worker) and t.uid not in units and t.uid not in skip]
    for target in prim.targets:
        if target.uid in allocated:
            units[target.uid] = allocate_unit(target, worker, device)
    return allocated


def _remote(step: Step, worker: int) -> bool:
    return any(worker in (m.src_worker, m.dst_worker) for m in step.messages)


def _riders(dag: TransitionDAG, later: Sequence[int], steps: dict[int, Step], worker: int,
            units: dict[str, RankState], host: Primitive, building: set[int]) -> list[int]:
    """The local-only nodes right after a remote node in ``worker``'s order that may run while its
    transfers are in flight: they move nothing between workers, read only units this worker already
    holds whole (none the remote node writes), build nothing in place or early, and relabel no part.
    Their targets are then allocated one node early (the transient cost of overlapping them: one
    node's targets beside the buckets); their frees still wait until the remote node is done reading."""
    written = {t.uid for t in host.targets}
    out: list[int] = []
    for node in later:
        prim = dag.nodes[node]
        step = steps.get(node)
        if step is None or _remote(step, worker) or not any(p.dst_worker == worker for p in step.local):
            break
        if node in building:
            break  # it overwrites its donor, which the remote node may still be reading
        if isinstance(prim, Merge) and any(p.final == prim.unit and p.holds(worker) for p in prim.parts):
            break
        reads = {p.src_unit for p in step.local if p.dst_worker == worker}
        if not reads <= set(units) or reads & written:
            break
        if any(t.holds(worker) and t.uid in units for t in prim.targets):
            break  # a target already exists here (written by an earlier node): keep the DAG's order
        written |= {t.uid for t in prim.targets}
        out.append(node)
    return out
