"""Binds the controller's PlannerPort to planner/ (search, prediction, calibration) and transitions/
(global DAG, cost). Pure parts only: no torch.

A job spec (stored with the job) names presets and the workload:

    {"model": "tiny-3m", "algo": "grpo", "device": "cpu", "gpus_per_node": 2,
     "workload": {"prompts_per_step": 8, "prompt_tokens": 32, "response_tokens": 64}}

(``model`` may instead be an architecture object, planner.hf_config.model_to_mapping of a HF directory's
config.json.)

GPU ids are the controller's: node rank * gpus_per_node + device index, so the cluster handed to the
planner has as many nodes as the highest node rank in the pool (lost nodes are simply absent).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from nereusd.controller import TransitionSketch
from nereusd.wire import protocol
from planner import admission
from planner.errors import InfeasibleError, SpecError
from planner.hardware import ClusterSpec, cluster_preset
from planner.hf_config import model_from_mapping
from planner.models import model_preset
from planner.plan import GlobalPlan
from planner.transition_calibration import TransitionCalibrator, TransitionSample
from planner.workflow import JobSpec, Workload, same_model_job, without_old_logprob_pass, workflow_preset

if TYPE_CHECKING:  # the DAG's type only: transitions is imported where a transition is built
    from transitions.dag_record import TransitionDAG

PREDICTIONS_KEPT = 8  # the binding's memo of recent predictions (see PlannerBinding.predict)
# the start-up warm-up stops starting new work past this (issue 17: reported, < 1 s; the step under
# way when it runs out still finishes, so the margin)
WARM_UP_BUDGET_S = 0.8
WARM_PP = 16  # the deepest pipeline whose rank-table factors the warm-up derives (_warm_rank_factors)
SPEC_KEYS = ("model", "algo", "device", "gpus_per_node", "workload", "learned_reward", "old_logprob_pass", "elastic")


@lru_cache(maxsize=256)
def _job(spec_json: str) -> JobSpec:
    spec = json.loads(spec_json)
    unknown = sorted(set(spec) - set(SPEC_KEYS))
    if unknown:
        raise SpecError("job.spec", f"unknown keys {unknown}", ", ".join(SPEC_KEYS))
    for key in ("model", "algo", "workload"):
        if key not in spec:
            raise SpecError(f"job.spec.{key}", "is required to plan the job")
    model = spec["model"]
    model = model_preset(model) if isinstance(model, str) else model_from_mapping(model, "job.spec.model")
    workflow = workflow_preset(spec["algo"], bool(spec.get("learned_reward", True)))
    if spec.get("old_logprob_pass") is False:  # the engine reuses the rollout's log-probs (no extra forward)
        workflow = without_old_logprob_pass(workflow)
    return same_model_job(workflow, model, Workload(**spec["workload"]))


def job_spec(spec: dict[str, Any]) -> JobSpec:
    return _job(json.dumps(spec, sort_keys=True))


def cluster_for(spec: dict[str, Any], pool: frozenset[int]) -> ClusterSpec:
    per_node = int(spec.get("gpus_per_node") or 1)
    nodes = max(pool) // per_node + 1 if pool else 1
    return cluster_preset(str(spec.get("device", "cpu")), nodes * per_node, gpus_per_node=per_node)


class PlannerBinding:
    """The controller's PlannerPort over the real planner and transition layer."""

    def __init__(self) -> None:
        from transitions.planning_cache import PlanningCache  # stdlib only: cheap at start

        self.efficiency: dict[str, Any] = {}  # job spec without workload -> fitted per-op-class efficiencies
        # transition key (spec without workload) -> measured/predicted L_tran correction
        self.transition_calibration: dict[str, TransitionCalibrator] = {}
        # every DAG this daemon builds (all its jobs' controllers share the binding) memoises here:
        # replanning the same job again costs lookups; bounded, so it lives as long as the daemon
        self.planning_cache = PlanningCache()
        # (spec, cluster as one node, plan, efficiencies) -> prediction, recent ones (PlannerBinding.predict)
        self._predictions: OrderedDict[tuple[object, ...], Any] = OrderedDict()

    def warm_up(self, budget_s: float = WARM_UP_BUDGET_S,
                running: Iterable[tuple[dict[str, Any], GlobalPlan]] = ()) -> dict[str, float]:
        """Run at daemon start-up, before serving (nereusd.daemon), within ``budget_s``: import every
        module a decision reaches (numpy, search, DAG, cost, calibration, alternatives); one small
        decision end to end (search, a transition DAG and its cost on a tiny CPU job: every code path's
        lazy set-up); then, job by job while time is left, what any next decision of a ``running``
        job reads whatever it decides (``_warm_job``). Returns the ms of each step (what the daemon
        logs). Every memo it fills is a value memo: no decision depends on what it did."""
        t0 = time.perf_counter()
        deadline = t0 + budget_s
        import planner.alternatives  # noqa: F401
        import planner.calibration  # noqa: F401  (the first measurement's fit)
        import planner.prediction  # noqa: F401
        import planner.search  # noqa: F401
        import transitions.cost  # noqa: F401
        import transitions.global_dag  # noqa: F401
        import transitions.rank_table  # noqa: F401

        took = {"imports_ms": round((time.perf_counter() - t0) * 1e3, 1)}
        if time.perf_counter() - t0 < budget_s / 2:
            t1 = time.perf_counter()
            spec = {"model": "tiny-3m", "algo": "grpo", "device": "cpu", "gpus_per_node": 2,
                    "workload": {"prompts_per_step": 8, "prompt_tokens": 32, "response_tokens": 64}}
            pool = frozenset(range(4))
            old = self.search(spec, frozenset(range(2)), 1).plan
            new = self.search(spec, pool, 2).plan
            sketch = self.transition(spec, old, new, pool, lambda g: f"n{g // 2}")
            if sketch.detail is not None:  # the record's body too (the expansion's and to_dict's set-up)
                sketch.detail()
            took["small_decision_ms"] = round((time.perf_counter() - t1) * 1e3, 1)
        plans = ranks = 0
        spent = dict.fromkeys(("running_plans_ms", "running_tables_ms", "running_factors_ms"), 0.0)
        for spec, plan in running:
            done, n = self._warm_job(spec, plan, deadline, spent)
            ranks += n
            if not done:
                break
            plans += 1
        if ranks:
            took.update(running_plans=plans, running_ranks=ranks,
                        **{k: round(v * 1e3, 1) for k, v in spent.items() if v})
        return took

    def _warm_job(self, spec: dict[str, Any], plan: GlobalPlan, deadline: float,
                  spent: dict[str, float]) -> tuple[bool, int]:
        """What any next decision of a job running ``plan`` reads, whatever its target: the geometry of
        the plan's unit ranks (the old side of every transition away from it: ``_warm_geometry``);
        the planner's tables at its pool (a search and a prediction for today's workload: the model's
        and the cluster's per-layout memos, which a search for any other workload reads again); and
        the rank-table factors of every TP and PP degree the search may pick for its units
        (``_warm_rank_factors``: what the target side's tables are made of). Each step starts only
        before ``deadline``; adds the seconds of each to ``spent``; (all done, ranks done)."""
        t = time.perf_counter()
        done, ranks = _warm_geometry(spec, plan, deadline)
        spent["running_plans_ms"] += time.perf_counter() - t
        if not done or time.perf_counter() > deadline:
            return False, ranks
        t = time.perf_counter()
        pool = frozenset(plan.gpus)
        try:  # the result is dropped, only the memos stay; a job its pool cannot hold plans nothing here
            self.search(spec, pool, plan.version + 1)
            self.predict(spec, pool, plan)
        except (InfeasibleError, SpecError):
            pass
        spent["running_tables_ms"] += time.perf_counter() - t
        if time.perf_counter() > deadline:
            return False, ranks
        t = time.perf_counter()
        _warm_rank_factors(spec, len(pool))
        spent["running_factors_ms"] += time.perf_counter() - t
        return True, ranks

    def _eff(self, spec: dict[str, Any]) -> Any:
        from planner.cost import PRIORS

        return self.efficiency.get(_efficiency_key(spec), PRIORS)

    def check_spec(self, job: dict[str, Any]) -> None:
        """Refuse (SpecError naming the field) a spec whose presets do not resolve or do not fit together,
        before the daemon stores it: a stored job must always be plannable."""
        try:
            job_spec(job)
            cluster_for(job, frozenset({0}))
        except SpecError as exc:
            raise SpecError(f"spec.{exc.field}", str(exc).removeprefix(f"{exc.field}: ")) from None
        except (KeyError, TypeError, ValueError) as exc:
            raise SpecError("spec", f"cannot be planned: {type(exc).__name__}: {exc}") from None

    def search(self, job: dict[str, Any], pool: frozenset[int], version: int) -> admission.Candidate:
        from planner.search import search

        cluster, eff = cluster_for(job, pool), self._eff(job)
        res = search(job_spec(job), cluster, pool=sorted(pool), eff=eff, version=version)
        self._keep_prediction(_prediction_key(job, cluster, res.plan, eff), res.prediction)
        return admission.Candidate(plan=res.plan, prediction=res.prediction)

    def predict(self, job: dict[str, Any], pool: frozenset[int], plan: GlobalPlan) -> Any | None:
        """The plan's prediction, memoised on all it is made of: the controller predicts the running plan
        after each calibration and again when it decides (the same inputs: one predict), and a plan the
        search found is predicted by the search (a later pool change finds it: nodes joining change
        only the cluster's node count, which no prediction reads)."""
        from planner.prediction import predict

        cluster, eff = cluster_for(job, pool), self._eff(job)
        key = _prediction_key(job, cluster, plan, eff)
        pred = self._predictions.get(key)
        if pred is None:
            pred = predict(job_spec(job), cluster, plan, eff)
        self._keep_prediction(key, pred)
        return pred if pred.feasible else None

    def _keep_prediction(self, key: tuple[object, ...], pred: Any) -> None:
        self._predictions[key] = pred
        self._predictions.move_to_end(key)
        while len(self._predictions) > PREDICTIONS_KEPT:
            self._predictions.popitem(last=False)

    def calibrate(self, job: dict[str, Any], measurement: protocol.Measurement, plan: GlobalPlan) -> None:
        """One calibration step from the step's measured model-stage times; the fitted efficiencies
        (carrying their calibrator state) are used by the next search and prediction of this job."""
        from planner.calibration import fit_from_stage_times

        key = _efficiency_key(job)
        cluster, previous = cluster_for(job, plan.gpus), self.efficiency.get(key)
        # the plan under the efficiencies of before: what the last re-prediction of the running plan was
        predicted = self._predictions.get(_prediction_key(job, cluster, plan, self._eff(job)))
        self.efficiency[key] = fit_from_stage_times(job_spec(job), plan, measurement.stage_times_s, previous,
                                                    cluster=cluster, step_latency_s=measurement.step_latency_s,
                                                    predicted=predicted)

    def observe_transition(self, job: dict[str, Any], transition: dict[str, Any]) -> None:
        """Feed one completed transition (its store row) into the job's L_tran correction. The row's
        predicted_s is already corrected, so the model's own figure is read back from the summary that
        transition() stored (rows without one, e.g. initial placement, predicted the raw figure)."""
        model_s = (transition.get("dag") or {}).get("l_tran", {}).get("model_s", transition.get("predicted_s"))
        sample = TransitionSample(model_s=float(model_s if model_s is not None else 0.0),
                                  measured_s=float(transition.get("measured_s") or 0.0),
                                  bytes_moved=int(transition.get("bytes_moved") or 0),
                                  transition_id=transition.get("id"))
        key = _transition_key(job)
        self.transition_calibration[key] = self.transition_calibration.get(key, TransitionCalibrator()).observe(sample)

    def alternatives(self, job: dict[str, Any], pool: frozenset[int], version: int, best: GlobalPlan,
                     error: InfeasibleError | None) -> Iterator[admission.Candidate]:
        """The next reachable plans after ``best`` (planner.alternatives: fastest first, each leaving more
        memory free for the transition's transient state), lazily. None when ``error`` says no plan can
        be reached at all (the last copy of some state is gone: only the checkpoint has it)."""
        return self._alternatives(job_spec(job), cluster_for(job, pool), pool, self._eff(job), version, best, error)

    @staticmethod
    def _alternatives(job: JobSpec, cluster: ClusterSpec, pool: frozenset[int], eff: Any, version: int,
                      best: GlobalPlan, error: InfeasibleError | None) -> Iterator[admission.Candidate]:
        from planner.alternatives import next_plans
        from transitions.local_dag import LastCopyLostError

        if isinstance(error, LastCopyLostError):
            return
        for alt in next_plans(job, cluster, sorted(pool), eff, version, offered=(best,)):
            yield admission.Candidate(plan=alt.plan, prediction=alt.prediction, note=alt.note)

    def transition(self, job: dict[str, Any], old: GlobalPlan | None, new: GlobalPlan, pool: frozenset[int],
                   node_of_gpu: Callable[[int], str]) -> TransitionSketch:
        from transitions.cost import transition_cost
        from transitions.global_dag import build_transition

        if old is None:  # initial placement: units are built from the job's initial weights, nothing moves
            parts: dict[str, dict[str, Any]] = {}
            for gpu in sorted(new.gpus):
                parts.setdefault(node_of_gpu(gpu), {"gpus": []})["gpus"].append(gpu)
            initial = {"kind": "initial-placement", "new_version": new.version,
                       "units": {s.model_stage: f"{len(s.gpu_sets)} x {s.layout}" for s in new.stages}}
            return TransitionSketch(predicted_s=0.0, bytes_moved=0, dag=initial, parts=parts)
        everything = pool | new.gpus | old.gpus
        cluster = cluster_for(job, everything)
        dag = build_transition(job_spec(job), cluster, old, new, lost_gpus=old.gpus - pool,
                               cache=self.planning_cache)
        cost = transition_cost(dag, cluster)
        parts = _parts(dag, sorted(new.gpus | (old.gpus & pool)), node_of_gpu)
        # The record's head, what the decision and the order need; its unit-level body (every primitive,
        # edge and unit: hundreds of KB at 1,024 GPUs) is derived by ``detail``, after the orders are sent.
        summary: dict[str, Any] = {"kind": "transition", "old_version": dag.old_version,
                                   "new_version": dag.new_version, "capacity_bytes": dag.capacity_bytes,
                                   "bytes_moved": dag.bytes_moved, "num_nodes": dag.num_nodes,
                                   "primitives": _primitive_counts(dag)}
        summary["cost"] = cost.to_dict()  # the model's figures, uncorrected
        correction = self.transition_calibration.get(_transition_key(job), TransitionCalibrator())
        summary["l_tran"] = correction.explain(cost.seconds)
        return TransitionSketch(predicted_s=summary["l_tran"]["corrected_s"], bytes_moved=dag.bytes_moved,
                                dag=summary, parts=parts, detail=dag.to_dict)


def _warm_geometry(spec: dict[str, Any], plan: GlobalPlan, deadline: float) -> tuple[bool, int]:
    """Derive the buffer tables (boxes, slot offsets: transitions.rank_table, what a transition's covers
    and pieces read of its units) and bytes of every unit rank of ``plan`` (memoised by value): (all
    done before ``deadline`` (perf_counter), ranks done)."""
    from transitions.emu import job_states
    from transitions.local_dag import plan_units
    from transitions.rank_table import unit_table

    states = job_states(job_spec(spec))
    ranks = 0
    for sp in plan.stages:
        for unit in plan_units(states[sp.model_stage], sp, plan.version)[:1]:  # replicas share the geometry
            for gpu in unit.gpus:
                if time.perf_counter() > deadline:
                    return False, ranks
                unit_table(unit, gpu)
                unit.bytes_on(gpu)
                ranks += 1
    return True, ranks


def _warm_rank_factors(spec: dict[str, Any], num_gpus: int) -> None:
    """The per-TP-rank boxes and slot sizes and the per-PP-rank holdings (transitions.rank_table's
    factors of every rank table) of each of the job's (model, head, kinds), for every TP and PP degree
    planner.options may give a unit on ``num_gpus`` GPUs (PP up to WARM_PP: 2 * 16 - 1 entries per
    model and head keep two jobs' factors well inside _stage_holds' 256): a transition's target ranks
    build their tables from these (about half a cold table's time), whatever layouts the search picks.
    Memoised by value (lru_cache)."""
    from planner.plan import power_of_two_upto
    from transitions import rank_table as rt
    from transitions.emu import job_states

    per_node = int(spec.get("gpus_per_node") or 1)
    for model, head, kinds in dict.fromkeys((s.model, s.head, s.kinds) for s in job_states(job_spec(spec)).values()):
        for tp in power_of_two_upto(min(per_node, num_gpus)):
            if model.valid_tp(tp):
                for r in range(tp):
                    rt._tp_boxes(model, head, tp, r)
                    rt._tp_sizes(model, head, tp, r, kinds)
        for pp in power_of_two_upto(min(model.num_layers, num_gpus, WARM_PP)):
            for r in range(pp):
                rt._stage_holds(model, head, pp, r)


def _parts(dag: TransitionDAG, gpus: list[int], node_of_gpu: Callable[[int], str]) -> dict[str, dict[str, Any]]:
    """Each node's part: its GPUs, and the ids of the DAG nodes that touch any of them (from the DAG's
    replica classes where it has them: no unit-level expansion)."""
    owners = list(map(node_of_gpu, gpus))
    names = list(dict.fromkeys(owners))  # nodes in order of their first GPU
    parts: dict[str, dict[str, Any]] = {node: {"gpus": [], "dag_nodes": []} for node in names}
    index = {node: k for k, node in enumerate(names)}
    for gpu, node in zip(gpus, owners):
        parts[node]["gpus"].append(gpu)
    group_of = {gpu: index[node] for gpu, node in zip(gpus, owners)}
    for k, ids in dag.ids_by_group(group_of).items():
        parts[names[k]]["dag_nodes"] = ids
    return parts


def _primitive_counts(dag: TransitionDAG) -> dict[str, int]:
    """How many primitives of each kind, from the replica classes where the DAG has them."""
    if not dag.expanded and dag.replicas is not None:
        counts: dict[str, int] = {}
        for c in dag.replicas.classes:
            counts[c.kind.value] = counts.get(c.kind.value, 0) + c.size
        return dict(sorted(counts.items()))
    return dict(sorted(_count(p.kind.value for p in dag.nodes).items()))


def _prediction_key(spec: dict[str, Any], cluster: ClusterSpec, plan: GlobalPlan, eff: Any) -> tuple[object, ...]:
    """Everything a prediction is made of, by value: the spec, the cluster as one node (planner.prediction
    reads the device, links, node size and overhead, never the node count), the plan and the efficiencies."""
    return json.dumps(spec, sort_keys=True), replace(cluster, num_nodes=1), plan, eff


def _transition_key(spec: dict[str, Any]) -> str:
    """Transition speed depends on the model, the devices and the data channel, not on sequence lengths:
    the correction survives workload drift (which changes the efficiency key) and is learned per job spec."""
    return json.dumps({k: v for k, v in spec.items() if k != "workload"}, sort_keys=True)


def _efficiency_key(spec: dict[str, Any]) -> str:
    """Efficiencies are per op class of a model on a device (PAPER.md: one per class, reused as shapes
    change), so they are learned across workload drift: keyed by the spec without its workload (keyed
    with it, every new measured length started again from the priors)."""
    return _transition_key(spec)


def _count(kinds: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for k in kinds:
        out[k] = out.get(k, 0) + 1
    return out
