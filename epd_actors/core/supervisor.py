"""The supervisor: owns the stage actors, plans requests, drives their pipelines.

Theory of operation
-------------------
*Actors.*  One actor per configured pool, built from the stage registry.  Each
runs under :meth:`Supervisor._keep_running`, which restarts a crashed actor
after a doubling backoff and counts the restart; the actor's inbox survives,
so only the jobs the actor held fail (with ``ActorCrashed``).

*Planning.*  Every pool serves one model, and each model's pools form its
topology.  A request's ``model`` resolves, through the
:class:`~.models.ModelCatalog`, to a model and possibly a LoRA adapter
(``ModelNotFound`` otherwise); its plan is that model's actors, in their
class ``order``, whose ``applies_to`` accepts the request (a text-only
request skips encode), and its stage requests carry the adapter.  Exactly
one stage of each model produces the output, and every stage's ``requires``
must be configured for the same model; this is checked once, at start-up.
Nothing here branches on a stage's or a model's name.  A plan
with a stage whose pool has no usable worker (none connected and ready, or
every breaker open) fails at once with that pool's ``NoHealthyWorker``,
before any stage runs; workers that are merely busy do not count.

*Pipelines.*  :meth:`Supervisor.generate` runs one request in a task of its own
under one cancel scope with the request's deadline.  For each stage in the
plan it submits one job per item the actor splits the context into (fan-out
runs concurrently) and folds each job's one reply, its ``StageOutput``, into
the context (a ``StageFailure`` fails the stage; anything else on a reply, such
as a ``Delta``, is an actor bug: ``InternalError``).  The output stage's job
puts its deltas on the caller's event channel itself, through an
:class:`~.output_relay.OutputRelay`, under the inter-token timeout the
supervisor keeps on the relay's behalf (the first-token deadline belongs to
each attempt, in the actor, so that a hung decoder's job moves elsewhere).
Every request ends with exactly one final event: ``DoneEvent`` (after a
``UsageEvent``) or ``ErrorEvent``.

*Hand-offs refused.*  A stage that refuses what an earlier stage handed it
(D refusing P's KV handle: ``HandoffRejected``) is not retried where it
failed.  The fault is the producing worker's: its breaker is charged, the
compensation of the refused handle is run once (and dropped), and the
pipeline resumes at the producing stage, avoiding every worker whose handle
was refused, then runs the stages after it again -- at most
``retry.max_attempts`` hand-offs per request, inside the request deadline.

*Remembered results gone.*  A stage may skip items whose result it remembers
from earlier requests (:meth:`BaseActor.recall`: encode, with encoder-output
reuse on).  When a later stage then fails because such a result is gone (P
refusing with ``missing_encoder_cache``), the earlier stages name the items to
run again (:meth:`BaseActor.redo`); the supervisor runs exactly those, then
the failed stage once more -- once per request, and only before any output.
An item another request is producing right now may be waited for instead of
produced again (:meth:`BaseActor.share`: encode, with reuse on; bounded by the
stage's attempt timeout, after which the waiter produces it itself).

*Cancellation.*  The caller leaving, the deadline, or router shutdown cancels
the pipeline; every job still running is cancelled, and each backend aborts
its worker-side work (shielded, bounded).  Compensations registered by finished
stages (P's KV release) run, shielded and bounded, whenever a request does not
complete -- so a handle P produced is released if D never consumed it.
"""

from __future__ import annotations

import logging
import random
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Protocol

import trio

from .._groups import single_exception
from ..errors import (
    ActorCrashed,
    ConfigError,
    EpdError,
    HandoffRejected,
    InternalError,
    ModelNotFound,
    Overloaded,
    RequestCancelled,
    StageTimeout,
)
from ..handoff import HandoffReceiver, HandoffSender, open_handoff
from ..limits import REQUEST_EVENT_BUFFER
from ..protocol import Usage
from ..request import (
    DoneEvent,
    ErrorEvent,
    GenerationEvent,
    GenerationRequest,
    RequestTimings,
    UsageEvent,
    worker_request_id,
)
from .actors import STAGE_ACTORS, BaseActor, StageContext, StageFailure, StageOutput
from .actors.registry import actor_class
from .config import ActorLimits, AdmissionLimits, Deadlines
from .lifecycle import Lifecycle, Phase
from .models import ModelCatalog
from .output_relay import OutputRelay
from .retry import RetryPolicy
from .token_gaps import TokenGaps

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Mapping

    from .actors.jobs import Compensation, Job, StageEvent
    from .encoder_cache import EncoderCache
    from .models import ModelRoute
    from .pool import WorkerPool
    from .tracing import RequestTrace, RequestTracing

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SupervisorStatistics:
    """Counters of the supervisor."""

    requests_in_flight: int
    requests_total: int
    requests_failed: int
    requests_cancelled: int
    requests_refused: int
    actor_restarts: dict[str, int]
    compensations_run: int


@dataclass(frozen=True, slots=True)
class _Handoff:
    """Who produced the KV hand-off a request carries, and what undoes it."""

    actor: BaseActor
    worker_id: str | None
    compensations: list[Compensation]


@dataclass(slots=True)
class _RequestRecord:
    """Per-request bookkeeping: lifecycle, timings, output so far, compensations."""

    request: GenerationRequest
    received_at: float
    lifecycle: Lifecycle = field(default_factory=Lifecycle)
    stage_times: dict[str, float] = field(default_factory=dict)
    queue_wait_s: float = 0.0
    workers: dict[str, tuple[str, ...]] = field(default_factory=dict)
    first_token_at: float | None = None
    completion_tokens: int = 0
    token_gaps: TokenGaps = field(default_factory=TokenGaps)
    model: str | None = None  # the configured model the request resolved to
    finish_reason: str | None = None
    usage: Usage | None = None
    compensations: list[Compensation] = field(default_factory=list)
    error: EpdError | None = None
    handoff: _Handoff | None = None  # the stage output the context's KV params came from
    refused: list[str] = field(default_factory=list)  # workers whose hand-off was refused
    refusal: HandoffRejected | None = None  # the latest refusal, while its stage runs again
    redone: bool = False  # remembered results were found gone and produced again
    trace: RequestTrace | None = None  # the request's spans, when the router traces

    def timings(self) -> RequestTimings:
        now = trio.current_time()
        ttft = None if self.first_token_at is None else self.first_token_at - self.received_at
        return RequestTimings(
            queue_wait_s=self.queue_wait_s,
            stages=dict(self.stage_times),
            ttft_s=ttft,
            total_s=now - self.received_at,
            workers=dict(self.workers),
        )


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """How one request ended, for observers (metrics, logs)."""

    request_id: str
    phase: Phase
    error: EpdError | None
    timings: RequestTimings
    completion_tokens: int
    prompt_tokens: int = 0
    """The prompt's tokens, from the usage the request ended with (0 when it has none)."""
    model: str | None = None
    """The configured model the request resolved to (None: unresolved, or pools name none)."""
    token_gaps: TokenGaps | None = None
    """The gaps between its output tokens, as histogram bucket counts."""


class RequestObserver(Protocol):
    """Told about every request once it ended (synchronously; keep it cheap)."""

    def request_finished(self, outcome: RequestOutcome) -> None:
        """Record ``outcome``; must not raise (errors are logged and ignored)."""
        ...


class Supervisor:
    """Owns the actors of a router and runs request pipelines.

    Args:
        pools: pool name -> pool; one actor is built per pool, from the
            registry entry of ``pool.stage``, serving ``pool.model``.
        deadlines: request deadlines.
        limits: actor bounds and restart backoff.
        registry: stage name -> actor class (defaults to the built-in registry).
        observer: told about every finished request (metrics).
        retry: the actors' retry policy.
        rng: randomness for retry jitter (tests pass a seeded one).
        admission: the global in-flight limit.
        catalog: resolves a request's ``model`` (default: the pools' models,
            no configured adapters, the default model None).
        encoder_caches: pool name -> the memory of encoder outputs its actor
            reuses across requests (``ConfigError`` for a pool whose stage
            produces none).
        tracing: traces every request (None: no tracing, at no cost).
    """

    def __init__(
        self,
        pools: dict[str, WorkerPool],
        *,
        deadlines: Deadlines | None = None,
        limits: ActorLimits | None = None,
        registry: dict[str, type[BaseActor]] | None = None,
        observer: RequestObserver | None = None,
        retry: RetryPolicy | None = None,
        rng: random.Random | None = None,
        admission: AdmissionLimits | None = None,
        catalog: ModelCatalog | None = None,
        encoder_caches: Mapping[str, EncoderCache] | None = None,
        tracing: RequestTracing | None = None,
    ) -> None:
        self.observer = observer
        self.tracing = tracing
        self.catalog = catalog or ModelCatalog(pools.values())
        self.retry = retry or RetryPolicy()
        self._rng = rng or random.Random()
        self.admission = admission or AdmissionLimits()
        self.fleet_admission: AdmissionLimits | None = None
        """The fleet-wide limit (``[shared] max_requests_in_flight``), if any: it counts
        this router's requests plus ``remote_requests_in_flight`` (``epd_actors.core.fleet``)."""
        self.remote_requests_in_flight = 0
        self.requests_refused = 0
        self._idle = trio.Event()
        self._idle.set()
        self.deadlines = deadlines or Deadlines()
        self.limits = limits or ActorLimits()
        registry = STAGE_ACTORS if registry is None else registry
        self.actors: dict[str, BaseActor] = {
            name: self._build_actor(actor_class(pool.stage, registry), pool, retry, rng)
            for name, pool in pools.items()
        }
        self._names = {id(actor): name for name, actor in self.actors.items()}
        self.encoder_caches = dict(encoder_caches or {})
        for name, cache in self.encoder_caches.items():
            if name not in self.actors:
                raise ConfigError(f"encoder cache for {name!r}: no such pool")
            self.actors[name].use_encoder_cache(cache)
        self._ordered = sorted(self.actors.values(), key=lambda actor: actor.order)
        self._plans = _plans_by_model(self._ordered)
        self.actor_restarts = dict.fromkeys(self.actors, 0)
        self.requests_in_flight = 0
        self.requests_total = 0
        self.requests_failed = 0
        self.requests_cancelled = 0
        self.compensations_run = 0
        # One scope per running request's pipeline, so a shutdown can end them
        # with a typed error their clients see (``expire_requests``).
        self._expirable: set[trio.CancelScope] = set()  # each request's deadline scope
        self._expired: set[trio.CancelScope] = set()  # of those, the ones expire_requests ended
        self._expiry_reason = ""

    def __repr__(self) -> str:
        return f"<Supervisor pools={[self._names[id(a)] for a in self._ordered]}>"

    def _build_actor(
        self,
        cls: type[BaseActor],
        pool: WorkerPool,
        retry: RetryPolicy | None,
        rng: random.Random | None,
    ) -> BaseActor:
        return cls(
            pool,
            inbox_capacity=self.limits.inbox_capacity,
            max_jobs=self.limits.max_jobs,
            retry=retry,
            rng=rng,
            cleanup_timeout_s=self.deadlines.cleanup_timeout_s,
            attempt_timeout_s=cls.attempt_timeout(self.deadlines),
        )

    @property
    def topology(self) -> tuple[str, ...]:
        """The default model's stages in plan order (e.g. ``('encode', 'prefill', 'decode')``).

        With no pool of the default model, the first configured model's.
        """
        actors = self._plans.get(self.catalog.default_model) or next(iter(self._plans.values()))
        return tuple(actor.stage for actor in actors)

    @property
    def topologies(self) -> dict[str | None, tuple[str, ...]]:
        """Each served model's stages in plan order."""
        return {
            model: tuple(actor.stage for actor in actors) for model, actors in self._plans.items()
        }

    def route(self, request: GenerationRequest) -> ModelRoute:
        """Where ``request``'s model leads.

        Raises:
            ModelNotFound: the router serves no such model or adapter.
        """
        route = self.catalog.resolve(request.model)
        if route.model not in self._plans:
            raise ModelNotFound(request.model or str(route.model))
        return route

    def plan(self, request: GenerationRequest) -> list[BaseActor]:
        """The actors a request goes through, in order.

        Raises:
            ModelNotFound: the router serves no such model or adapter.
        """
        actors = self._plans[self.route(request).model]
        return [actor for actor in actors if actor.applies_to(request)]

    def statistics(self) -> SupervisorStatistics:
        return SupervisorStatistics(
            requests_in_flight=self.requests_in_flight,
            requests_total=self.requests_total,
            requests_failed=self.requests_failed,
            requests_cancelled=self.requests_cancelled,
            requests_refused=self.requests_refused,
            actor_restarts=dict(self.actor_restarts),
            compensations_run=self.compensations_run,
        )

    def expire_requests(self, reason: str) -> int:
        """End every request in flight with ``StageTimeout(phase="drain")``.

        Used by the server's shutdown ladder when its drain deadline passes:
        unlike cancelling the callers, each request still delivers a final
        ``ErrorEvent`` (an HTTP stream ends with an SSE error event, not a cut),
        its workers are told to abort and its compensations run.  Returns the
        number of requests expired.
        """
        self._expiry_reason = reason
        for scope in self._expirable:
            scope.cancel(reason=reason)
        self._expired.update(self._expirable)
        return len(self._expirable)

    async def wait_idle(self) -> None:
        """Return once no request is in flight (at once if none is).

        Cancellation: safe.
        """
        await self._idle.wait()

    # -- actors

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run every actor (restarting crashed ones) until cancelled.

        Reports ready once every actor accepts jobs.
        """
        async with trio.open_nursery() as nursery:
            for actor in self._ordered:
                name = f"actor:{self._names[id(actor)]}"
                await nursery.start(self._keep_running, actor, name=name)
            task_status.started()

    async def _keep_running(
        self, actor: BaseActor, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        backoff = self.limits.restart_backoff_start_s
        status: trio.TaskStatus[None] = task_status
        name = self._names[id(actor)]
        while True:
            started = trio.current_time()
            try:
                await actor.run(task_status=status)
            except Exception:
                self.actor_restarts[name] += 1
                logger.exception(
                    "actor %s crashed; restarting in %.2fs (restart %d)",
                    name,
                    backoff,
                    self.actor_restarts[name],
                )
            status = trio.TASK_STATUS_IGNORED
            if trio.current_time() - started >= self.limits.restart_backoff_max_s:
                backoff = self.limits.restart_backoff_start_s  # it had been healthy a while
            await trio.sleep(backoff)
            backoff = min(backoff * 2, self.limits.restart_backoff_max_s)

    # -- requests

    @asynccontextmanager
    async def generate(
        self, request: GenerationRequest
    ) -> AsyncIterator[HandoffReceiver[GenerationEvent]]:
        """Run ``request``; yield the channel its events arrive on.

        The last event is always a ``DoneEvent`` or an ``ErrorEvent``.
        The caller may attach a taker to the channel (:meth:`HandoffReceiver.attach
        <epd_actors.handoff.HandoffReceiver.attach>`): deltas are then handed to it,
        in the task that produced them, while the caller waits with nothing queued.

        Cancellation: leaving the block early cancels the request; its workers
        are told to abort and compensations run (shielded, bounded).
        Backpressure: the pipeline waits while ``REQUEST_EVENT_BUFFER`` events
        are unread.  Admission: past ``max_requests_in_flight`` the only event
        is an ``ErrorEvent`` carrying ``Overloaded`` (nothing is queued).
        """
        # Typed by annotation, not by subscripting the call (a typing look-up per request).
        send: HandoffSender[GenerationEvent]
        receive: HandoffReceiver[GenerationEvent]
        send, receive = open_handoff(REQUEST_EVENT_BUFFER)
        refusal = self._admission_refusal(request)
        if refusal is not None:
            send.send_nowait(refusal)
            send.close()
            with receive:
                yield receive
            return
        self.requests_total += 1
        self.requests_in_flight += 1
        if self.requests_in_flight == 1:
            self._idle = trio.Event()
        try:
            with single_exception():
                async with trio.open_nursery() as nursery:
                    name = f"request:{request.request_id}"
                    nursery.start_soon(self._run_request, request, send, name=name)
                    try:
                        with receive:
                            yield receive
                    finally:
                        nursery.cancel_scope.cancel(reason="caller left the request")
        finally:
            self.requests_in_flight -= 1
            if self.requests_in_flight == 0:
                self._idle.set()

    def _admission_refusal(self, request: GenerationRequest) -> ErrorEvent | None:
        """An immediate ``Overloaded`` when the router is at its in-flight limit."""
        limit = self.admission.limit_for(request.priority)
        if self.requests_in_flight < limit:
            fleet = self.fleet_admission
            if fleet is None:
                return None
            limit = fleet.limit_for(request.priority)
            if self.requests_in_flight + self.remote_requests_in_flight < limit:
                return None
            who = "the fleet is"
        else:
            who = "the router is"
        self.requests_refused += 1
        error = Overloaded(
            f"{who} serving its limit of {limit} {request.priority}-priority requests",
            retry_after=self.admission.retry_after_s,
        )
        logger.info("request %s refused: %s", request.request_id, error)
        return ErrorEvent(error, RequestTimings(0.0, {}, None, 0.0, {}))

    async def _run_request(
        self,
        request: GenerationRequest,
        events: HandoffSender[GenerationEvent],
    ) -> None:
        record = _RequestRecord(request, trio.current_time())
        if self.tracing is not None:
            record.trace = self.tracing.start(request, record)
        completed = False
        try:
            async with events:
                final = await self._outcome(record, events)
                completed = isinstance(final, DoneEvent)
                if isinstance(final, ErrorEvent) and isinstance(final.error, RequestCancelled):
                    record.lifecycle.advance(Phase.CANCELLED)
                    self.requests_cancelled += 1
                else:
                    record.lifecycle.advance(Phase.DONE if completed else Phase.FAILED)
                    self.requests_failed += not completed
                try:
                    await _emit(events, final)
                except trio.BrokenResourceError:
                    logger.debug("request %s: caller left before its result", request.request_id)
        finally:
            if not record.lifecycle.finished:
                record.lifecycle.advance(Phase.CANCELLED)
                self.requests_cancelled += 1
            if not completed:
                await self._compensate(record)
            self._observe(record)

    def _observe(self, record: _RequestRecord) -> None:
        if self.observer is None and record.trace is None:
            return
        outcome = RequestOutcome(
            request_id=record.request.request_id,
            phase=record.lifecycle.phase,
            error=record.error,
            timings=record.timings(),
            completion_tokens=record.completion_tokens,
            prompt_tokens=record.usage.prompt_tokens if record.usage is not None else 0,
            model=record.model,
            token_gaps=record.token_gaps,
        )
        if self.observer is not None:
            try:
                self.observer.request_finished(outcome)
            except Exception:
                logger.exception("request observer failed on %s", record.request.request_id)
        if record.trace is not None:
            try:
                record.trace.end(outcome)
            except Exception:
                logger.exception("request trace failed on %s", record.request.request_id)

    async def _outcome(
        self, record: _RequestRecord, events: HandoffSender[GenerationEvent]
    ) -> DoneEvent | ErrorEvent:
        request = record.request
        timeout = request.timeout_s
        if not timeout:  # None or 0: the configured deadline
            timeout = self.deadlines.request_timeout_s
        # One scope for the request's deadline and the drain's expiry
        # (:meth:`expire_requests` cancels it and notes that it did).
        scope = trio.move_on_after(timeout)
        self._expirable.add(scope)
        try:
            with scope:
                return await self._pipeline(record, events)
            if scope in self._expired:
                raise StageTimeout(
                    f"request {request.request_id} ended while "
                    f"{record.lifecycle.phase.value}: {self._expiry_reason}",
                    phase="drain",
                )
            raise StageTimeout(
                f"request {request.request_id} exceeded its {timeout:g}s deadline "
                f"while {record.lifecycle.phase.value}",
                phase="request",
            )
        except EpdError as exc:
            logger.info("request %s failed: %s", request.request_id, exc)
            record.error = exc
            return ErrorEvent(exc, record.timings())
        except trio.BrokenResourceError:
            # The caller closed its end of the event channel: it left.
            return ErrorEvent(
                RequestCancelled(f"request {request.request_id}: caller left"), record.timings()
            )
        finally:
            self._expirable.discard(scope)
            self._expired.discard(scope)

    async def _pipeline(
        self, record: _RequestRecord, events: HandoffSender[GenerationEvent]
    ) -> DoneEvent:
        route = self.route(record.request)
        record.model = route.model
        plan = [actor for actor in self._plans[route.model] if actor.applies_to(record.request)]
        # Fail fast: a stage whose pool has no usable worker would fail the
        # request anyway, after the stages before it did their work for nothing
        # (and left a prefilled KV handle to release).  Busy workers are usable.
        for actor in plan:
            if not actor.pool.has_usable():
                raise actor.pool.refusal()
        record.lifecycle.advance(Phase.PLANNED)
        context = StageContext(
            record.request,
            worker_request_id(record.request.request_id),
            adapter=route.adapter,
            trace=record.trace,
        )
        index = 0
        while index < len(plan):
            actor = plan[index]
            record.lifecycle.advance(actor.phase)
            try:
                await self._run_stage(actor, context, record, events)
            except HandoffRejected as refusal:
                index = await self._redo_handoff(plan, record, refusal)
                continue
            except EpdError as error:
                if not await self._redo_recalled(plan[:index], context, record, events, error):
                    raise
                continue  # the same stage again, with what the earlier ones produced anew
            index += 1
        if record.finish_reason is None:
            raise ActorCrashed("the output stage ended without a finish reason")
        usage = record.usage = record.usage or Usage(
            context.prompt_tokens or 0, record.completion_tokens
        )
        await _emit(events, UsageEvent(usage))
        return DoneEvent(record.finish_reason, usage, record.timings())

    async def _redo_handoff(
        self, plan: list[BaseActor], record: _RequestRecord, refusal: HandoffRejected
    ) -> int:
        """Blame a refused hand-off on its producer; the plan index to resume at.

        Charges the producing worker's breaker, runs the refused handle's
        compensation once (and drops it), and makes the producing stage's next
        job avoid every worker whose hand-off was refused.

        Raises:
            HandoffRejected: ``refusal``, when the producer is unknown or the
                request had ``retry.max_attempts`` hand-offs already.

        Cancellation: the compensation is shielded and bounded; the backoff
        before the next hand-off is cancellable.
        """
        handoff = record.handoff
        if handoff is None or handoff.actor not in plan:
            raise refusal
        record.handoff = None
        record.refused.append(handoff.worker_id or "?")
        record.refusal = refusal
        self._charge(handoff)
        for compensation in handoff.compensations:
            record.compensations.remove(compensation)
        await self._run_compensations(record, handoff.compensations)
        attempt = len(record.refused)
        if attempt >= self.retry.max_attempts:
            raise refusal
        logger.warning(
            "request %s: %s; running %s again without worker %s",
            record.request.request_id,
            refusal,
            handoff.actor.stage,
            handoff.worker_id,
        )
        await trio.sleep(self.retry.backoff_s(attempt, self._rng))
        return plan.index(handoff.actor)

    async def _redo_recalled(
        self,
        earlier: list[BaseActor],
        context: StageContext,
        record: _RequestRecord,
        events: HandoffSender[GenerationEvent],
        error: EpdError,
    ) -> bool:
        """Run again the items of earlier stages whose remembered results ``error`` found gone.

        True when some ran (the failed stage is to run once more).  False --
        ``error`` is the request's -- when no earlier stage names any item,
        when this request did so already, or when output has started.

        Cancellation: like any stage.
        """
        if record.redone or record.first_token_at is not None or record.completion_tokens:
            return False
        redone = False
        for actor in earlier:
            items = actor.redo(context, error)
            if not items:
                continue
            if not redone:
                logger.warning(
                    "request %s: %s; producing the missing results again",
                    record.request.request_id,
                    error,
                )
            redone = record.redone = True
            record.lifecycle.advance(actor.phase)
            await self._run_stage(actor, context, record, events, items)
        return redone

    def _charge(self, handoff: _Handoff) -> None:
        """Count a refused hand-off against the circuit breaker of the worker that made it."""
        member = None if handoff.worker_id is None else handoff.actor.pool.get(handoff.worker_id)
        if member is not None:
            member.breaker.record_failure(trio.current_time())

    async def _run_stage(
        self,
        actor: BaseActor,
        context: StageContext,
        record: _RequestRecord,
        events: HandoffSender[GenerationEvent],
        items: list[int | None] | None = None,
    ) -> None:
        if items is None:
            items = actor.recall(context, actor.split(context))
            if not items:
                return  # every result was remembered: no job, no time spent
            # The actor may let another request's job in flight stand for some items.
            bound = actor.attempt_timeout(self.deadlines)
            run = partial(self._run_stage, actor, context, record, events)
            await actor.share(context, items, run, bound)
            return
        started = trio.current_time()
        failures: list[EpdError] = []
        workers: list[str] = []
        waits: list[float] = []

        async def run_one(item: int | None) -> None:
            try:
                await self._run_job(actor, context, item, record, events, workers, waits)
            except EpdError as exc:
                failures.append(exc)
                nursery.cancel_scope.cancel(reason=f"{actor.stage} job failed")
            except trio.BrokenResourceError:
                failures.append(RequestCancelled(f"{record.request.request_id}: caller left"))
                nursery.cancel_scope.cancel(reason="caller closed its event channel")

        if len(items) == 1:
            # The common case needs no fan-out: no nursery, no extra task.
            try:
                await self._run_job(actor, context, items[0], record, events, workers, waits)
            except trio.BrokenResourceError:
                raise RequestCancelled(f"{record.request.request_id}: caller left") from None
        else:
            async with trio.open_nursery() as nursery:
                for item in items:
                    name = f"{actor.stage}:{record.request.request_id}"
                    nursery.start_soon(run_one, item, name=name)
            if failures:
                raise failures[0]
        record.stage_times[actor.stage] = trio.current_time() - started
        record.workers[actor.stage] = tuple(workers)
        record.queue_wait_s += max(waits, default=0.0)

    async def _run_job(
        self,
        actor: BaseActor,
        context: StageContext,
        item: int | None,
        record: _RequestRecord,
        events: HandoffSender[GenerationEvent],
        workers: list[str],
        waits: list[float],
    ) -> None:
        relay = OutputRelay(
            events, record, self.deadlines.inter_token_timeout_s, gaps=record.token_gaps
        )
        output = relay if actor.produces_output else None
        avoid = tuple(record.refused) if record.refusal is not None else ()
        # This task only waits for the job: a job that would not wait runs in it
        # (no task of its own; an output job watches its inter-token deadline itself).
        submitted = actor.submit(
            context,
            item,
            output=output,
            avoid=avoid,
            after=record.refusal if avoid else None,
            run_here=True,
        )
        try:
            async with submitted as (job, replies):
                try:
                    event = await self._next_event(actor, replies, relay)
                except StageTimeout:
                    job.timed_out = True  # the worker's breaker counts it (read on release)
                    raise
                if event is None:
                    if relay.caller_left:
                        raise trio.BrokenResourceError("the caller closed its event channel")
                    raise ActorCrashed(
                        f"{actor.stage} actor ended request {record.request.request_id}'s "
                        "job without an answer"
                    )
                self._absorb(actor, event, context, record)
                self._take_over(actor, job, event, record)
                if job.started_at is not None:
                    waits.append(job.started_at - job.enqueued_at)
                if job.worker_id is not None:
                    workers.append(job.worker_id)
        finally:
            relay.close()  # a late delta must not follow what the supervisor sends next

    def _take_over(
        self, actor: BaseActor, job: Job, event: StageEvent, record: _RequestRecord
    ) -> None:
        """Take a finished job's compensations; note it if it produced the KV hand-off.

        Synchronous: it runs in the scheduling step that received the final event.
        """
        taken = job.hand_over()
        record.compensations.extend(taken)
        if isinstance(event, StageOutput) and event.kv_transfer_params is not None:
            record.handoff = _Handoff(actor, job.worker_id, taken)
            record.refusal = None

    async def _next_event(
        self,
        actor: BaseActor,
        replies: trio.MemoryReceiveChannel[StageEvent],
        relay: OutputRelay,
    ) -> StageEvent | None:
        """The job's next event, for an output stage within its inter-token deadline.

        The deltas bypass this task, so the deadline comes from the relay
        (:meth:`OutputRelay.deadline`): when it passes, the relay is asked
        again, and the wait goes on if a delta came meanwhile.  Until the
        first delta there is none here: the first-token deadline belongs to
        each attempt of the job (the actor retries a worker that misses it),
        and the request deadline bounds them all.
        """
        try:
            # A job run in this task left its answer (or none) here already.
            return replies.receive_nowait()
        except trio.WouldBlock:
            pass
        except trio.EndOfChannel:
            return None
        if not actor.produces_output:
            try:
                return await replies.receive()
            except trio.EndOfChannel:
                return None
        try:
            return await relay.watched(replies.receive)
        except trio.EndOfChannel:
            return None

    def _absorb(
        self, actor: BaseActor, event: StageEvent, context: StageContext, record: _RequestRecord
    ) -> None:
        """Apply a job's one reply, its final event.

        Raises:
            EpdError: the job's failure (a ``StageFailure``).
            InternalError: the reply is a ``Delta``: deltas travel only on the
                output path (``Job.output``), so the actor broke its contract.
        """
        if isinstance(event, StageFailure):
            raise event.error
        if isinstance(event, StageOutput):
            context.absorb(event)
            if event.finish_reason is not None:  # an output stage's end
                record.finish_reason = event.finish_reason
                record.usage = event.usage
            return
        logger.error(
            "%s actor replied to request %s's job with a %s; deltas go on the output path",
            actor.stage,
            record.request.request_id,
            type(event).__name__,
        )
        raise InternalError(
            f"{actor.stage} actor replied to request {record.request.request_id}'s job "
            f"with a {type(event).__name__}, not a StageOutput or StageFailure"
        )

    async def _compensate(self, record: _RequestRecord) -> None:
        """Undo what finished stages left behind (shielded, bounded)."""
        compensations, record.compensations = record.compensations, []
        await self._run_compensations(record, compensations)

    async def _run_compensations(
        self, record: _RequestRecord, compensations: list[Compensation]
    ) -> None:
        """Run ``compensations`` once each, logging failures (shielded, bounded)."""
        if not compensations:
            return
        with trio.move_on_after(self.deadlines.cleanup_timeout_s, shield=True):
            for compensation in compensations:
                self.compensations_run += 1
                try:
                    await compensation()
                except EpdError as exc:
                    logger.warning("request %s: cleanup failed: %s", record.request.request_id, exc)


def _plans_by_model(ordered: list[BaseActor]) -> dict[str | None, list[BaseActor]]:
    """Each model's actors, in plan order; each model's topology checked.

    Raises:
        ConfigError: a model's stages (or no stages at all) do not form a topology.
    """
    plans: dict[str | None, list[BaseActor]] = {}
    for actor in ordered:
        plans.setdefault(actor.pool.model, []).append(actor)
    if not plans:
        _check_topology([], "")
    for model, actors in plans.items():
        _check_topology(actors, "" if model is None else f" of model {model!r}")
    return plans


def _check_topology(actors: list[BaseActor], of_model: str) -> None:
    stages = {actor.stage for actor in actors}
    outputs = [actor.stage for actor in actors if actor.produces_output]
    if len(outputs) != 1:
        raise ConfigError(
            f"pools{of_model}: exactly one output stage must be configured, got "
            f"{outputs or 'none'} (configure decode with prefill, or pd)"
        )
    for actor in actors:
        missing = [stage for stage in actor.requires if stage not in stages]
        if missing:
            raise ConfigError(
                f"pools.{actor.stage}{of_model}: needs pools {missing} configured as well"
            )


async def _emit(events: HandoffSender[GenerationEvent], event: GenerationEvent) -> None:
    """Send one of a request's closing events (usage, the final one) to its caller.

    At once when the buffer has room -- no scheduling round for the send --
    and awaited otherwise (backpressure: while ``REQUEST_EVENT_BUFFER``
    events are unread).

    Raises:
        trio.BrokenResourceError: the caller left.
    """
    if not events.offer(event):
        await events.send(event)
