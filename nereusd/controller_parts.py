"""What the job controller's parts (nereusd.controller_orders, nereusd.controller_drain) read and
write of it: its state, declared here for the type checker, and the few helpers of
nereusd.controller.JobController they call. Declarations only: JobController sets and defines them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nereusd.metrics import Metrics
from nereusd.plan_records import PlannerPort
from nereusd.store import Store
from nereusd.wire import protocol
from planner.plan import GlobalPlan


class ControllerState:
    """The controller's state its parts share (see JobController.__init__ for what each one means)."""

    job_id: str
    store: Store
    metrics: Metrics
    planner: PlannerPort | None
    log: Any
    clock: Callable[[], float]
    send_order: Callable[[str, protocol.TransitionOrder], bool]
    release_nodes: Callable[[list[str]], None] | None
    plan: GlobalPlan | None
    prediction: Any
    _pending_prediction: Any
    pool: frozenset[int]
    pool_dirty: bool
    pool_changed_at: float
    gpu_owner: dict[int, str]
    gpus_per_node: int
    draining: dict[str, str]
    _release_asked: set[str]
    urgent_reasons: list[str]
    failed_in_row: int
    retry_at: float
    _orders: dict[int, dict[str, protocol.TransitionOrder]]

    if TYPE_CHECKING:  # JobController's helpers
        @property
        def job(self) -> dict[str, Any]: ...

        def _set_state(self, state: str, reason: str) -> None: ...

        def _refresh_pool(self) -> None: ...

        def _save(self) -> None: ...

        def _participants(self) -> frozenset[int]: ...

        def _spec_now(self) -> dict[str, Any]: ...

        def _node_of_gpu(self, gpu: int) -> str: ...

        def _predict(self, plan: GlobalPlan) -> Any | None: ...
