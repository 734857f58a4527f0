"""From the workers a source names to router operations, for one pool.

Theory of operation: :class:`Reconciler` remembers what it has applied to the
router for one pool (each worker it added, and whether it let it take work)
and :meth:`~Reconciler.plan` compares that with the workers the source names
now, in a pure step:

======================================  ==========================================
source says                             operations
======================================  ==========================================
a new worker, ready                     add it
a new worker, not ready or terminating  nothing (it is added once ready)
a known worker, gone                    remove it (what it still holds is cancelled)
a known id, another pod or address      remove the old, add the new when ready
ready -> not ready or terminating       drain (no new work; what it holds finishes)
not ready or terminating -> ready       resume
======================================  ==========================================

:meth:`~Reconciler.apply` carries a plan out on a
:class:`~epd_actors.discovery.base.WorkerSink`.  An operation the router
refuses (``ConfigError``: a worker id another pool already has) is logged and
skipped, and the plan's next step goes on; the refused worker is not recorded,
so the next change tries it again.  Only workers this reconciler drained are
resumed by it: an operator's drain (admin API) of a discovered worker stays.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.config import WorkerEndpoint
from ..errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Mapping

    from .base import WorkerSink
    from .endpoints import DiscoveredWorker

logger = logging.getLogger(__name__)


class Action(enum.Enum):
    ADD = "add"
    DRAIN = "drain"
    RESUME = "resume"
    REMOVE = "remove"


@dataclass(frozen=True, slots=True)
class Operation:
    action: Action
    worker: DiscoveredWorker


@dataclass(slots=True)
class _Applied:
    worker: DiscoveredWorker
    taking_work: bool


class Reconciler:
    """What one pool's discovery has applied, and the steps to the next view.

    Args:
        stage: the pool's stage.
        model: the pool's model (None: the router's default).
        backend: the backend kind of the workers it adds.
        label: how logs name the pool.
    """

    def __init__(
        self, stage: str, model: str | None, backend: str, *, label: str | None = None
    ) -> None:
        self.stage = stage
        self.model = model
        self.backend = backend
        self.label = label or stage
        self._applied: dict[str, _Applied] = {}

    @property
    def workers(self) -> dict[str, bool]:
        """Each worker applied, by id: whether it takes new work."""
        return {wid: applied.taking_work for wid, applied in self._applied.items()}

    def plan(self, wanted: Mapping[str, DiscoveredWorker]) -> list[Operation]:
        """The operations from what is applied to ``wanted`` (pure; see the module docstring)."""
        ops: list[Operation] = []
        for worker_id, applied in self._applied.items():
            now = wanted.get(worker_id)
            if now is None or not now.same_instance(applied.worker):
                ops.append(Operation(Action.REMOVE, applied.worker))
        for worker_id, now in wanted.items():
            applied_entry = self._applied.get(worker_id)
            if applied_entry is None or not now.same_instance(applied_entry.worker):
                if now.state.eligible:
                    ops.append(Operation(Action.ADD, now))
            elif applied_entry.taking_work and not now.state.eligible:
                ops.append(Operation(Action.DRAIN, now))
            elif not applied_entry.taking_work and now.state.eligible:
                ops.append(Operation(Action.RESUME, now))
        return ops

    async def apply(self, sink: WorkerSink, wanted: Mapping[str, DiscoveredWorker]) -> int:
        """Carry out :meth:`plan` on ``sink``; returns how many operations took effect.

        Cancellation: each operation is applied whole or not at all (only
        ``add_worker`` awaits: it starts the worker's connection); what is
        recorded matches what the router did.
        """
        done = 0
        for op in self.plan(wanted):
            worker = op.worker
            try:
                await self._one(sink, op)
            except ConfigError as exc:
                logger.error(
                    "discovery of pool %s: cannot %s worker %s: %s",
                    self.label,
                    op.action.value,
                    worker.worker_id,
                    exc,
                )
                continue
            done += 1
            logger.info(
                "discovery of pool %s: %s worker %s (%s, %s)",
                self.label,
                op.action.value,
                worker.worker_id,
                worker.address,
                worker.state.value,
            )
        return done

    async def _one(self, sink: WorkerSink, op: Operation) -> None:
        worker = op.worker
        if op.action is Action.ADD:
            endpoint = WorkerEndpoint(
                worker.worker_id,
                worker.address,
                self.backend,
                worker.kv_events_endpoint,
                worker.kv_events_replay_endpoint,
            )
            await sink.add_worker(self.stage, endpoint, model=self.model)
            self._applied[worker.worker_id] = _Applied(worker, taking_work=True)
        elif op.action is Action.REMOVE:
            # Recorded as gone first: the router no longer has it either way.
            del self._applied[worker.worker_id]
            sink.remove_worker(worker.worker_id)
        elif op.action is Action.DRAIN:
            sink.drain_worker(worker.worker_id)
            self._applied[worker.worker_id] = _Applied(worker, taking_work=False)
        else:
            sink.resume_worker(worker.worker_id)
            self._applied[worker.worker_id] = _Applied(worker, taking_work=True)
