"""Why nothing fits: per model-stage lower bounds of per-GPU memory, and how many bytes over.

Used when the search (urgent options included) finds no plan. Bounds use the most sharded unit that fits
the pool, one sequence per micro-batch and recomputation for training, so "needs at least" is honest.
"""

from __future__ import annotations

from planner.errors import InfeasibleError
from planner.hardware import ClusterSpec
from planner.memory import peak_total, resident_bytes, transient_bytes
from planner.plan import Layout, power_of_two_upto
from planner.workflow import JobSpec, ModelStage, StageKind


def _bounds(job: JobSpec, ms: ModelStage, n: int) -> tuple[int, int, int, Layout | None]:
    """(smallest own peak, smallest resident, smallest transient, layout of the smallest resident)."""
    model = job.model_of(ms)
    own = res = trans = None
    best_layout = None
    for tp in power_of_two_upto(n):
        if not model.valid_tp(tp):
            continue
        for pp in power_of_two_upto(min(model.num_layers, n // tp)):
            layout = Layout(tp, pp)
            r = resident_bytes(model, ms, layout).total_bytes
            t = transient_bytes(model, ms, layout, job.workload, 1, 1, ms.kind is StageKind.TRAINING).total_bytes
            p = peak_total(r, t)
            own = p if own is None else min(own, p)
            if res is None or r < res:
                res, best_layout = r, layout
            trans = t if trans is None else min(trans, t)
    return own or 0, res or 0, trans or 0, best_layout


def _partitions(items: list[str]) -> list[list[list[str]]]:
    if not items:
        return [[]]
    out = []
    for part in _partitions(items[1:]):
        out += [part[:i] + [[items[0]] + part[i]] + part[i + 1:] for i in range(len(part))]
        out.append([[items[0]]] + part)
    return out


def explain_infeasible(job: JobSpec, cluster: ClusterSpec, n: int) -> InfeasibleError:
    capacity = cluster.device.memory_bytes
    gb = 1e9
    bounds = {ms.name: _bounds(job, ms, n) for ms in job.workflow.model_stages}
    reasons = []
    for name, (own, _r, _t, _l) in bounds.items():
        if own > capacity:
            reasons.append(f"{name}: needs at least {own / gb:.1f} GB per GPU even alone on {n} GPUs, "
                           f"{(own - capacity) / gb:.1f} GB ({own - capacity} bytes) over the "
                           f"{capacity / gb:.0f} GB of a {cluster.device.name}")
    if not reasons:
        # every model-stage fits alone, but a GPU holds one resident model-stage per wave of every stage:
        # per stage, the best split into waves (a wave of k members gets at most n // k GPUs each)
        resident = 0
        parts = []
        for kind in sorted(StageKind, key=lambda k: k.order):
            members = [ms.name for ms in job.workflow.by_kind(kind)]
            if not members:
                continue
            best_sum, best_desc = None, ""
            for part in _partitions(members):
                if any(n // len(wave) == 0 for wave in part):
                    continue  # a wave of more members than GPUs cannot run (it priced them at 0 bytes)
                total, desc = 0, []
                for wave in part:
                    share = n // len(wave)
                    worst = max(wave, key=lambda m: _bounds(job, job.workflow.stage(m), share)[1])
                    r, layout = _bounds(job, job.workflow.stage(worst), share)[1:4:2]
                    total += r
                    desc.append(f"{worst} {r / gb:.1f} GB ({layout})")
                if best_sum is None or total < best_sum:
                    best_sum, best_desc = total, " + ".join(desc)
            resident += best_sum or 0
            parts.append(best_desc)
        need = peak_total(resident, max(b[2] for b in bounds.values()))
        if need > capacity:
            reasons.append(f"{max(bounds, key=lambda m: bounds[m][1])}: with every stage's resident state "
                           f"({'; '.join(parts)}) a GPU needs at least {need / gb:.1f} GB, "
                           f"{(need - capacity) / gb:.1f} GB ({need - capacity} bytes) over the "
                           f"{capacity / gb:.0f} GB of a {cluster.device.name}")
        else:
            reasons.append(f"the model-stages' resident state and GPU budgets do not combine on {n} GPUs "
                           f"of {capacity / gb:.0f} GB (lower bound {need / gb:.1f} GB per GPU)")
    return InfeasibleError(f"no plan fits in memory on {n} x {cluster.device.name}", tuple(reasons))
