"""The base stage actor: inbox, worker loop, job bookkeeping, statistics.

Theory of operation
-------------------
An actor owns a bounded inbox (a memory channel of :class:`Job`) and, while
``run`` is active, a nursery in which every job gets its own task.  The loop
takes a job from the inbox, reserves a slot of the actor's
``CapacityLimiter`` (``max_jobs``) for it and starts its task, so one slow job
never holds up the inbox.  A job task leases a worker from the stage's pool
(routing policy, per-worker in-flight limit), calls the subclass's
:meth:`BaseActor.handle` with that worker's backend, and returns the lease.

Requesters use :meth:`BaseActor.submit`, an async context manager that puts a
job in the inbox and yields the receiving end of the job's reply channel;
leaving it cancels the job, wherever it is (still queued, or running on a
worker, in which case the backend aborts the work on the worker).  A job that
would not wait starts at once; a requester that only waits for the answer
(``run_here``) runs such a job in its own task instead of a task of the
actor's, which saves the job's task and the scheduling rounds that start it
and pass its answer on.  The actor still counts it against ``max_jobs``,
cancels it when it stops or crashes, and is crashed by its bugs.

Attempts: each attempt on a worker runs under the stage's attempt deadline
(:meth:`BaseActor.attempt_timeout`: the whole answer for a stage that hands
something on, the first token for an output stage).  A worker that misses it
is treated like a failing one: the attempt is cancelled (the backend aborts
it there), ``AttemptTimeout`` is counted against the worker's breaker, and
the job moves to another worker within the retry policy.  Whatever a failed
attempt registered for undoing is undone before the next one.

Errors: a typed ``EpdError`` fails only its job (a ``StageFailure`` event).
Anything else is a bug and crashes the actor: every job it holds is cancelled
(their requesters see the reply channel close without an answer) and the
exception propagates out of ``run`` to the supervisor, which restarts the actor
with backoff.  The inbox outlives a crash, so queued jobs wait, not vanish.

Subclasses set the class attributes and override ``handle`` (and, when the
stage needs it, ``applies_to``, ``split`` and ``route_key``); they never touch
the inbox, the nursery or the limiter.
"""

from __future__ import annotations

import logging
import math
import random
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import trio

from ...errors import (
    AttemptTimeout,
    ConfigError,
    EpdError,
    InternalError,
    NoHealthyWorker,
    StageTimeout,
)
from ...limits import ACTOR_INBOX_CAPACITY, ACTOR_MAX_JOBS, CLEANUP_TIMEOUT_S, JOB_REPLY_BUFFER
from ..health import is_backpressure
from ..retry import RetryPolicy, counts_against_worker
from ..routing import RouteKey, affinity_for_prompt, prompt_tokenizer
from ..tracing import attempt_span
from .jobs import Job, StageContext, StageEvent, StageFailure, StageOutput

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable

    from ...backends.base import StageBackend
    from ...protocol import GenerateRequest
    from ...request import GenerationRequest
    from ..config import Deadlines
    from ..encoder_cache import EncoderCache
    from ..lifecycle import Phase
    from ..output_relay import OutputRelay
    from ..pool import WorkerPool
    from .jobs import Compensation
    from .local_prefill import LocalPrefillRule

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ActorStatistics:
    """A snapshot of one actor."""

    stage: str
    queued: int
    peak_queued: int
    running: int
    jobs_total: int
    failures_total: int
    retries_total: int
    capacity: int


class BaseActor:
    """A stage actor; see the module docstring.

    Class attributes a stage sets:
        stage: the registry key and the pool it draws workers from.
        phase: the lifecycle phase a request is in while this stage runs.
        order: where the stage sits in a plan (lower runs first).
        produces_output: the stage streams the request's output tokens.
        requires: stages that must be configured alongside this one.
        worker_roles: the worker roles that may serve the stage (empty: any);
            a worker announcing another role is refused by the pool.
        default_policy: the routing policy of the stage's pool when its
            configuration names none.
        consumes_kv_handoff: the stage's workers take the KV cache another
            stage handed on (they can pull blocks nobody else will: the HTTP
            backend's release by consumption uses them).

    Args:
        pool: the workers of this stage.
        inbox_capacity: jobs that may wait in the inbox.
        max_jobs: jobs that may run at once.
        retry: when a failed attempt moves to another worker.
        rng: randomness for retry jitter (tests pass a seeded one).
        cleanup_timeout_s: bound of the compensations a job runs itself.
        attempt_timeout_s: the deadline of one attempt on one worker (see
            :meth:`attempt_timeout`; the supervisor passes the configured one).
    """

    stage: ClassVar[str]
    phase: ClassVar[Phase]
    order: ClassVar[int]
    produces_output: ClassVar[bool] = False
    requires: ClassVar[tuple[str, ...]] = ()
    worker_roles: ClassVar[frozenset[str]] = frozenset()
    default_policy: ClassVar[str] = "least_in_flight"
    consumes_kv_handoff: ClassVar[bool] = False

    def __init__(
        self,
        pool: WorkerPool,
        *,
        inbox_capacity: int = ACTOR_INBOX_CAPACITY,
        max_jobs: int = ACTOR_MAX_JOBS,
        retry: RetryPolicy | None = None,
        rng: random.Random | None = None,
        cleanup_timeout_s: float = CLEANUP_TIMEOUT_S,
        attempt_timeout_s: float = math.inf,
    ) -> None:
        self.pool = pool
        self.cleanup_timeout_s = cleanup_timeout_s
        self.attempt_timeout_s = attempt_timeout_s
        self.retry = retry or RetryPolicy()
        self._rng = rng or random.Random()
        self.retries_total = 0
        self._inbox_send, self._inbox_receive = trio.open_memory_channel[Job](inbox_capacity)
        self._limiter = trio.CapacityLimiter(max_jobs)
        self._jobs: trio.Nursery | None = None  # the job nursery, while ``run`` serves
        self._run_here: set[Job] = set()  # jobs running in their requesters' tasks
        self.jobs_total = 0
        self.failures_total = 0

    def __repr__(self) -> str:
        stats = self.statistics()
        return f"<{type(self).__name__} queued={stats.queued} running={stats.running}>"

    # -- what a stage overrides

    @classmethod
    def applies_to(cls, request: GenerationRequest) -> bool:
        """Whether a request needs this stage at all (default: yes)."""
        return True

    @classmethod
    def attempt_timeout(cls, deadlines: Deadlines) -> float:
        """The configured deadline of one attempt of this stage (default: none).

        For a stage that hands something on, to its answer; for an output
        stage, to its first token (the output's later pace is the
        supervisor's inter-token deadline).
        """
        return math.inf

    @classmethod
    def split(cls, context: StageContext) -> list[int | None]:
        """The items this stage fans out over (default: one job, no item)."""
        return [None]

    def recall(self, context: StageContext, items: list[int | None]) -> list[int | None]:
        """The items of ``items`` that still need a job (default: all of them).

        A stage that remembers results of earlier requests (encode, with its
        pool's encoder-output reuse) folds what it remembers into ``context``
        here and leaves those items out; no items left means no job at all.
        Synchronous: it runs in the requester's task, between two stages.
        """
        return items

    async def share(
        self,
        context: StageContext,
        items: list[int | None],
        run: Callable[[list[int | None]], Awaitable[None]],
        bound_s: float,
    ) -> None:
        """Run the jobs of ``items`` with ``run`` (default: all of them, at once).

        A stage whose results outlive a request (encode, with reuse) may wait,
        at most ``bound_s`` seconds, for another request's job producing the
        same result instead, and run only what it still lacks afterwards.

        Raises:
            EpdError: as ``run``.

        Cancellation: cancellable at any await (``run`` cancels its jobs).
        """
        await run(items)

    def redo(self, context: StageContext, error: EpdError) -> list[int | None]:
        """The items to run again because a later stage failed with ``error``.

        For a stage whose remembered results (:meth:`recall`) a later stage
        found gone: it forgets them and names the items that produce them
        again.  Default: none (the error is the request's).  Synchronous.
        """
        return []

    def use_encoder_cache(self, cache: EncoderCache) -> None:
        """Remember this stage's encoder outputs in ``cache`` across requests.

        Raises:
            ConfigError: the stage produces no encoder outputs (the default).
        """
        raise ConfigError(
            f"pools.{self.stage}.reuse: only a stage that produces encoder outputs "
            "(encode) can reuse them"
        )

    def use_local_prefill(self, rule: LocalPrefillRule) -> None:
        """Skip this stage for the requests ``rule`` says the consumer prefills itself.

        Raises:
            ConfigError: the stage hands no KV on (the default).
        """
        raise ConfigError(
            f"pools.{self.stage}.local_prefill_below_tokens: only a stage that hands its KV "
            "cache on (prefill) can be skipped"
        )

    def route_key(self, job: Job) -> RouteKey:
        """The routing key of a job (default: the session key, else the prompt prefix).

        The prompt digest, and the prompt as the model sees it, are computed
        only for a pool whose policy reads them.
        """
        policy = self.pool.policy
        adapter = job.context.adapter
        if not policy.uses_affinity and not policy.uses_prompt:
            return RouteKey(job.request_id, adapter=adapter)
        request = job.context.request
        affinity = request.session_key or _prompt_affinity(request)
        prompt = routed_prompt(request) if policy.uses_prompt else None
        tokenizer = prompt_tokenizer(policy)
        tokens = None if tokenizer is None else tokenizer.token_ids(request)
        return RouteKey(job.request_id, affinity, prompt, adapter, tokens)

    async def handle(self, job: Job, backend: StageBackend) -> None:
        """Do the job on ``backend`` and send its events on ``job.reply``.

        Raises:
            EpdError: the job failed (the base class reports it).

        Cancellation: may be cancelled at any await; the backend aborts the
        worker's part of the work.
        """
        raise NotImplementedError

    # -- shared helpers for stage classes

    async def stream_output(
        self, job: Job, backend: StageBackend, request: GenerateRequest
    ) -> None:
        """Relay a generate request's deltas to the job's requester.

        Every delta's content goes on ``job.output`` (the supervisor gives an
        output stage's job one) -- it reaches the caller without waking the
        requester -- and the reply carries control only: a ``StageOutput`` with
        the finish reason and usage after the last delta.  A
        burst of deltas that already arrived is passed on without a scheduling
        round per delta (``receive_nowait``), and the stream hands deltas to
        ``job.output`` itself (``set_sink``), as they arrive in its producer's
        task, without waking this task while it waits with nothing queued.

        Raises:
            InternalError: the job has no ``job.output`` (only an output stage's
                job streams, and the supervisor gives each one a relay).

        Backpressure: waits while the requester's buffer (the reply channel,
        or the caller's event channel behind ``job.output``) is full.
        Cancellation: a requester that left ends the relay; the backend then
        aborts the request on its worker.
        """
        output = job.output
        if output is None:
            raise InternalError(
                f"{self.stage} job of {job.request_id} streams output but has no output relay"
            )
        async with backend.open_stream(request) as stream:
            stream.set_sink(output.sink)
            while True:
                try:
                    if output.job_watches:  # the job runs in its requester's task
                        delta = await output.watched(stream.receive)
                    else:
                        delta = await stream.receive()
                except trio.EndOfChannel:
                    return
                except StageTimeout:
                    job.timed_out = True  # the worker's breaker counts it (read on release)
                    raise
                finally:
                    # Deltas the stream handed to the relay itself count as output.
                    job.output_started |= output.relayed
                while True:
                    try:
                        if not output.offer(delta):
                            await output.put(delta)
                        if delta.finish_reason is not None:
                            await job.answer(
                                StageOutput(finish_reason=delta.finish_reason, usage=delta.usage)
                            )
                    except trio.BrokenResourceError:
                        # The requester left; leaving the stream aborts the worker's
                        # side.  Raising here instead would surface through the
                        # backend's context manager and crash the actor.
                        logger.debug("%s job of %s: requester left", self.stage, job.request_id)
                        return
                    if not job.output_started:
                        job.output_began()
                    try:
                        delta = stream.receive_nowait()
                    except trio.WouldBlock:
                        break
                    except trio.EndOfChannel:
                        return

    # -- the actor machinery

    def statistics(self) -> ActorStatistics:
        inbox = self._inbox_send.statistics()
        return ActorStatistics(
            stage=self.stage,
            queued=inbox.current_buffer_used,
            peak_queued=inbox.peak_buffer_used,
            running=self._limiter.borrowed_tokens,
            jobs_total=self.jobs_total,
            failures_total=self.failures_total,
            retries_total=self.retries_total,
            capacity=int(self._limiter.total_tokens),
        )

    @asynccontextmanager
    async def submit(
        self,
        context: StageContext,
        item: int | None,
        *,
        output: OutputRelay | None = None,
        avoid: tuple[str, ...] = (),
        after: EpdError | None = None,
        run_here: bool = False,
    ) -> AsyncIterator[tuple[Job, trio.MemoryReceiveChannel[StageEvent]]]:
        """Queue a job; yield it (read-only) and its reply channel; cancel it on exit.

        ``output`` (an output stage's requester only) takes the job's non-final
        deltas straight to the request's caller; see :mod:`~epd_actors.core.output_relay`.
        ``avoid``: workers the job must not use (their earlier result for the
        request proved bad); ``after``: the error that made the requester run
        the job again, reported if no other worker can take it.

        A job that would not wait -- the actor is running and not crashing,
        its inbox is empty and it has a free job slot -- skips the inbox: its
        task is started in the actor's job nursery right here, which is what
        the worker loop would do one scheduling round later.  Otherwise the
        job goes through the inbox, in order behind the jobs already there.

        ``run_here``: such a job runs to its end in the requester's own task,
        before the block is entered (its answer, or none if it crashed, is
        then in the reply channel).  Only for a requester that does nothing
        but wait for the answer.  An output job run so watches the
        inter-token deadline its requester would have watched
        (``output.job_watches``, :meth:`OutputRelay.watched
        <epd_actors.core.output_relay.OutputRelay.watched>`).
        Everything else is as for a job of the actor's: it holds a job slot,
        the actor's stop or crash cancels it, a bug in it crashes the actor
        (the requester sees the reply channel close without an answer), and
        it undoes an untaken result as described below.

        Backpressure: waits while the inbox is full.
        Cancellation: leaving the block (normally or not) cancels the job; a job
        that already ended with a result the requester did not take
        (:meth:`~.jobs.Job.hand_over`) is undone here, shielded and bounded.
        A job run here is cancelled by whatever cancels its requester.
        """
        # Typed by annotation, not by subscripting the call (a typing look-up per job).
        reply_send: trio.MemorySendChannel[StageEvent]
        reply_receive: trio.MemoryReceiveChannel[StageEvent]
        reply_send, reply_receive = trio.open_memory_channel(JOB_REPLY_BUFFER)
        job = Job(
            context,
            item,
            reply_send,
            enqueued_at=trio.current_time(),
            output=output,
            avoid=avoid,
            last_error=after,
        )
        here = run_here and self._claim_slot_at_once(job)
        if here and output is not None:
            output.job_watches = True  # its requester waits in it: the job watches for it
        if not here and not self._start_at_once(job):
            try:
                await self._inbox_send.send(job)
            except BaseException:
                reply_send.close()
                reply_receive.close()
                raise
        try:
            with reply_receive:
                if here:
                    await self._run_here_now(job)
                yield job, reply_receive
        finally:
            job.requester_left = True
            if job.finished_at is None:  # a finished job has nothing left to cancel
                job.cancel()  # its task undoes what it leaves as it ends
            elif job.compensations and not job.handed_over:
                await self._compensate(job)  # it ended first; its result was not taken

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve the inbox until cancelled; report ready once it accepts jobs.

        Raises whatever crashed the actor (the supervisor restarts it).

        Cancellation: cancels every running job; each job's backend aborts its
        worker-side work within a shielded, bounded cleanup.
        """
        async with trio.open_nursery() as jobs:
            self._jobs = jobs
            try:
                task_status.started()
                while True:
                    job = await self._inbox_receive.receive()
                    try:
                        await self._limiter.acquire_on_behalf_of(job)
                    except BaseException:
                        job.reply.close()  # its requester sees the actor crash at once
                        raise
                    jobs.start_soon(self._run_job, job, name=f"{self.stage}:{job.request_id}")
            finally:
                self._jobs = None
                for job in self._run_here:  # they stop with the actor, as its tasks do
                    job.cancel()

    def _claim_slot_at_once(self, job: Job) -> bool:
        """Take a job slot for ``job`` if it would not wait in the inbox; False otherwise.

        Never while the actor is stopped, restarting or crashing (its job
        nursery is gone or cancelled: the job waits in the inbox for the next
        ``run``), nor past jobs already queued (the inbox stays FIFO), nor
        without a free slot of the limiter.
        """
        jobs = self._jobs
        if jobs is None or jobs.cancel_scope.cancel_called:
            return False
        if self._inbox_send.statistics().current_buffer_used:
            return False
        try:
            self._limiter.acquire_on_behalf_of_nowait(job)
        except trio.WouldBlock:
            return False
        return True

    def _start_at_once(self, job: Job) -> bool:
        """Start ``job``'s task now if it would not wait in the inbox; False otherwise."""
        if not self._claim_slot_at_once(job):
            return False
        jobs = self._jobs
        assert jobs is not None  # the claim checked it
        jobs.start_soon(self._run_job, job, name=f"{self.stage}:{job.request_id}")
        return True

    async def _run_here_now(self, job: Job) -> None:
        """Run ``job``, whose slot is taken, in the calling task (``submit(run_here=True)``).

        A bug (an exception that is not an ``EpdError``) crashes the actor as
        in a job task of its own: it is raised in the actor's job nursery,
        whose ``run`` then ends with it; the requester sees no answer.

        Cancellation: the caller's, and the actor's stop (``run`` cancels
        every job it runs here).
        """
        self._run_here.add(job)
        try:
            await self._run_job(job)
        except Exception as exc:
            jobs = self._jobs
            if jobs is None:  # the actor is gone already: nothing to crash
                logger.exception("%s job of %s crashed", self.stage, job.request_id)
            else:
                jobs.start_soon(_raise, exc, name=f"{self.stage}:{job.request_id}:crash")
        finally:
            self._run_here.discard(job)

    async def _run_job(self, job: Job) -> None:
        try:
            # A plain ``with``: closing the reply channel needs no checkpoint (an
            # ``async with`` would cost the job one more scheduling round at its end).
            with job.reply, job.scope:
                await self._attempt(job)
        finally:
            job.finished_at = trio.current_time()
            self._limiter.release_on_behalf_of(job)
            # Only a requester that left will not take the result any more; one
            # still in ``submit`` takes it, or undoes it as it leaves.
            if job.compensations and not job.handed_over and job.requester_left:
                await self._compensate(job)

    async def _compensate(self, job: Job) -> None:
        """Undo a job's result that its requester did not take (shielded, bounded)."""
        await self._run_compensations(job, job.hand_over())

    async def _attempt(self, job: Job) -> None:
        self.jobs_total += 1
        job.started_at = trio.current_time()
        try:
            await self._attempt_with_retries(job)
        except EpdError as exc:
            self.failures_total += 1
            logger.info("%s job of %s failed: %s", self.stage, job.request_id, exc)
            await self._report(job, StageFailure(exc))
        except trio.BrokenResourceError:
            logger.debug("%s job of %s: requester left", self.stage, job.request_id)

    async def _attempt_with_retries(self, job: Job) -> None:
        """Run the job, moving to another worker after a retryable failure.

        A worker that refuses the job because it is full or draining
        (``is_backpressure``) passes it on to another worker at once: that is
        not one of the ``max_attempts``, but no worker is asked twice.

        Raises:
            EpdError: the last attempt's error (or ``NoHealthyWorker`` when no
                worker could be leased at all, ``Overloaded`` when every
                worker left refused the job as full).
        """
        key = self.route_key(job)
        tried = list(job.avoid)
        attempt = 0
        while True:
            attempt += 1
            # A job cancelled while it queued must not reach a worker at all.
            await trio.lowlevel.checkpoint_if_cancelled()
            try:
                lease = await self.pool.lease(key, exclude=tried)
            except NoHealthyWorker:
                if job.last_error is not None and is_backpressure(job.last_error):
                    raise self.pool.saturated(job.last_error) from None
                if job.last_error is not None:
                    raise job.last_error from None
                raise
            job.worker_id = lease.member.worker_id
            passed_on = False
            undo_from = len(job.compensations)
            try:
                with attempt_span(job.context.trace, job, self.stage, attempt):
                    await self._attempt_on(job, lease.backend)
                lease.succeeded()
                return
            except EpdError as exc:
                if counts_against_worker(exc):
                    lease.failed()
                passed_on = is_backpressure(exc) and not job.output_started
                if not passed_on and not self.retry.should_retry(
                    exc, attempt=attempt, output_started=job.output_started
                ):
                    raise
                job.last_error = exc
            finally:
                if job.timed_out:
                    lease.failed()  # a worker that stops answering is a failing worker
                lease.release()
            tried.append(lease.member.worker_id)
            await self._undo_attempt(job, undo_from)
            if passed_on:
                attempt -= 1  # a full worker is not a failed attempt
                logger.debug("%s job of %s: %s", self.stage, job.request_id, job.last_error)
                continue
            self.retries_total += 1
            logger.info(
                "%s job of %s: retrying after %s (attempt %d)",
                self.stage,
                job.request_id,
                job.last_error,
                attempt,
            )
            await trio.sleep(self.retry.backoff_s(attempt, self._rng))

    async def _attempt_on(self, job: Job, backend: StageBackend) -> None:
        """One attempt: :meth:`handle` under the stage's attempt deadline.

        The deadline is lifted once the job's output started (the first delta
        that reached the requester, also when the backend's reader handed it
        over through ``job.output``).

        Raises:
            AttemptTimeout: the worker missed the deadline; the attempt was
                cancelled, so the backend aborted it on the worker.
            EpdError: what :meth:`handle` raised.

        Cancellation: the requester's cancellation passes through unchanged.
        """
        output = job.output
        with trio.move_on_after(self.attempt_timeout_s) as scope:
            job.attempt = scope
            if output is not None:
                output.attempt = scope
            try:
                await self.handle(job, backend)
            finally:
                job.attempt = None
                if output is not None:
                    output.attempt = None
        if scope.cancelled_caught:
            raise self._attempt_timed_out(job)

    def _attempt_timed_out(self, job: Job) -> AttemptTimeout:
        if self.produces_output:
            what, phase = "first token", "first_token"
        else:
            what, phase = "answer", self.stage
        worker = job.worker_id or "?"
        return AttemptTimeout(
            f"{self.stage} attempt of {job.request_id} on worker {worker}: "
            f"no {what} within {self.attempt_timeout_s:g}s",
            phase=phase,
            worker_id=worker,
        )

    async def _undo_attempt(self, job: Job, undo_from: int) -> None:
        """Undo what a failed attempt registered (the next attempt registers its own).

        Cancellation: shielded, bounded by ``cleanup_timeout_s``.
        """
        leftovers = job.compensations[undo_from:]
        del job.compensations[undo_from:]
        if leftovers:
            await self._run_compensations(job, leftovers)

    async def _run_compensations(self, job: Job, compensations: list[Compensation]) -> None:
        with trio.move_on_after(self.cleanup_timeout_s, shield=True):
            for compensation in compensations:
                try:
                    await compensation()
                except EpdError as exc:
                    logger.warning(
                        "%s job of %s: cleanup failed: %s", self.stage, job.request_id, exc
                    )

    async def _report(self, job: Job, failure: StageFailure) -> None:
        try:
            await job.answer(failure)
        except trio.BrokenResourceError:
            logger.debug("%s job of %s: requester left", self.stage, job.request_id)


async def _raise(exc: Exception) -> None:
    """Raise ``exc`` in the task this runs in (a bug of a job run in its requester's task)."""
    raise exc


def routed_prompt(request: GenerationRequest) -> str | tuple[int, ...] | None:
    """The prompt in the order the model sees it, for prefix-matching policies.

    Token ids as they are; text as it is; a chat as its turns, each role and
    text part set off by a separator, and each media item by its content hash,
    so two conversations match exactly as far as their turns and images agree.
    The model's chat template is not applied (the router does not have it):
    the blocks differ from the engine's, the prefixes they share do not.
    """
    prompt = request.prompt
    if prompt.token_ids is not None:
        return prompt.token_ids
    if prompt.text is not None:
        return prompt.text
    pieces: list[str] = []
    for message in prompt.messages or ():
        pieces.append(f"\x1e{message.role}\x1f")
        for part in message.parts:
            if isinstance(part, str):
                pieces.append(part)
            elif 0 <= part < len(request.media):
                pieces.append(f"\x1d{request.media[part].content_hash}\x1d")
    return "".join(pieces) or None


def _prompt_affinity(request: GenerationRequest) -> str | None:
    prompt = request.prompt
    if prompt.text is not None:
        return affinity_for_prompt(prompt.text)
    if prompt.messages is not None:
        text = "".join(p for m in prompt.messages for p in m.parts if isinstance(p, str))
        return affinity_for_prompt(text) if text else None
    if prompt.token_ids:
        return affinity_for_prompt(" ".join(map(str, prompt.token_ids[:64])))
    return None
