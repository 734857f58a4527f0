"""One client connection of the worker runtime: handshake, reader/dispatcher, jobs, delta pump.

:class:`~.runtime.WorkerServer` makes one :class:`Connection` per client stream and
hands it the worker's shared :class:`~.state.WorkerState`;
the module docstring of :mod:`.runtime` describes how connections, jobs and
drains fit together.
"""

from __future__ import annotations

import hmac
import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import trio

from ..errors import ConnectionLost, EngineCrashed, EngineError, RemoteProtocolError
from ..limits import CLEANUP_TIMEOUT_S, WORKER_DELTA_BUFFER
from ..protocol import (
    SUPPORTED_PROTOCOL_VERSIONS,
    TRACEPARENT_CAPABILITY,
    Abort,
    Aborted,
    Delta,
    Drain,
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
    StageRequest,
    StageResult,
    Welcome,
    deltas_mergeable,
    merge_deltas,
)
from .engine import check_options

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from ..transport.framed import FramedStream
    from .engine import Engine
    from .state import WorkerState

logger = logging.getLogger(__name__)


class StopReason:
    """Why the runtime cancelled a job; decides what, if anything, is answered."""

    ABORT = "abort"
    SHUTDOWN = "shutdown"
    DISCONNECT = "disconnect"


class _Job:
    """One stage request running on a connection."""

    __slots__ = ("request_id", "scope", "stop_reason")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.scope = trio.CancelScope()
        self.stop_reason: str | None = None

    def stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
        self.scope.cancel(reason=f"job stopped: {reason}")


class Connection:
    """One client connection: handshake, reader/dispatcher, and its jobs.

    Args:
        state: the worker's shared admission and counters.
        engine: the engine doing the stage work.
        framed: the connection's message stream.
    """

    def __init__(self, state: WorkerState, engine: Engine, framed: FramedStream) -> None:
        self.state = state
        self.engine = engine
        self.framed = framed
        self.jobs: dict[str, _Job] = {}
        self._nursery: trio.Nursery | None = None
        self._read_scope = trio.CancelScope()
        self._handlers: dict[type[Any], Callable[[Any], None]] = {
            EncodeRequest: self._on_stage_request,
            PrefillRequest: self._on_stage_request,
            GenerateRequest: self._on_stage_request,
            Abort: self._on_abort,
            Release: self._on_release,
            Ping: self._on_ping,
            Drain: self._on_drain,
        }

    def __repr__(self) -> str:
        return f"<Connection peer={self.framed.peer} jobs={len(self.jobs)}>"

    async def run(self) -> None:
        if not await self._handshake():
            return
        self.state.connections.add(self)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                try:
                    if self.state.draining:
                        self.say_goodbye("draining")
                    with self._read_scope:
                        await self._read_loop()
                    self.stop_jobs(StopReason.DISCONNECT)
                finally:
                    # From here on the nursery only winds down: nothing new may
                    # start in it (a drain that begins now has nobody to greet).
                    self._nursery = None
        finally:
            self.state.connections.discard(self)

    async def _handshake(self) -> bool:
        config = self.state.config
        hello: Message | None = None
        with trio.move_on_after(config.handshake_timeout_s):
            try:
                hello = await self.framed.receive()
            except RemoteProtocolError as exc:
                await self._refuse(ErrorCode.PROTOCOL_ERROR, f"bad handshake frame: {exc}")
                return False
        if hello is None:
            logger.debug("connection %s closed before its handshake", self.framed.peer)
            return False
        if not isinstance(hello, Hello):
            await self._refuse(ErrorCode.PROTOCOL_ERROR, f"expected hello, got {type(hello).TAG}")
            return False
        if hello.protocol_version not in SUPPORTED_PROTOCOL_VERSIONS:
            await self._refuse(
                ErrorCode.UNSUPPORTED_VERSION,
                f"protocol version {hello.protocol_version} not supported "
                f"(this worker speaks {', '.join(map(str, SUPPORTED_PROTOCOL_VERSIONS))})",
            )
            return False
        expected = config.auth_token
        if expected is not None and not hmac.compare_digest(
            hello.auth_token.encode(), expected.encode()
        ):
            await self._refuse(ErrorCode.UNAUTHORIZED, "bad auth token")
            return False
        await self.framed.send(
            Welcome(
                protocol_version=hello.protocol_version,
                worker_id=config.worker_id,
                role=self.engine.role.value,
                model=self.engine.model,
                capabilities=(*self.engine.capabilities, TRACEPARENT_CAPABILITY),
                max_concurrency=config.max_concurrency,
            )
        )
        logger.debug("connection %s: client %s welcomed", self.framed.peer, hello.client_id)
        return True

    async def _refuse(self, code: str, message: str) -> None:
        logger.warning("refusing connection %s: %s", self.framed.peer, message)
        self.state.protocol_errors_total += code == ErrorCode.PROTOCOL_ERROR
        await self._send_quietly(ErrorReply("", code, message, retryable=False))

    async def _read_loop(self) -> None:
        while True:
            try:
                message = await self.framed.receive()
            except RemoteProtocolError as exc:
                self.state.protocol_errors_total += 1
                logger.warning("protocol error from %s: %s", self.framed.peer, exc)
                await self._send_quietly(ErrorReply("", ErrorCode.PROTOCOL_ERROR, str(exc)))
                return
            if message is None:
                return
            handler = self._handlers.get(type(message))
            if handler is None:
                self.state.protocol_errors_total += 1
                await self._send_quietly(
                    ErrorReply(
                        message.request_id,
                        ErrorCode.PROTOCOL_ERROR,
                        f"a client may not send {type(message).TAG!r}",
                    )
                )
                return
            handler(message)

    # -- dispatch table entries (synchronous: they only start tasks)

    def _on_stage_request(self, request: StageRequest) -> None:
        request_id = request.request_id
        try:
            if request_id in self.jobs:
                raise EngineError(
                    ErrorCode.DUPLICATE_REQUEST, f"request {request_id!r} is already running"
                )
            check_options(request, self.engine)
            self.state.admit()
        except EngineError as exc:
            self.state.refused_total += 1
            self._spawn(self._send_quietly, _error_reply(request_id, exc))
            return
        job = _Job(request_id)
        self.jobs[request_id] = job
        self._spawn(self._run_job, job, request)

    def _on_abort(self, message: Abort) -> None:
        self.state.aborts_total += 1
        job = self.jobs.get(message.request_id)
        if job is not None:
            job.stop(StopReason.ABORT)
        else:
            self._spawn(self._abort_idle, message.request_id)

    def _on_release(self, message: Release) -> None:
        self._spawn(self._release, message)

    def _on_ping(self, message: Ping) -> None:
        config = self.state.config
        if config.heartbeat_drop:
            return
        self._spawn(self._pong, message.nonce, config.heartbeat_delay_s)

    def _on_drain(self, message: Drain) -> None:
        logger.debug("client on %s will send no new requests", self.framed.peer)

    # -- tasks

    def _spawn(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(fn, *args)

    async def _pong(self, nonce: int, delay_s: float) -> None:
        if delay_s:
            await trio.sleep(delay_s)
        stats = self.state.worker_stats(engine_ready=self.engine.is_ready())
        await self._send_quietly(Pong(nonce, stats))

    async def _abort_idle(self, request_id: str) -> None:
        await self.engine.abort(request_id)
        await self._send_quietly(Aborted(request_id))

    async def _release(self, message: Release) -> None:
        try:
            found = await self.engine.release(message.kv_transfer_params)
        except EngineError as exc:
            await self._send_quietly(_error_reply(message.request_id, exc))
            return
        await self._send_quietly(Released(message.request_id, found))

    async def _run_job(self, job: _Job, request: StageRequest) -> None:
        finished = False
        try:
            with job.scope:
                await self._admitted(request)
                finished = True
        finally:
            if self.jobs.get(job.request_id) is job:
                del self.jobs[job.request_id]
            self.state.job_finished()
            if job.stop_reason is not None or not finished:
                with trio.move_on_after(CLEANUP_TIMEOUT_S, shield=True):
                    await self.engine.abort(job.request_id)
                    await self._answer_stop(job, finished)
            if self.state.draining and not self.jobs:
                self._read_scope.cancel(reason="worker drained this connection")

    async def _answer_stop(self, job: _Job, finished: bool) -> None:
        if job.stop_reason == StopReason.ABORT:
            await self._send_quietly(Aborted(job.request_id))
        elif job.stop_reason == StopReason.SHUTDOWN and not finished:
            await self._send_quietly(
                ErrorReply(
                    job.request_id,
                    ErrorCode.DRAINING,
                    "worker shut down before the request finished",
                    retryable=True,
                )
            )

    async def _admitted(self, request: StageRequest) -> None:
        """Wait for a slot (counted in ``queued`` since admission), then run."""
        async with self.state.slot():
            await self._execute(request)

    async def _execute(self, request: StageRequest) -> None:
        request_id = request.request_id
        try:
            if isinstance(request, GenerateRequest):
                await self._generate(request)
                return
            result = await self._run_stage(request)
        except EngineError as exc:
            await self.framed.send(_error_reply(request_id, exc))
            return
        except (ConnectionLost, EngineCrashed):
            raise
        except Exception:
            logger.exception("engine failed on request %s", request_id)
            await self.framed.send(
                ErrorReply(request_id, ErrorCode.INTERNAL, "internal engine error", retryable=True)
            )
            return
        await self.framed.send(_with_request_id(result, request_id))

    async def _run_stage(self, request: EncodeRequest | PrefillRequest) -> StageResult:
        if isinstance(request, EncodeRequest):
            return await self.engine.encode(request)
        return await self.engine.prefill(request)

    async def _generate(self, request: GenerateRequest) -> None:
        """Run the engine's stream through a bounded channel to the frame pump.

        Backpressure: the engine's ``emit`` blocks once ``WORKER_DELTA_BUFFER``
        deltas wait; the pump writes whatever is queued as one frame.
        """
        send_channel, receive_channel = trio.open_memory_channel[Delta](WORKER_DELTA_BUFFER)
        pump = _DeltaPump(self.framed, request.request_id)
        error: Exception | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump.run, receive_channel)
            async with send_channel:
                try:
                    await self.engine.generate(request, send_channel.send)
                except Exception as exc:  # re-raised below, after the pump flushed
                    error = exc
        if pump.lost is not None:
            raise pump.lost
        if error is not None:
            raise error
        if not pump.finished:
            raise EngineError(ErrorCode.INTERNAL, "engine ended the stream without a finish reason")

    async def _send_quietly(self, message: Message) -> None:
        """Send, ignoring a connection that is already gone (its reader will notice)."""
        try:
            await self.framed.send(message)
        except ConnectionLost:
            logger.debug("could not send %s to %s: connection lost", message.TAG, self.framed.peer)

    # -- control from the server

    def say_goodbye(self, reason: str) -> None:
        if self._nursery is None:
            return
        self._spawn(self._send_quietly, Goodbye(reason))
        if not self.jobs:
            self._read_scope.cancel(reason="worker draining")

    def stop_jobs(self, reason: str) -> None:
        for job in list(self.jobs.values()):
            job.stop(reason)


class _DeltaPump:
    """Writes a generate request's deltas, merging whatever is queued into one frame.

    A lost connection is recorded in ``lost`` rather than raised, so the
    engine's next ``emit`` fails (the channel closes) and the job unwinds
    without an exception group.
    """

    def __init__(self, framed: FramedStream, request_id: str) -> None:
        self._framed = framed
        self._request_id = request_id
        self.finished = False
        self.lost: ConnectionLost | None = None

    async def run(self, receive_channel: trio.MemoryReceiveChannel[Delta]) -> None:
        async with receive_channel:
            async for first in receive_channel:
                batch = [first]
                while True:
                    try:
                        batch.append(receive_channel.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                frames = (merge_deltas(batch),) if deltas_mergeable(batch) else batch
                for frame in frames:
                    framed = _with_request_id(frame, self._request_id)
                    try:
                        await self._framed.send(framed)
                    except ConnectionLost as exc:
                        self.lost = exc
                        return
                    if framed.finish_reason is not None:
                        self.finished = True
                        return


def _with_request_id(message: Any, request_id: str) -> Any:
    """Stamp the job's request id on an engine result (engines may leave it off)."""
    if message.request_id == request_id:
        return message
    return replace(message, request_id=request_id)


def _error_reply(request_id: str, exc: EngineError) -> ErrorReply:
    return ErrorReply(request_id, exc.code, exc.detail, retryable=exc.retryable, param=exc.param)
