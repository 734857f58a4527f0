"""The router's client for one native worker: a supervised, multiplexed connection.

Theory of operation
-------------------
A :class:`NativeBackend` stands for one worker.  Its :meth:`NativeBackend.run`
task (started by the supervisor with ``nursery.start``) is the connection
supervisor.  It reports "started" at once -- a router must come up while some
workers are down -- and then loops:

1. dial (within ``connect_timeout_s``) and handshake (within
   ``handshake_timeout_s``): ``Hello`` with the auth token, ``Welcome`` back,
   kept as :attr:`NativeBackend.welcome`.  An ``ErrorReply`` is a
   ``HandshakeRejected``: logged at error level and retried after the longest
   backoff, since an operator may fix the token without restarting the router.
   A ``Welcome`` whose role, model or ``max_concurrency`` the pool cannot use
   (its :class:`~epd_actors.backends.base.WorkerRequirement`) is *refused* the same way: logged
   at error level, shown in ``status().refused``, the connection closed, and
   checked again on the next connection -- a worker restarted with the right
   role is accepted then;
2. serve the connection with three tasks in one nursery: the *reader* decodes
   frames and routes each reply to its request; the *writer* is the only task
   that writes (see Writes below); the *heartbeat* queues a ``Ping`` every
   ``heartbeat_interval_s`` inside a watchdog scope whose deadline every frame
   received -- a ``Pong``, a delta, any reply -- pushes ``heartbeat_timeout_s``
   ahead.  The first task to fail (a lost stream, a protocol error, a silent
   worker, a stuck write) or a deliberate close ends the connection, and only
   the connection: ``run`` logs and carries on;
3. fail every request still in flight on it with ``WorkerDisconnected``.
   A worker whose ``Pong`` says its engine is no longer ready is down too,
   though its connection stays: its stage requests fail the same way at once
   (and are aborted there), as an ``openai_http`` worker's do when its health
   probes fail, so the stages move to other workers;
4. wait a jittered exponential backoff (back to its start value after a
   connection that was welcomed) and start again at 1.

Requests.  ``run_stage``, ``open_stream`` and ``release`` register a
:class:`_Pending` entry under the request id (a duplicate is a
``LocalProtocolError``), write the request, and read the replies from the
entry's bounded channel.  The reader never waits for a consumer: it uses
``send_nowait``, and a full channel fails *that* request with ``StreamOverrun``
and aborts it on the worker, while every other request carries on.  A failure
(overrun, lost connection) is raised by the request's next receive, dropping
replies still buffered; a request whose terminal reply has arrived is never
failed.  Messages for request ids nobody waits for (a late ``Aborted``, replies
to an abandoned request) are ignored at debug level.  A message that breaks the
protocol (garbage, a message only clients send, a reply of the wrong kind)
closes the connection, is logged at error level, and the supervisor reconnects.

Writes.  Requests, aborts and pings are encoded by the task that makes them
and queued in the connection's :class:`_Outbox`; one writer task per
connection takes everything queued so far and writes it with one ``send_all``,
so a burst of thousands of requests costs a few writes instead of a queue of
writers draining one frame per scheduling round.  Request frames go in the
data queue, bounded by ``write_queue_frames`` and ``write_queue_bytes``: a
request that finds it full waits (backpressure) until the writer takes the
queue, under the caller's own deadline -- cancelled there, nothing was queued
and nothing is sent.  ``Ping`` and ``Abort`` go in the control queue, which is
not bounded by those limits and is written ahead of the data, so the
heartbeat never waits behind requests.  ``write_timeout_s`` bounds the
writer's ``send_all`` only (a peer that stopped reading), not time spent
queued; when it passes, the connection is closed -- a partial frame would
garble every request multiplexed behind it -- and its requests fail with
``WorkerDisconnected``.

Cancellation.  Every exit from a request whose frame was queued, before its
terminal reply -- a cancelled caller, a stream context left early, an overrun
-- queues ``Abort`` and waits for ``Aborted``, shielded and bounded by
``abort_timeout_s``; the entry is unregistered on every path, so
``statistics().in_flight`` is exact.  An ``Abort`` for a request whose frame
the writer has not taken yet is queued behind that frame, so the worker
always sees the request before its abort.

Drain.  After the worker's ``Goodbye``, ``status().draining`` stays true until
a new connection is welcomed.  New stage requests are refused locally with
``RemoteWorkerError(code="draining", retryable=True)`` -- the answer the worker
would give -- while releases still go through and in-flight work finishes.
"""

from __future__ import annotations

import enum
import logging
import random
from contextlib import asynccontextmanager
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING

import trio

from ... import addresses
from ...errors import (
    ConnectionLost,
    HandshakeRejected,
    LocalProtocolError,
    RemoteProtocolError,
    RemoteWorkerError,
    StreamOverrun,
    WorkerDisconnected,
)
from ...limits import CLEANUP_TIMEOUT_S
from ...lora import announced_adapters
from ...protocol import (
    PROTOCOL_VERSION,
    TRACEPARENT_CAPABILITY,
    Abort,
    Aborted,
    Delta,
    EncodeRequest,
    ErrorCode,
    ErrorReply,
    GenerateRequest,
    Goodbye,
    Hello,
    Message,
    Ping,
    Pong,
    PrefillRequest,
    Release,
    Released,
    StageResult,
    Welcome,
    WorkerStats,
    deltas_mergeable,
    encode,
    merge_deltas,
)
from ...trace_context import CURRENT_TRACEPARENT
from ...transport.framed import FramedStream
from ..base import ANY_WORKER, BackendStatus, WorkerRequirement
from .requests import (
    _RELEASE_REPLIES,
    _STAGE_REPLIES,
    _STREAM_REPLIES,
    NativeDeltaStream,
    _Connection,
    _Outgoing,
    _Pending,
    _Reply,
)
from .settings import DEFAULT_SETTINGS, NativeBackendStatistics, NativeSettings

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable

    from ...addresses import Address

__all__ = [
    "DEFAULT_SETTINGS",
    "NativeBackend",
    "NativeBackendStatistics",
    "NativeDeltaStream",
    "NativeSettings",
]

logger = logging.getLogger(__name__)


class _Outcome(enum.Enum):
    """How one connection attempt ended; decides the next backoff."""

    WELCOMED = "welcomed"
    FAILED = "failed"
    REJECTED = "rejected"


class NativeBackend:
    """One native worker, as the stage actors see it (a ``StageBackend``).

    See the module docstring for how the connection is kept and multiplexed.

    Args:
        worker_id: the router's name for the worker (logs, errors).
        address: where the worker listens.
        auth_token: presented in ``Hello``; never logged.
        settings: deadlines and capacities.
        client_id: how this router introduces itself.
        connect: opens a byte stream to the worker; defaults to dialling
            ``address``.  Tests pass one that returns a memory stream.
        rng: source of the reconnect jitter.
    """

    def __init__(
        self,
        worker_id: str,
        address: Address,
        *,
        auth_token: str,
        settings: NativeSettings = DEFAULT_SETTINGS,
        client_id: str = "epd_actors-router",
        connect: Callable[[], Awaitable[trio.abc.Stream]] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.address = address
        self.settings = settings
        self.client_id = client_id
        self.welcome: Welcome | None = None
        self.requirement = ANY_WORKER
        self._refused: str | None = None
        self._refusals = 0
        self._auth_token = auth_token
        self._connect = connect or partial(addresses.open_stream, address)
        self._rng = rng or random.Random()
        self._running = False
        self._conn: _Connection | None = None
        self._connected = trio.Event()
        self._ready = trio.Event()
        self._draining = False
        self._worker_stats: WorkerStats | None = None
        self._pending: dict[str, _Pending] = {}
        self._serial = 0
        self._failures_in_a_row = 0
        self._connects = 0
        self._connect_failures = 0
        self._rejections = 0
        self._disconnects = 0
        self._overruns = 0
        self._aborts_sent = 0
        self._writes = 0
        self._frames_written = 0
        self._last_rtt_s: float | None = None

    def __repr__(self) -> str:
        state = "disconnected" if self._conn is None else "connected"
        if self._draining:
            state += ",draining"
        return (
            f"<NativeBackend {self.worker_id} {self.address} {state} "
            f"in_flight={len(self._pending)}>"
        )

    # ------------------------------------------------------------ introspection

    def status(self) -> BackendStatus:
        """Connection and readiness as the pool routes by them (no I/O)."""
        stats = self._worker_stats
        conn = self._conn
        return BackendStatus(
            connected=conn is not None,
            draining=self._draining,
            ready=conn is not None and stats is not None and stats.engine_ready,
            worker_load=0 if stats is None else stats.running + stats.queued,
            aborts_sent=self._aborts_sent,
            worker_aborts=None if stats is None else stats.aborts,
            refused=self._refused,
            refusals=self._refusals,
            max_concurrency=0 if conn is None else conn.welcome.max_concurrency,
            adapters=frozenset() if conn is None else announced_adapters(conn.welcome.capabilities),
        )

    def expect(self, requirement: WorkerRequirement) -> None:
        """Check every ``Welcome`` against ``requirement`` (the current one at once).

        A connected worker that does not fit is refused now: its connection
        is closed, and its requests fail with ``WorkerDisconnected``.
        """
        self.requirement = requirement
        conn = self._conn
        if conn is None:
            return
        problem = self._problem(conn.welcome)
        if problem is not None:
            self._refuse(conn.welcome, problem)
            conn.close(f"refused: {problem}")

    def statistics(self) -> NativeBackendStatistics:
        """A snapshot of the counters (cheap; safe at any time)."""
        welcome = self.welcome
        return NativeBackendStatistics(
            worker_id=self.worker_id,
            connected=self._conn is not None,
            draining=self._draining,
            in_flight=len(self._pending),
            connects=self._connects,
            connect_failures=self._connect_failures,
            handshake_rejections=self._rejections,
            refusals=self._refusals,
            disconnects=self._disconnects,
            overruns=self._overruns,
            aborts_sent=self._aborts_sent,
            last_rtt_s=self._last_rtt_s,
            role=None if welcome is None else welcome.role,
            model=None if welcome is None else welcome.model,
            writes=self._writes,
            frames_written=self._frames_written,
        )

    async def wait_connected(self) -> None:
        """Return once a connection is welcomed (at once if one is).

        Cancellation: safe.
        """
        if self._conn is not None:
            await trio.lowlevel.checkpoint()
            return
        while self._conn is None:
            await self._connected.wait()

    async def wait_ready(self) -> None:
        """Return once connected and the engine answered a heartbeat as ready.

        Cancellation: safe.
        """
        while not self.status().ready:
            await self._ready.wait()
        await trio.lowlevel.checkpoint()

    # ------------------------------------------------------------ supervisor

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep a connection to the worker, forever (see the module docstring).

        Reports started at once, before the first connection attempt.  Worker
        failures of every kind are logged and end only the connection.

        Raises:
            trio.BusyResourceError: ``run`` is already running for this backend.

        Cancellation: closes the connection and fails every request in flight
        with ``WorkerDisconnected``; the backend then stays disconnected.
        Resource handling: owns the connection's stream and tasks; nothing it
        starts outlives it.
        """
        if self._running:
            raise trio.BusyResourceError(f"{self!r} is already running")
        self._running = True
        task_status.started()
        try:
            await self._supervise()
        finally:
            self._running = False

    async def _supervise(self) -> None:
        settings = self.settings
        backoff = settings.reconnect_backoff_start_s
        while True:
            outcome = await self._attempt()
            if outcome is _Outcome.WELCOMED:
                backoff = settings.reconnect_backoff_start_s
            if outcome is _Outcome.REJECTED:
                wait = settings.reconnect_backoff_max_s
            else:
                wait, backoff = backoff, min(backoff * 2, settings.reconnect_backoff_max_s)
            await trio.sleep(wait * (1.0 - settings.reconnect_jitter * self._rng.random()))

    async def _attempt(self) -> _Outcome:
        """Dial, handshake and, once welcomed, serve the connection until it ends."""
        stream = await self._dial()
        if stream is None:
            return _Outcome.FAILED
        peer = f"{self.worker_id}@{self.address}"
        framed = FramedStream(stream, max_frame_bytes=self.settings.max_frame_bytes, peer=peer)
        try:
            welcome = await self._handshake(framed)
        except HandshakeRejected as exc:
            self._rejections += 1
            logger.error(
                "worker %s at %s rejected our hello: %s", self.worker_id, self.address, exc
            )
            return _Outcome.REJECTED
        except (WorkerDisconnected, ConnectionLost, RemoteProtocolError) as exc:
            self._attempt_failed("handshake failed", exc)
            return _Outcome.FAILED
        else:
            problem = self._problem(welcome)
            if problem is not None:
                self._refuse(welcome, problem)
                return _Outcome.REJECTED
            await self._serve_connection(framed, welcome)
            return _Outcome.WELCOMED
        finally:
            with trio.move_on_after(CLEANUP_TIMEOUT_S, shield=True):
                await framed.aclose()

    async def _dial(self) -> trio.abc.Stream | None:
        with trio.move_on_after(self.settings.connect_timeout_s):
            try:
                return await self._connect()
            except OSError as exc:
                self._attempt_failed("cannot connect", exc)
                return None
        self._attempt_failed(
            "cannot connect", f"no connection within {self.settings.connect_timeout_s} s"
        )
        return None

    def _problem(self, welcome: Welcome) -> str | None:
        """Why the pool cannot use the worker that sent ``welcome``, or None."""
        return self.requirement.problem(
            role=welcome.role, models=(welcome.model,), max_concurrency=welcome.max_concurrency
        )

    def _refuse(self, welcome: Welcome, problem: str) -> None:
        """Count and log a refused worker; the first refusal of a series at error level."""
        level = logging.ERROR if problem != self._refused else logging.DEBUG
        self._refused = problem
        self._refusals += 1
        logger.log(
            level,
            "refusing worker %s at %s (announced %s: role %r, model %r, max_concurrency %d): "
            "%s; it gets no requests until it reconnects announcing what the pool needs",
            self.worker_id,
            self.address,
            welcome.worker_id,
            welcome.role,
            welcome.model,
            welcome.max_concurrency,
            problem,
        )

    def _attempt_failed(self, what: str, detail: object) -> None:
        """Count a failed attempt; only the first of a series is logged above debug."""
        self._connect_failures += 1
        self._failures_in_a_row += 1
        level = logging.WARNING if self._failures_in_a_row == 1 else logging.DEBUG
        logger.log(level, "worker %s at %s: %s: %s", self.worker_id, self.address, what, detail)

    async def _handshake(self, framed: FramedStream) -> Welcome:
        """Send ``Hello`` and return the ``Welcome``.

        Raises:
            HandshakeRejected: the worker refused (token, version).
            WorkerDisconnected: no answer in time, or the worker hung up.
            ConnectionLost, RemoteProtocolError: from the stream.
        """
        reply: Message | None = None
        with trio.move_on_after(self.settings.handshake_timeout_s) as scope:
            await framed.send(Hello(PROTOCOL_VERSION, self._auth_token, self.client_id))
            reply = await framed.receive()
        if scope.cancelled_caught:
            raise WorkerDisconnected(f"no welcome within {self.settings.handshake_timeout_s} s")
        if reply is None:
            raise WorkerDisconnected("the worker closed the connection during the handshake")
        if isinstance(reply, ErrorReply):
            raise HandshakeRejected(f"{reply.code}: {reply.message}")
        if not isinstance(reply, Welcome):
            raise RemoteProtocolError(f"expected a welcome, got {reply.TAG!r}")
        if reply.protocol_version != PROTOCOL_VERSION:
            raise HandshakeRejected(f"the worker speaks protocol {reply.protocol_version}")
        return reply

    async def _serve_connection(self, framed: FramedStream, welcome: Welcome) -> None:
        settings = self.settings
        conn = _Connection(
            framed,
            welcome,
            max_frames=settings.write_queue_frames,
            max_bytes=settings.write_queue_bytes,
        )
        try:
            with conn.scope:
                async with trio.open_nursery() as nursery:
                    conn.nursery = nursery
                    self._connection_up(conn)
                    name = self.worker_id
                    nursery.start_soon(self._read_loop, conn, name=f"native-reader:{name}")
                    nursery.start_soon(self._write_loop, conn, name=f"native-writer:{name}")
                    nursery.start_soon(self._heartbeat_loop, conn, name=f"native-heartbeat:{name}")
        except* RemoteProtocolError as group:
            conn.reason = conn.reason or f"protocol error: {group.exceptions[0]}"
            logger.error(
                "worker %s at %s broke the protocol: %s; reconnecting",
                self.worker_id,
                self.address,
                group.exceptions[0],
            )
        except* (ConnectionLost, WorkerDisconnected) as group:
            conn.reason = conn.reason or str(group.exceptions[0])
            level = logging.DEBUG if self._draining else logging.ERROR
            logger.log(
                level,
                "connection to worker %s at %s lost: %s",
                self.worker_id,
                self.address,
                group.exceptions[0],
            )
        finally:
            self._connection_down(conn)

    def _connection_up(self, conn: _Connection) -> None:
        self._conn = conn
        self.welcome = conn.welcome
        self._refused = None
        self._draining = False
        self._worker_stats = None
        self._connects += 1
        self._failures_in_a_row = 0
        self._connected.set()
        logger.info(
            "connected to worker %s at %s (announced %s, role %s, model %s)",
            self.worker_id,
            self.address,
            conn.welcome.worker_id,
            conn.welcome.role,
            conn.welcome.model,
        )

    def _connection_down(self, conn: _Connection) -> None:
        reason = conn.reason or "connection closed"
        conn.outbox.close()
        if self._conn is conn:
            self._conn = None
            self._connected = trio.Event()
            self._ready = trio.Event()
        self._disconnects += 1
        self._worker_stats = None
        for pending in list(self._pending.values()):
            if pending.connection is conn and not pending.settled.is_set():
                pending.fail(
                    WorkerDisconnected(
                        f"connection to worker {self.worker_id} at {self.address} lost: {reason}"
                    )
                )
                pending.settle()

    # ------------------------------------------------------------ connection tasks

    async def _read_loop(self, conn: _Connection) -> None:
        """Decode and route replies until the connection ends (the only reader).

        Every read proves the worker alive: it pushes the heartbeat watchdog's
        deadline ``heartbeat_timeout_s`` ahead, as a ``Pong`` does.  The frames
        that came in one read are routed together, with one deadline change;
        the deltas of one read that go to a stream's sink are merged per stream
        and handed over at the end of the read (:meth:`_hand_over`).
        """
        timeout = self.settings.heartbeat_timeout_s
        watchdog = conn.watchdog
        framed = conn.framed
        while conn.reason is None:
            message = await framed.receive()
            watchdog.deadline = trio.current_time() + timeout
            if message is None:
                level = logging.DEBUG if self._draining else logging.ERROR
                logger.log(
                    level, "worker %s at %s closed the connection", self.worker_id, self.address
                )
                conn.close("the worker closed the connection")
                return
            try:
                self._dispatch(conn, message)
                while conn.reason is None:
                    try:
                        message = framed.receive_nowait()
                    except trio.WouldBlock:
                        break
                    self._dispatch(conn, message)
            finally:
                # Even when a bad frame ends the connection: what came before it stands.
                for pending, run in conn.held.items():
                    self._hand_over(conn, pending, run)
                conn.held.clear()

    def _dispatch(self, conn: _Connection, message: Message) -> None:
        """Route one message (synchronous: the reader never waits on a consumer)."""
        match message:
            case Delta():  # first: nearly every frame is one
                self._route(conn, message)
            case Pong():
                self._on_pong(conn, message)
            case Goodbye():
                if not self._draining:
                    logger.info("worker %s said goodbye: %s", self.worker_id, message.reason)
                self._draining = True
            case ErrorReply(request_id=""):
                logger.error(
                    "worker %s at %s reported a connection error: %s: %s; reconnecting",
                    self.worker_id,
                    self.address,
                    message.code,
                    message.message,
                )
                conn.close(f"connection error {message.code}: {message.message}")
            case StageResult() | ErrorReply() | Released():
                self._route(conn, message)
            case Aborted():
                self._on_aborted(conn, message)
            case _:
                raise RemoteProtocolError(f"a worker may not send {message.TAG!r} after welcome")

    def _route(self, conn: _Connection, message: _Reply) -> None:
        pending = self._pending.get(message.request_id)
        if pending is None or pending.connection is not conn:
            logger.debug(
                "worker %s: ignoring %s for unknown request %r",
                self.worker_id,
                message.TAG,
                message.request_id,
            )
            return
        if not isinstance(message, pending.expects):
            raise RemoteProtocolError(
                f"{pending.stage} request {pending.request_id!r} answered with {message.TAG!r}"
            )
        if not pending.accepting:
            logger.debug(
                "worker %s: dropping %s for request %r (no longer read)",
                self.worker_id,
                message.TAG,
                message.request_id,
            )
            return
        if type(message) is Delta and message.finish_reason is None:
            conn.held.setdefault(pending, []).append(message)  # for the end of this read
            return
        run = conn.held.pop(pending, None)
        if run is not None:
            self._hand_over(conn, pending, run)  # the deltas before this reply go first
        self._finish(conn, pending, message)

    def _finish(self, conn: _Connection, pending: _Pending, message: _Reply) -> None:
        """Queue the reply that ends a request (never to its sink) and settle the request."""
        if not pending.accepting:  # the deltas before it overran
            return
        try:
            pending.send_channel.queue_nowait(message)
        except trio.WouldBlock:
            self._overrun(conn, pending)
            return
        pending.settle()

    def _hand_over(self, conn: _Connection, pending: _Pending, run: list[Delta]) -> None:
        """Send a stream's non-final deltas of one read, merged (to its sink, while it takes them).

        They are merged only when the merge keeps everything
        (:func:`~epd_actors.protocol.deltas_mergeable`): how a read splits a
        stream must not change what the caller gets.  Without ``merge_reads``
        (``[server] stream_coalescing = "off"``) they go on one by one, as the
        worker framed them.
        """
        if len(run) == 1:  # one token per read and stream: the engine's pace
            self._send_delta(conn, pending, run[0])
            return
        mixed = not self.settings.merge_reads or not deltas_mergeable(run)
        for delta in run if mixed else (merge_deltas(run),):
            self._send_delta(conn, pending, delta)

    def _send_delta(self, conn: _Connection, pending: _Pending, delta: Delta) -> None:
        """Send a non-final delta to the request's consumer: to its sink, while it takes them."""
        if not pending.accepting:
            return
        try:
            pending.send_channel.send_nowait(delta)
        except trio.WouldBlock:
            self._overrun(conn, pending)

    def _overrun(self, conn: _Connection, pending: _Pending) -> None:
        """Fail the one request whose reader fell behind, and abort it on the worker."""
        self._overruns += 1
        capacity = self.settings.request_buffer
        logger.warning(
            "request %r on worker %s fell %d replies behind; aborting it",
            pending.request_id,
            self.worker_id,
            capacity,
        )
        pending.fail(
            StreamOverrun(
                f"request {pending.request_id!r} on worker {self.worker_id} "
                f"fell {capacity} replies behind and was aborted"
            )
        )
        pending.abort_sent = True
        self._aborts_sent += 1
        conn.outbox.put_after(pending.number, self._encode(Abort(pending.request_id)))

    def _on_pong(self, conn: _Connection, pong: Pong) -> None:
        now = trio.current_time()  # the reader pushed the watchdog already
        sent_at = conn.pings.pop(pong.nonce, None)
        if sent_at is not None:
            self._last_rtt_s = now - sent_at
        for nonce in [n for n in conn.pings if n < pong.nonce]:
            del conn.pings[nonce]
        was_ready = self._worker_stats is not None and self._worker_stats.engine_ready
        self._worker_stats = pong.stats
        if pong.stats.engine_ready and self._conn is conn:
            self._ready.set()
        elif was_ready:
            self._engine_down(conn)

    def _engine_down(self, conn: _Connection) -> None:
        """The engine stopped being ready: fail and abort every stage request on ``conn``.

        Releases still go through (a worker frees handles without its engine's help).
        """
        logger.warning("worker %s reports its engine not ready", self.worker_id)
        for pending in list(self._pending.values()):
            if pending.connection is not conn or pending.settled.is_set() or not pending.abortable:
                continue
            pending.fail(
                WorkerDisconnected(
                    f"worker {self.worker_id} reported its engine not ready while "
                    f"{pending.request_id!r} ran"
                )
            )
            if pending.sent and not pending.abort_sent:
                pending.abort_sent = True
                self._aborts_sent += 1
                conn.outbox.put_after(pending.number, self._encode(Abort(pending.request_id)))

    def _on_aborted(self, conn: _Connection, message: Aborted) -> None:
        pending = self._pending.get(message.request_id)
        if pending is None or pending.connection is not conn or not pending.abort_sent:
            logger.debug(
                "worker %s: ignoring aborted for request %r", self.worker_id, message.request_id
            )
            return
        pending.settle()

    async def _heartbeat_loop(self, conn: _Connection) -> None:
        """Queue a ping every interval; raise once nothing came for ``heartbeat_timeout_s``.

        The ``Ping`` goes in the outbox's control queue: it never waits behind
        request frames.

        Raises:
            WorkerDisconnected: the watchdog deadline (pushed by every frame
                received) passed.
        """
        settings = self.settings
        conn.watchdog.deadline = trio.current_time() + settings.heartbeat_timeout_s
        with conn.watchdog:
            while True:
                conn.nonce += 1
                conn.pings[conn.nonce] = trio.current_time()
                conn.outbox.put_control(self._encode(Ping(conn.nonce)))
                await trio.sleep(settings.heartbeat_interval_s)
        raise WorkerDisconnected(
            f"no pong for {settings.heartbeat_timeout_s} s and no other frame either"
        )

    async def _write_loop(self, conn: _Connection) -> None:
        """Write everything queued in the outbox, one ``send_all`` per batch (the only writer).

        Raises:
            WorkerDisconnected: the stream broke, or one write took longer than
                ``write_timeout_s`` (the connection is then given up: a partial
                frame cannot be taken back).
        """
        outbox = conn.outbox
        timeout = self.settings.write_timeout_s
        while True:
            await outbox.wait_for_work()
            batch, count = outbox.take()
            with trio.move_on_after(timeout) as scope:
                try:
                    await conn.framed.send_encoded(batch, count)
                except ConnectionLost as exc:
                    raise WorkerDisconnected(f"worker {self.worker_id}: {exc}") from exc
            if scope.cancelled_caught:
                raise WorkerDisconnected(
                    f"writing {count} frames ({len(batch)} bytes) to worker {self.worker_id} "
                    f"took over {timeout} s"
                )
            self._writes += 1
            self._frames_written += count

    def _encode(self, message: Message) -> bytes:
        """One frame, under the connection's frame limit.

        Raises:
            LocalProtocolError: the message is invalid or too large.
        """
        return encode(message, max_frame_bytes=self.settings.max_frame_bytes)

    # ------------------------------------------------------------ requests

    async def run_stage(self, request: EncodeRequest | PrefillRequest) -> StageResult:
        """Send an encode or prefill request and wait for its result.

        Raises:
            RemoteWorkerError: the worker answered with an error (or is draining).
            WorkerDisconnected: not connected, or the connection was lost.
            LocalProtocolError: ``request_id`` is already in flight here, or the
                request cannot be encoded.

        Cancellation: the worker is told to abort, and ``Aborted`` awaited,
        shielded and bounded by ``abort_timeout_s``.
        Backpressure: queueing the request waits while the connection's write
        queue is full (see the module docstring).
        Resource handling: the request is unregistered on every path.
        """
        pending = await self._submit(request, _STAGE_REPLIES)
        try:
            reply = await pending.receive()
        finally:
            await self._settle(pending)
        assert isinstance(reply, StageResult)  # the reader checked the reply kind
        return reply

    @asynccontextmanager
    async def open_stream(self, request: GenerateRequest) -> AsyncIterator[NativeDeltaStream]:
        """Send a generate request; the context yields its :class:`NativeDeltaStream`.

        Raises:
            RemoteWorkerError: the worker is draining (on entry).
            WorkerDisconnected: not connected (on entry).
            LocalProtocolError: ``request_id`` is already in flight here.

        Cancellation: leaving the context before the terminal delta, for any
        reason, aborts the request on the worker and awaits ``Aborted``,
        shielded and bounded by ``abort_timeout_s``.
        Backpressure: see :meth:`NativeDeltaStream.receive`.
        Resource handling: the request is unregistered when the context exits.
        """
        pending = await self._submit(request, _STREAM_REPLIES)
        try:
            yield NativeDeltaStream(pending)
        finally:
            await self._settle(pending)

    async def release(self, kv_transfer_params: dict[str, object]) -> bool:
        """Free a prefilled KV handle on the worker; False if it was already gone.

        Sent under an internal request id (``release:<n>``); allowed while the
        worker drains.

        Raises:
            RemoteWorkerError: the worker answered with an error.
            WorkerDisconnected: not connected, or the connection was lost.

        Cancellation: safe; a late ``Released`` is ignored (there is nothing to abort).
        Resource handling: the internal id is unregistered on every path.
        """
        self._serial += 1
        while f"release:{self._serial}" in self._pending:
            self._serial += 1
        message = Release(f"release:{self._serial}", kv_transfer_params)
        pending = await self._submit(message, _RELEASE_REPLIES)
        try:
            reply = await pending.receive()
        finally:
            await self._settle(pending)
        assert isinstance(reply, Released)  # the reader checked the reply kind
        return reply.found

    async def _submit(self, message: _Outgoing, expects: tuple[type[_Reply], ...]) -> _Pending:
        """Register ``message`` and queue it for the writer; see ``run_stage`` for what it raises.

        Waits, cancellably, while the write queue is full; a caller cancelled
        there has queued nothing.  A failed write fails the request through
        the connection (its next receive raises ``WorkerDisconnected``).
        """
        conn = self._conn
        if conn is None:
            raise WorkerDisconnected(f"worker {self.worker_id} at {self.address} is not connected")
        if self._draining and not isinstance(message, Release):
            raise RemoteWorkerError(
                ErrorCode.DRAINING,
                "the worker said goodbye and takes no new requests",
                retryable=True,
                worker_id=self.worker_id,
                stage=message.TAG,
                request_id=message.request_id,
            )
        if message.request_id in self._pending:
            raise LocalProtocolError(
                f"request {message.request_id!r} is already in flight on worker {self.worker_id}"
            )
        message = _traced(message, conn.welcome.capabilities)
        frame = self._encode(message)
        pending = _Pending(
            message,
            conn,
            worker_id=self.worker_id,
            expects=expects,
            capacity=self.settings.request_buffer,
        )
        self._pending[pending.request_id] = pending
        outbox = conn.outbox
        try:
            await outbox.wait_for_room(len(frame))
        except BaseException:
            self._unregister(pending)
            raise
        if outbox.closed:
            self._unregister(pending)
            raise pending.failure or WorkerDisconnected(
                f"connection to worker {self.worker_id} at {self.address} lost: "
                f"{conn.reason or 'connection closed'}"
            )
        pending.number = outbox.put_data(frame)
        pending.sent = True
        return pending

    async def _settle(self, pending: _Pending) -> None:
        """Cleanup on every exit from a request: abort it if the worker may hold it, unregister.

        Cancellation: shielded, and bounded by ``abort_timeout_s``.
        """
        pending.stop_accepting()
        if pending.settled.is_set() or not pending.sent or not pending.abortable:
            self._unregister(pending)  # nothing to abort: no scope, no wait
            return
        try:
            with trio.move_on_after(self.settings.abort_timeout_s, shield=True) as scope:
                await self._abort(pending)
            if scope.cancelled_caught:
                logger.warning(
                    "worker %s did not confirm the abort of %r within %s s",
                    self.worker_id,
                    pending.request_id,
                    self.settings.abort_timeout_s,
                )
        finally:
            self._unregister(pending)

    async def _abort(self, pending: _Pending) -> None:
        if pending.settled.is_set() or not pending.sent or not pending.abortable:
            return
        if not pending.abort_sent:
            pending.abort_sent = True
            self._aborts_sent += 1
            outbox = pending.connection.outbox
            if outbox.closed:
                # The worker aborts every request of a lost connection itself.
                logger.debug("abort of %r not sent: the connection is gone", pending.request_id)
                return
            outbox.put_after(pending.number, self._encode(Abort(pending.request_id)))
        await pending.settled.wait()

    def _unregister(self, pending: _Pending) -> None:
        if self._pending.get(pending.request_id) is pending:
            del self._pending[pending.request_id]
        pending.stop_accepting()
        pending.receive_channel.close()


def _traced(message: _Outgoing, capabilities: tuple[str, ...]) -> _Outgoing:
    """``message`` with the current attempt's ``traceparent``, for a worker that takes it.

    Unchanged for a ``Release``, outside a traced attempt, or for a worker
    whose ``Welcome`` does not announce ``TRACEPARENT_CAPABILITY`` (one that
    predates the field refuses unknown fields).
    """
    value = CURRENT_TRACEPARENT.get()
    if value is None or isinstance(message, Release) or TRACEPARENT_CAPABILITY not in capabilities:
        return message
    return replace(message, traceparent=value)
